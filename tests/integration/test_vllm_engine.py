"""The live vLLM test: kvrail's router in front of a real vLLM prefill server and a real vLLM decode
server (vLLM's CPU build, NIXL connector over UCX/TCP, SmolLM2 in float32), each registered by
its kvrail agent, over real etcd and NATS, driven with the real `openai` client.

Every prompt is prefilled remotely (`min_remote_prefill_tokens: 0`): the router sends it to the
prefill server, hands vLLM's `kv_transfer_params` to the decode server, which reads the KV over
NIXL and streams the answer. Greedy answers are compared with kvrail's own engine (one kvrail
worker and its router in a second pool, on the same machine), which equals transformers token for
token (tests/unit/worker/test_engine_smollm2.py). The decode server's `/metrics` must show the
prompt tokens arrived by KV transfer, a client that disconnects must abort its request on vLLM,
and a prompt longer than `max_model_len` must get a 400 before reaching vLLM.

Needs `.venv-vllm` (`make vllm-env`; `make test` builds it): without it the tests fail with that
hint. The pair takes 60-110 s to start here and ~7 GB of memory.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool
from kvrail.testing.vllm import (
    SERVED_MODEL_NAME,
    VllmEnvMissing,
    VllmPool,
    VllmServer,
    serve_config,
    vllm_model_dir,
    vllm_python,
)
from kvrail.vllm.serve import VllmRole

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VLLM_POOL = f"vl-{uuid.uuid4().hex[:8]}"
KVRAIL_POOL = f"vk-{uuid.uuid4().hex[:8]}"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 24
QUESTIONS: list[list[ChatCompletionMessageParam]] = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
]
# About 400 tokens: a KV transfer of several 128-token blocks.
LONG_TEXT = " ".join(
    f"Paragraph {i}: the river {['Loire', 'Danube', 'Nile', 'Amazon'][i % 4]} flows past "
    f"{i * 7 % 13} villages, and its water level was {i * 3} centimetres in spring."
    for i in range(16)
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", LONG_TEXT + "\nThe first river is"]


@dataclass(frozen=True, slots=True)
class Stack:
    vllm: VllmPool
    vllm_router: openai.OpenAI
    kvrail_router: openai.OpenAI

    @property
    def prefill(self) -> VllmServer:
        return self.vllm.servers["prefill-0"]

    @property
    def decode(self) -> VllmServer:
        return self.vllm.servers["decode-0"]


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def stack(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    try:
        vllm_python()
    except VllmEnvMissing as err:
        pytest.fail(str(err))
    logs = tmp_path_factory.mktemp("vllm-engine")
    model_dir = vllm_model_dir()
    vllm = VllmPool({"KVRAIL_POOL": VLLM_POOL, **etcd_server.client_env()}, logs, model_dir)
    # The router of the vLLM pool takes max_model_len from the agents' records.
    vllm_routing = LocalPool(etcd_server, nats_server, logs, VLLM_POOL, {
        "KVRAIL_MIN_REMOTE_PREFILL_TOKENS": "0", "KVRAIL_KV_LOAD_FAILURE_POLICY": "fail",
        "KVRAIL_REQUEST_TIMEOUT_S": "120",
    })  # fmt: skip
    reference = LocalPool(etcd_server, nats_server, logs, KVRAIL_POOL, {
        "KVRAIL_MAX_MODEL_LEN": str(MAX_MODEL_LEN), "KVRAIL_NUM_KV_BLOCKS": "128",
        "KVRAIL_REQUEST_TIMEOUT_S": "120",
    })  # fmt: skip
    ports = {"router-vllm": free_port(), "router-kvrail": free_port()}
    try:
        roles: tuple[tuple[str, VllmRole, int], ...] = (
            ("prefill-0", "prefill", 0),  # name, role, OpenMP core
            ("decode-0", "decode", 1),
        )
        servers = {
            name: (serve_config(model_dir, role, free_port(), free_port(), MAX_MODEL_LEN), core)
            for name, role, core in roles
        }
        reference.start("kvrail-0", "colocated")
        vllm.start(servers)
        reference.wait_ready("kvrail-0")
        vllm_routing.start_router("router-vllm", KVRAIL_HTTP_PORT=str(ports["router-vllm"]))
        reference.start_router("router-kvrail", KVRAIL_HTTP_PORT=str(ports["router-kvrail"]))
        vllm_routing.wait_ready("router-vllm")
        reference.wait_ready("router-kvrail")
        yield Stack(vllm, client(ports["router-vllm"]), client(ports["router-kvrail"]))
    finally:
        vllm_routing.stop()
        reference.stop()
        vllm.stop()


def metric(server: VllmServer, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on `server` whose labels include `labels` (0 when none)."""
    return server.metric(name, **labels)


