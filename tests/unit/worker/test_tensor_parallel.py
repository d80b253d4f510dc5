"""Tensor parallelism on CPU (gloo), real rank processes: the split engine's greedy output equals
the one-device engine's, token for token in float32, on a prompt set with mixed lengths, chunked
prefill, prefix-cache hits and async scheduling, for TP=2 and TP=4 on a random-weight model
(8 heads, 2 KV heads: split at TP=2, replicated at TP=4) and TP=3 on the real SmolLM2 (9 heads,
3 KV heads). Every engine ends empty. Killing one rank with SIGKILL fails the next step with an
error, never a hang, and nothing the engine started outlives it. Under the `gpu` marker the same
on CUDA (NCCL between GPUs, CUDA graphs with the collectives inside, async scheduling), where the
machine has the GPUs."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrail.errors import RankLostError
from kvrail.sampling import SamplingParams
from kvrail.worker.engine.config import EngineConfig
from kvrail.worker.ranks.build import BuiltEngine, build_engine
from kvrail.worker.testing import assert_engine_empty, write_random_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHARED = [101 + 37 * i % 30_000 for i in range(41)]  # a shared prefix: cache hits at block 4
PROMPTS = [
    [11, 12, 13],
    [200 + 7 * i % 40_000 for i in range(70)],  # chunked over three steps (32-token budget)
    [*SHARED, 5, 6, 7],
    [*SHARED, 9, 9],
    [4242 + i for i in range(17)],
]


def config(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "num_blocks": 96, "block_size": 4, "max_num_batched_tokens": 32, "max_model_len": 512,
    }  # fmt: skip
    values.update(overrides)
    return EngineConfig(**values)


def generate(built: BuiltEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = built.engine
    first = engine.generate(prompts[:2], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    # the rest afterwards: SHARED's blocks are in the prefix cache by then
    rest = engine.generate(prompts[2:], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert_engine_empty(engine)
    return first + rest


def first_divergence(a: list[list[int]], b: list[list[int]]) -> str:
    for p, (x, y) in enumerate(zip(a, b, strict=True)):
        for i, (s, t) in enumerate(zip(x, y, strict=True)):
            if s != t:
                return f"prompt {p}, token {i}: {s} vs {t}"
    return "none"


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_model(
        tmp_path_factory.mktemp("model") / "tp", seed=7,
        num_attention_heads=8, num_key_value_heads=2, hidden_size=64, intermediate_size=96,
    )  # fmt: skip


@pytest.fixture
def tp_engine() -> Iterator[Any]:
    started: list[BuiltEngine] = []

    def build(
        source: str, size: int, device_type: str = "cpu", quantization: str = "auto",
        **overrides: Any,
    ) -> BuiltEngine:  # fmt: skip
        built = build_engine(
            source, config(**overrides), dtype=torch.float32, device_type=device_type,
            tensor_parallel_size=size, torch_num_threads=1, quantization=quantization,
        )  # fmt: skip
        started.append(built)
        return built

    yield build
    for built in started:
        if built.ranks is not None:
            built.ranks.close()
            for pid in built.ranks.pids:
                assert not _alive(pid), f"rank process {pid} outlived its engine"
        built.engine.model.group.close()


def _step_until(engine: Any, deadline: float) -> None:
    while time.monotonic() < deadline:
        engine.step()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_random_model_decodes_exactly_like_one_device(
    random_model: Path, tp_engine: Any, size: int
) -> None:
    expected = generate(tp_engine(str(random_model), 1), PROMPTS, 12)
    split = tp_engine(str(random_model), size, async_scheduling=True)
    assert split.engine.kv_cache.tensor.shape[4] == 1  # one KV head per rank (replicated at 4)
    got = generate(split, PROMPTS, 12)
    assert got == expected, f"first divergence: {first_divergence(expected, got)}"


def test_ranks_decode_over_shared_prefixes_like_one_device(
    random_model: Path, tp_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `shared_prefix_decode`, rank 0 groups the rows that share SHARED's blocks and every
    rank attends with the same groups (each rank's reference attention checks them against its
    own block tables): the tokens of one device."""
    from kvrail.worker.testing import record_shared_prefixes

    found = record_shared_prefixes(monkeypatch)
    expected = generate(tp_engine(str(random_model), 1), PROMPTS, 12)
    got = generate(tp_engine(str(random_model), 2, shared_prefix_decode=True), PROMPTS, 12)
    assert got == expected, f"first divergence: {first_divergence(expected, got)}"
    assert any(g is not None for g in found)


def test_ranks_cache_kv_in_the_engines_kv_dtype(random_model: Path, tp_engine: Any) -> None:
    """Every rank allocates its KV shard in the engine's FP8 dtype (a quarter of float32's
    bytes) and the split engine decodes as the one-device FP8 engine does."""
    expected = generate(tp_engine(str(random_model), 1, kv_dtype="float8_e4m3fn"), PROMPTS, 12)
    split = tp_engine(str(random_model), 2, kv_dtype="float8_e4m3fn")
    assert split.engine.kv_cache.tensor.dtype == torch.float8_e4m3fn
    assert split.engine.fingerprint.kv_dtype == "float8_e4m3fn"
    assert split.ranks is not None
    assert [r.kv_bytes for r in split.ranks.readies] == [split.engine.kv_cache.nbytes]
    got = generate(split, PROMPTS, 12)
    assert got == expected, f"first divergence: {first_divergence(expected, got)}"


