"""POST /v1/responses end to end: the real `openai` client (and the OpenAI Agents SDK) against a
real router and a real SmolLM2 worker.

One colocated worker and one router over the session's real etcd and NATS. Greedy sampling
throughout, so a Response's text can be compared with the chat completion of the same
conversation, which serves it (`kvrail.router.api.responses_api`), and a stream with the whole
body. Every test ends with the worker's blocks free.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from nats.aio.client import Client as NatsClient

from kvrail.bus import connect
from kvrail.local.procs import free_port
from kvrail.local.servers import EtcdServer, NatsServer
from kvrail.testing.pool import LocalPool

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France? Answer in one sentence."
INSTRUCTIONS = "You are a geography teacher."
PORT = free_port()
URL = f"http://127.0.0.1:{PORT}/v1"


@pytest.fixture(scope="module")
def pool(
    etcd_server: EtcdServer, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPool]:
    env = {"KVRAIL_DISAGGREGATION_MODE": "colocated", "KVRAIL_NUM_KV_BLOCKS": "128",
           "KVRAIL_MAX_MODEL_LEN": "1024", "KVRAIL_REQUEST_TIMEOUT_S": "120"}  # fmt: skip
    p = LocalPool(
        etcd_server, nats_server, tmp_path_factory.mktemp("responses-pool"),
        f"resp-{uuid.uuid4().hex[:8]}", env,
    )  # fmt: skip
    try:
        p.start("colo-0", "colocated")
        p.wait_ready("colo-0")
        p.start_router("router", KVRAIL_HTTP_PORT=str(PORT))
        p.wait_ready("router")
        yield p
    finally:
        p.stop()


@pytest.fixture
async def nc(pool: LocalPool) -> AsyncIterator[NatsClient]:
    client_ = await connect(pool.settings, "responses-test")
    yield client_
    await pool.assert_all_blocks_free(client_)
    await client_.close()


def client(pool: LocalPool) -> openai.OpenAI:
    return openai.OpenAI(base_url=URL, api_key="none", max_retries=0)


def chat_text(pool: LocalPool, max_tokens: int, **messages: str) -> tuple[str, str]:
    """The chat completion of the same conversation: its text and finish reason."""
    turns: list[Any] = [{"role": role, "content": text} for role, text in messages.items()]
    done = client(pool).chat.completions.create(
        model=MODEL, messages=turns, max_tokens=max_tokens, temperature=0
    )
    return done.choices[0].message.content or "", done.choices[0].finish_reason


@pytest.mark.usefixtures("nc")
def test_a_response_is_the_chat_completion_of_the_same_conversation(pool: LocalPool) -> None:
    response = client(pool).responses.create(
        model=MODEL, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=32,
        temperature=0, metadata={"run": "1"},
    )  # fmt: skip
    text, finish = chat_text(pool, 32, system=INSTRUCTIONS, user=QUESTION)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == MODEL and response.metadata == {"run": "1"}
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == text and "Paris" in text
    # The chat's finish reason, as the Responses API says it.
    expected = ("completed", "completed") if finish == "stop" else ("incomplete", "incomplete")
    assert (response.status, message.status) == expected
    if finish == "length":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage is not None and usage.input_tokens > 10 and 0 < usage.output_tokens <= 32
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.temperature == 0 and response.store is False  # type: ignore[attr-defined]


@pytest.mark.usefixtures("nc")
def test_a_streamed_response_tells_the_same_response_event_by_event(pool: LocalPool) -> None:
    c = client(pool)
    whole = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    stream = c.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:5] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
    ]  # fmt: skip
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        last,
    ]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 1
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The stream helper accumulates the same response.
    with c.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=12,
                            temperature=0) as stream:  # fmt: skip
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert text == stream.get_final_response().output_text == whole.output_text


@pytest.mark.usefixtures("nc")
def test_earlier_turns_given_as_items_make_the_same_prompt_as_chat_messages(
    pool: LocalPool,
) -> None:
    items: Any = [
        {"role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": "Name a country in Europe."},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "France.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Its capital?"}]},
    ]  # fmt: skip
    response = client(pool).responses.create(
        model=MODEL, input=items, max_output_tokens=16, temperature=0
    )
    turns: Any = [
        {"role": "developer", "content": INSTRUCTIONS},
        {"role": "user", "content": "Name a country in Europe."},
        {"role": "assistant", "content": "France."},
        {"role": "user", "content": "Its capital?"},
    ]
    chat = client(pool).chat.completions.create(
        model=MODEL, messages=turns, max_tokens=16, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.usefixtures("nc")
def test_what_a_stateless_server_cannot_do_is_refused_by_name(pool: LocalPool) -> None:
    c = client(pool)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ]  # fmt: skip
    for fields, param in cases:
        body: dict[str, Any] = {"model": MODEL, "input": QUESTION, **fields}
        with pytest.raises(openai.BadRequestError) as info:
            c.responses.create(**body)
        error = info.value.body
        assert isinstance(error, dict), fields
        assert (error["param"], error["code"]) == (param, "unsupported_parameter"), fields
        assert info.value.response.headers["x-request-id"].startswith("resp_")
    with pytest.raises(openai.BadRequestError, match="unrecognized request argument"):
        c.responses.create(model=MODEL, input=QUESTION, extra_body={"nonsense": 1})
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5000)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "max_output_tokens"
    # Omitted, `store` is served (nothing is kept), and the response says so.
    ok = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, store=False)
    assert ok.status == "incomplete" and ok.store is False  # type: ignore[attr-defined]