def wait_idle(stack: Stack, timeout_s: float = 10) -> None:
    """Both vLLM servers run and queue no request (polled)."""
    deadline = time.monotonic() + timeout_s
    busy: dict[str, float] = {}
    while time.monotonic() < deadline:
        busy = {
            s.name: metric(s, "vllm:num_requests_running") + metric(s, "vllm:num_requests_waiting")
            for s in (stack.prefill, stack.decode)
        }
        if not any(busy.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"vLLM servers still hold requests: {busy}")


def finished_normally(server: VllmServer) -> float:
    """The requests `server` finished by a stop, their length or a repetition (not an abort)."""
    name = "vllm:request_success_total"
    return sum(metric(server, name, finished_reason=r) for r in ("stop", "length", "repetition"))


def settled_counters(server: VllmServer, timeout_s: float = 10) -> tuple[float, float]:
    """`finished_normally` and the generated tokens once both held still for a second: vLLM
    hands a request's answer to its client before it counts the request (its output loop may
    await between the two), so a count read just after the last answer can still move."""
    deadline = time.monotonic() + timeout_s
    last = (finished_normally(server), metric(server, "vllm:generation_tokens_total"))
    while True:
        time.sleep(1)
        now = (finished_normally(server), metric(server, "vllm:generation_tokens_total"))
        if now == last:
            return now
        assert time.monotonic() < deadline, f"vLLM's counters keep moving: {last} -> {now}"
        last = now


