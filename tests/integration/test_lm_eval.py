"""lm-evaluation-harness against `kvrail up` (issue 46): its `local-completions` model's
loglikelihood scores equal transformers' log-softmax sums over the same continuation tokens, and
the command in docs/evals.md runs as written.

lm-eval lives in its own virtualenv, `.venv-lmeval` (`make lmeval-env`; `make test` builds it,
and without it these tests fail with that hint), so it runs here as a subprocess: once through
its Python API, with `Instance`s built from `CASES` (no dataset download), and once as the
documented `lm_eval` command on the example task in `examples/lm-eval/`.

For each (context, continuation) lm-eval posts `{"prompt": [[token ids]], "echo": true,
"logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}` to /v1/completions (batch size
1: a batch of one token-id list), then sums `token_logprobs[ctxlen:-1]` of the echoed prompt plus
the one generated token, and calls it greedy when each of those equals the largest value of its
`top_logprobs` entry. The oracle is transformers on the same float32 weights
(`load_transformers_model`: the GGUF file, dequantized), on the token ids lm-eval's own rule gives
(`_split`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvrail.model_files import resolve
from kvrail.testing import up
from kvrail.worker.models.loader import load_transformers_model, prepare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
LMEVAL_BIN = ROOT / ".venv-lmeval" / "bin"
DOCS = ROOT / "docs" / "evals.md"
EXAMPLE_DATA = ROOT / "examples" / "lm-eval" / "capitals.jsonl"
MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4
REMOTE_PREFILL_TOKENS = 24
"""`kvrail up`'s threshold here: the longer cases are prefilled by the prefill worker and their
KV handed to the decode worker, the shorter ones are prefilled by the decode worker itself."""
# No dataset or tokenizer comes from a hub; without these, datasets waits on the network first.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

CASES: list[tuple[str, str]] = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a small village in the south of Germany"),
    ("", "Hello world"),  # an empty context: lm-eval scores the continuation after the BOS token
    ("Question: How many legs does a spider have?\nAnswer:", " Eight"),
    # A chat turn whose greedy next token is the end of turn: the token `max_tokens: 1` generates
    # is the EOS token, and must still be the last entry lm-eval drops.
    (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        "The capital of France is Paris.",
    ),
    (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
        "It is named after the engineer Gustave Eiffel, whose company designed and built the "
        "tower from 1887 to 1889. The tower is",
        " 330 metres tall",
    ),
]

# lm-eval's Python API in its own interpreter: reads {"model_args", "pairs"}, prints the results.
DRIVER = """
import json
import sys

from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

job = json.load(sys.stdin)
lm = get_model("local-completions")(**job["model_args"])
requests = [
    Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=i)
    for i, (context, continuation) in enumerate(job["pairs"])
]
print(json.dumps(lm.loglikelihood(requests)))
"""


@dataclass(frozen=True)
class Score:
    logprob: float
    is_greedy: bool
    num_tokens: int
    """Context and continuation, as sent."""
    next_token_id: int
    """The greedy token after the whole text (what `max_tokens: 1` generates)."""


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    """kvrail's conversion of the default model (`kvrail model prepare`): its tokenizer files are
    what lm-eval's `tokenizer=` loads."""
    return prepare(resolve("smollm2"))


@pytest.fixture(scope="module")
def oracle(tokenizer_dir: Path) -> Callable[[str, str], Score]:
    import torch
    from transformers import AutoTokenizer

    model = load_transformers_model("smollm2")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def score(context: str, continuation: str) -> Score:
        context_ids, continuation_ids = _split(tok, context, continuation)
        ids = context_ids + continuation_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        rows = logprobs[len(context_ids) - 1 : len(ids) - 1]
        target = torch.tensor(continuation_ids)
        picked = rows.gather(1, target[:, None])[:, 0]
        return Score(
            logprob=float(picked.double().sum()),
            is_greedy=bool((rows.argmax(dim=-1) == target).all()),
            num_tokens=len(ids),
            next_token_id=int(logprobs[-1].argmax()),
        )

    return score