def test_every_rank_runs_fp8_weights(random_model: Path, tp_engine: Any) -> None:
    """The ranks quantize their own shards (a row-parallel projection's scales are its shard's
    rows, so the tokens may differ from one device's: not compared)."""
    split = tp_engine(str(random_model), 2, quantization="fp8")
    assert split.engine.fingerprint.quantization == "fp8"
    assert split.engine.model.layers[0].o_proj.weight.dtype == torch.float8_e4m3fn
    assert [len(o) for o in generate(split, PROMPTS, 6)] == [6] * len(PROMPTS)


def test_smollm2_on_three_ranks_decodes_exactly_like_one_device(tp_engine: Any) -> None:
    from kvrail.worker.models.loader import load

    tokenizer = load("smollm2").tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:",
             " ".join(f"Paragraph {i}: the river flows past {i * 7 % 13} villages." for i in
                      range(8))]  # fmt: skip
    prompts = [tokenizer(t).input_ids for t in texts]
    prompts.append([*prompts[3], *tokenizer(" Which river?").input_ids])  # a prefix-cache hit
    expected = generate(tp_engine("smollm2", 1, block_size=16, max_num_batched_tokens=64), prompts,
                        16)  # fmt: skip
    split = tp_engine("smollm2", 3, block_size=16, max_num_batched_tokens=64)
    got = generate(split, prompts, 16)
    assert got == expected, f"first divergence: {first_divergence(expected, got)}"


def test_grammars_on_two_ranks_scheduled_ahead_decode_like_one_device(
    random_model: Path, tp_engine: Any
) -> None:
    """Only rank 0 samples, so only it holds matchers and fills masks; a step with constrained
    rows queues its forward (every rank's) before the masks are filled, and the ranks wait in
    the tokens' broadcast meanwhile. The model's 49,155 logits are 3 past the tokenizer's."""
    import re

    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    words = "[a-z]{2,6}( [a-z]{2,6}){0,3}"
    number = LLMatcher.grammar_from_json_schema(
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
         "required": ["n"], "additionalProperties": False},
        defaults={"whitespace_flexible": False},
    )  # fmt: skip
    params = [
        SamplingParams(max_tokens=40, grammar=LLMatcher.grammar_from_regex(words)),
        SamplingParams(max_tokens=40, temperature=1.0, seed=4, grammar=number),
        SamplingParams(max_tokens=8, ignore_eos=True),
    ]

    def run(built: BuiltEngine) -> list[list[int]]:
        outputs = built.engine.generate(PROMPTS[:3], params)
        assert_engine_empty(built.engine)
        return outputs

    expected = run(tp_engine(str(random_model), 1, async_scheduling=True))
    got = run(tp_engine(str(random_model), 2, async_scheduling=True))
    assert got == expected, f"first divergence: {first_divergence(expected, got)}"
    tokenizer = AutoTokenizer.from_pretrained(random_model)
    text = [tokenizer.decode(o, skip_special_tokens=True) for o in got]
    assert re.fullmatch(words, text[0]) and 0 <= json.loads(text[1])["n"] <= 999


def needs_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4])
def test_on_gpus_a_split_model_with_graphs_and_async_decodes_like_one_gpu(
    random_model: Path, tp_engine: Any, size: int
) -> None:
    needs_gpus(size)
    expected = generate(tp_engine(str(random_model), 1, "cuda"), PROMPTS, 12)
    split = tp_engine(str(random_model), size, "cuda")  # CUDA: graphs and async by default
    assert split.engine.runner.graphs is not None and split.engine.pipeline.async_scheduling
    got = generate(split, PROMPTS, 12)
    assert got == expected, f"first divergence: {first_divergence(expected, got)}"


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_killed_rank_fails_the_next_step_and_nothing_outlives_the_engine(
    random_model: Path, tp_engine: Any, device_type: str
) -> None:
    if device_type == "cuda":
        needs_gpus(2)
    built = tp_engine(str(random_model), 2, device_type)
    assert built.ranks is not None
    lost: list[tuple[int, int | None]] = []
    built.ranks.on_lost(lambda rank, code: lost.append((rank, code)))
    engine = built.engine
    engine.add_request("long", PROMPTS[1], SamplingParams(max_tokens=300, ignore_eos=True))
    engine.step()
    os.kill(built.ranks.pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises((RankLostError, RuntimeError)):
        _step_until(engine, deadline)
    assert time.monotonic() < deadline, "steps kept running without their rank"
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost == [(1, -signal.SIGKILL)]
    with pytest.raises(RankLostError, match="rank 1 is gone"):
        built.ranks.send(object())  # type: ignore[arg-type]


RANK_0 = """
import sys, time, torch
from kvrail.worker.engine.config import EngineConfig
from kvrail.worker.ranks.build import build_engine
built = build_engine(sys.argv[1], EngineConfig(num_blocks=16, block_size=4, max_model_len=64),
                     dtype=torch.float32, device_type="cpu", tensor_parallel_size=2,
                     torch_num_threads=1)
print(*built.ranks.pids, flush=True)
time.sleep(600)
"""


def test_ranks_die_with_rank_0_however_it_dies(random_model: Path, tmp_path: Path) -> None:
    """kill -9 of rank 0 alone (not its process group): its ranks exit at once (the lifeline)."""
    import subprocess
    import sys

    script = tmp_path / "rank0.py"
    script.write_text(RANK_0)
    rank0 = subprocess.Popen(
        [sys.executable, "-P", str(script), str(random_model)], stdout=subprocess.PIPE,
        cwd=tmp_path, text=True,
    )  # fmt: skip
    try:
        assert rank0.stdout is not None
        (pid,) = map(int, rank0.stdout.readline().split())
        assert _alive(pid)
        rank0.kill()
        rank0.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "a rank outlived its rank 0"
    finally:
        rank0.kill()
        rank0.wait(10)