@pytest.mark.parametrize("question", range(len(QUESTIONS)))
def test_chat_equals_kvrails_engine_streamed_or_not(stack: Stack, question: int) -> None:
    messages = QUESTIONS[question]
    vllm, kvrail = (
        r.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        for r in (stack.vllm_router, stack.kvrail_router)
    )
    assert vllm.choices[0].message.content == kvrail.choices[0].message.content
    assert vllm.choices[0].finish_reason == kvrail.choices[0].finish_reason
    assert vllm.usage is not None and kvrail.usage is not None
    assert (vllm.usage.prompt_tokens, vllm.usage.completion_tokens) == (
        kvrail.usage.prompt_tokens, kvrail.usage.completion_tokens,
    )  # fmt: skip
    stream = stack.vllm_router.chat.completions.create(
        model=SERVED_MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == kvrail.choices[0].message.content
    assert finish == kvrail.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == kvrail.usage.completion_tokens
    wait_idle(stack)


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_completions_equal_kvrails_engine_streamed_or_not(stack: Stack, prompt: int) -> None:
    text = PROMPTS[prompt]
    expected = stack.kvrail_router.completions.create(
        model=SERVED_MODEL_NAME, prompt=text, max_tokens=MAX_TOKENS, temperature=0
    )
    got = stack.vllm_router.completions.create(
        model=SERVED_MODEL_NAME, prompt=text, max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].text == expected.choices[0].text
    assert got.choices[0].finish_reason == expected.choices[0].finish_reason
    streamed = stack.vllm_router.completions.create(
        model=SERVED_MODEL_NAME, prompt=text, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.choices[0].text
    wait_idle(stack)


def test_the_decode_server_reads_the_prompts_kv_from_the_prefill_server(stack: Stack) -> None:
    transferred = "vllm:prompt_tokens_by_source_total"
    before = {
        "external": metric(stack.decode, transferred, source="external_kv_transfer"),
        "computed": metric(stack.decode, transferred, source="local_compute"),
        "prefilled": metric(stack.prefill, transferred, source="local_compute"),
    }
    fresh = f"Note {uuid.uuid4().hex}. {LONG_TEXT}"  # no prefix cached on either server
    answer = stack.vllm_router.completions.create(
        model=SERVED_MODEL_NAME, prompt=fresh, max_tokens=4, temperature=0
    )
    assert answer.usage is not None
    num_prompt = answer.usage.prompt_tokens
    wait_idle(stack)
    after = {
        "external": metric(stack.decode, transferred, source="external_kv_transfer"),
        "computed": metric(stack.decode, transferred, source="local_compute"),
        "prefilled": metric(stack.prefill, transferred, source="local_compute"),
    }
    delta = {k: after[k] - before[k] for k in before}
    # The prefill server computed the prompt; the decode server read it over NIXL (vLLM
    # recomputes at most the last token, whose logits it needs).
    assert delta["prefilled"] >= num_prompt - 1, delta
    assert delta["external"] >= num_prompt - 1, delta
    assert delta["computed"] <= 1, delta
    assert metric(stack.decode, "vllm:nixl_num_failed_transfers_total") == 0


def test_a_client_that_disconnects_aborts_its_request_on_vllm(stack: Stack) -> None:
    # As many as max_model_len allows (the prompt is ~80 tokens): about a minute of decoding
    # here, so a request that vLLM did not abort generates several times what one aborted
    # within `wait_idle`'s timeout could.
    max_tokens = MAX_MODEL_LEN - 128
    finished, generated = settled_counters(stack.decode)
    # ignore_eos: SmolLM2's greedy answer to this prompt ends by itself after 13 tokens, so
    # without it the request could finish normally (a "stop") before the client leaves.
    stream = stack.vllm_router.completions.create(
        model=SERVED_MODEL_NAME, prompt="Write a very long story about a dragon. " * 8,
        max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for got, chunk in enumerate(stream, start=1):
        assert chunk.choices[0].finish_reason is None
        if got == 3:
            break
    # The client leaves at once: three chunks prove the request runs. (Polling vLLM's running
    # gauge first gave a request up to ten more seconds to run, which CI's machine once needed
    # to finish it: 12 finished against 11.)
    stream.close()
    left = time.monotonic()
    wait_idle(stack, timeout_s=30)  # nothing runs or waits any more
    idle_after_s = time.monotonic() - left
    # vLLM aborted it: it never finished, and the decode server generated its first tokens but
    # far fewer than it was asked for.
    now_finished, now_generated = settled_counters(stack.decode)
    reasons = {
        r: metric(stack.decode, "vllm:request_success_total", finished_reason=r)
        for r in ("stop", "length", "repetition", "abort")
    }
    seen = f"by reason now: {reasons}; idle {idle_after_s:.1f} s after the client left"
    assert now_finished == finished, f"{finished} finished normally before, {seen}"
    tokens = now_generated - generated
    assert 3 <= tokens < max_tokens / 2, f"{tokens} tokens generated, {seen}"


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_prompt_over_max_model_len_gets_a_400(stack: Stack, api: str) -> None:
    long = "word " * (MAX_MODEL_LEN + 50)
    before = metric(stack.prefill, "vllm:request_success_total")
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": long}]

    def create() -> object:
        if api == "chat":
            return stack.vllm_router.chat.completions.create(
                model=SERVED_MODEL_NAME, messages=chat, max_tokens=8
            )
        return stack.vllm_router.completions.create(
            model=SERVED_MODEL_NAME, prompt=long, max_tokens=8
        )

    with pytest.raises(openai.BadRequestError) as caught:
        create()
    assert caught.value.status_code == 400
    assert str(MAX_MODEL_LEN) in caught.value.message  # says what the limit is
    assert metric(stack.prefill, "vllm:request_success_total") == before  # never reached vLLM
    wait_idle(stack)