def _split(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's rule for a loglikelihood request: the context's trailing whitespace moves to the
    continuation; the continuation's tokens are those of the whole text past the context's; an
    empty context is the BOS token alone. No special tokens are added."""

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False).input_ids)

    if not context:
        return [tok.bos_token_id], encode(continuation)
    stripped = context.rstrip()
    whole = encode(context + continuation)
    context_ids = encode(stripped)
    return context_ids, whole[len(context_ids) :]


@pytest.fixture(scope="module")
def lmeval_bin() -> Path:
    if not (LMEVAL_BIN / "python").is_file():
        pytest.fail(f"no lm-eval environment at {LMEVAL_BIN.parent}: run `make lmeval-env`")
    return LMEVAL_BIN


@pytest.fixture(scope="module")
def kvrail_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`kvrail up` (what `make run` starts), its output in `up.log`; yields the server's root."""
    env = {"KVRAIL_MIN_REMOTE_PREFILL_TOKENS": str(REMOTE_PREFILL_TOKENS)}
    with up.kvrail_up(tmp_path_factory.mktemp("lm-eval-up"), env) as root:
        yield root


def _run_lm_eval(command: list[str], *, stdin: str | None = None) -> str:
    """Run lm-eval to completion; its stdout. A failure shows the end of its log, where lm-eval
    prints the server's error body."""
    done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, **OFFLINE})  # fmt: skip
    assert done.returncode == 0, f"lm-eval failed:\n{done.stderr[-6000:]}"
    return done.stdout


def _assert_scores(got: list[tuple[float, bool]], expected: list[Score]) -> None:
    assert len(got) == len(expected)
    for i, ((logprob, is_greedy), want) in enumerate(zip(got, expected, strict=True)):
        assert abs(logprob - want.logprob) <= TOLERANCE, f"request {i}: {logprob} != {want}"
        assert is_greedy == want.is_greedy, f"request {i}: is_greedy {is_greedy} != {want}"


def test_local_completions_loglikelihoods_equal_transformers(
    kvrail_up: str, lmeval_bin: Path, tokenizer_dir: Path, oracle: Callable[[str, str], Score]
) -> None:
    expected = [oracle(context, continuation) for context, continuation in CASES]
    # What the cases cover, so that no edit of them quietly drops a path.
    assert {s.is_greedy for s in expected} == {True, False}
    lengths = [s.num_tokens for s in expected]
    assert min(lengths) < REMOTE_PREFILL_TOKENS <= max(lengths), lengths
    eos_id = json.loads((tokenizer_dir / "config.json").read_text())["eos_token_id"]
    assert eos_id in {s.next_token_id for s in expected}, "no case generates the EOS token"

    model_args = {"model": MODEL, "base_url": f"{kvrail_up}/v1/completions",
                  "tokenizer": str(tokenizer_dir), "tokenizer_backend": "huggingface",
                  "max_retries": 1}  # fmt: skip
    job = json.dumps({"model_args": model_args, "pairs": CASES})
    out = _run_lm_eval([str(lmeval_bin / "python"), "-P", "-c", DRIVER], stdin=job)
    got = [(float(logprob), bool(greedy)) for logprob, greedy in json.loads(out.splitlines()[-1])]
    _assert_scores(got, expected)


def documented_command() -> str:
    """The `lm_eval --model local-completions` block of docs/evals.md, as written."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOCS.read_text(), re.MULTILINE | re.DOTALL)
    found = [b for b in blocks if "lm_eval --model local-completions" in b]
    assert len(found) == 1, f"{DOCS} should hold one block running lm_eval, found {len(found)}"
    return found[0]


def test_the_documented_lm_eval_command_scores_the_example_task_as_transformers_does(
    kvrail_up: str, lmeval_bin: Path, oracle: Callable[[str, str], Score], tmp_path: Path
) -> None:
    command = documented_command()
    for documented in ("http://127.0.0.1:8000/v1/completions", "--output_path lm-eval-results"):
        assert documented in command, f"docs/evals.md no longer says {documented!r}"
    results = tmp_path / "results"
    command = command.replace("http://127.0.0.1:8000", kvrail_up)
    command = command.replace("--output_path lm-eval-results", f"--output_path {results}")
    _run_lm_eval(["bash", "-euo", "pipefail", "-c", command])

    docs = [json.loads(line) for line in EXAMPLE_DATA.read_text().splitlines()]
    (samples_file,) = results.rglob("samples_kvrail_capitals_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()),
                     key=lambda s: s["doc_id"])  # fmt: skip
    assert [s["doc"] for s in samples] == docs
    num_correct = 0
    for sample in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert [c for _, c in pairs] == [" " + c for c in sample["doc"]["choices"]]
        expected = [oracle(context, continuation) for context, continuation in pairs]
        # --log_samples writes each response as strings: [["-1.23", "True"]] per request.
        got = [(float(r[0][0]), r[0][1] == "True") for r in sample["resps"]]
        _assert_scores(got, expected)
        best = max(range(len(expected)), key=lambda i: expected[i].logprob)
        num_correct += best == sample["doc"]["answer"]
    (results_file,) = results.rglob("results_*.json")
    acc = json.loads(results_file.read_text())["results"]["kvrail_capitals"]["acc,none"]
    assert acc == pytest.approx(num_correct / len(docs))
