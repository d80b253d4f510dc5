"""The plain-ASGI pieces the generation endpoints stand on: body reading, FastAPI's body parsing
rules, and the watch that cancels a request whose client left."""

from __future__ import annotations

import asyncio
import gc
import json
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvrail.router.api import asgi, body_scan
from kvrail.router.api.errors import ApiError

Message = dict[str, Any]


def receiver(
    *messages: Message, then: asyncio.Event | None = None
) -> Callable[[], Awaitable[Message]]:
    """An ASGI `receive` that hands out `messages`, then waits for `then` (forever when None)
    and answers `http.disconnect`."""
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        await (then or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    return receive


def test_the_body_is_read_whole_and_refused_past_the_limit_without_a_content_length() -> None:
    async def main() -> None:
        parts = [{"type": "http.request", "body": b"ab", "more_body": True},
                 {"type": "http.request", "body": b"cd", "more_body": False}]  # fmt: skip
        assert await asgi.read_body(receiver(*parts), limit=4) == b"abcd"
        with pytest.raises(ApiError) as refused:
            await asgi.read_body(receiver(*parts), limit=3)
        assert refused.value.status == 413
        with pytest.raises(asgi.ClientLeft):
            await asgi.read_body(receiver(parts[0], then=_set()), limit=10)

    asyncio.run(main())


def test_the_body_is_parsed_as_fastapi_parses_it_within_bounds() -> None:
    assert asgi.json_body(b'{"a": 1}', None, 0) == {"a": 1}
    assert asgi.json_body(b'{"a": 1}', "application/json; charset=utf-8", 0) == {"a": 1}
    assert asgi.json_body(b'{"a": 1}', "application/vnd.x+json", 0) == {"a": 1}
    assert asgi.json_body(b'{"a": 1}', "text/plain", 0) == b'{"a": 1}'  # validation refuses it
    assert asgi.json_body(b"[1, 2, 3]", None, 2) == [1, 2, 3]
    cases = [(b"", "the request body is missing"),
             (b'{"a": ', "not valid JSON"),
             (b"\xff\xfe{", "not valid JSON"),
             (b"[" * 100_000 + b"]" * 100_000, "not valid JSON (nested too deeply)"),
             (b"[1, 2, 3, 4]", "has 3 commas, more than a request")]  # fmt: skip
    for raw, fragment in cases:
        with pytest.raises(ApiError) as refused:
            asgi.json_body(raw, "application/json", 2)
        assert refused.value.status == 400 and fragment in refused.value.message, raw
    nan = asgi.json_body(b'{"t": NaN}', None, 0)  # Python's JSON, as FastAPI: the schema refuses it
    assert json.dumps(nan) == '{"t": NaN}'


def test_a_client_that_leaves_cancels_the_watched_work_and_nothing_else() -> None:
    async def main() -> None:
        left = asyncio.Event()
        cleaned: list[str] = []

        async def work() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                cleaned.append("work")

        async def watched() -> None:
            async with asgi.ClientWatch(receiver(then=left)):
                await work()

        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.01, left.set)
        with pytest.raises(asgi.ClientLeft):
            await watched()
        assert cleaned == ["work"] and task.cancelling() == 0
        await asyncio.sleep(0)  # this task is not cancelled any more

        # Work that ends first: the watch ends with it and cancels nothing later.
        late = asyncio.Event()
        async with asgi.ClientWatch(receiver(then=late)) as watch:
            await asyncio.sleep(0.01)
        late.set()
        await asyncio.sleep(0.01)
        assert not watch.left and task.cancelling() == 0

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_passes_through_the_watch() -> None:
    async def watched() -> None:
        async with asgi.ClientWatch(receiver()):
            await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.ensure_future(watched())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_watch_is_freed_when_its_request_ends_without_the_collector() -> None:
    """A watch whose block ended leaves no reference cycle: its waiting task, cancelled, and
    the watch itself go as soon as the loop has run the cancellation (a cycle per request would
    leave each request's objects to the garbage collector)."""

    async def main() -> weakref.ref[asgi.ClientWatch]:
        async with asgi.ClientWatch(receiver()) as watch:
            await asyncio.sleep(0)
        ref = weakref.ref(watch)
        del watch
        for _ in range(3):  # the cancelled task's last steps
            await asyncio.sleep(0)
        return ref

    gc.collect()
    gc.disable()
    try:
        assert asyncio.run(main())() is None
    finally:
        gc.enable()


def _set() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


def test_a_body_too_deep_or_too_big_to_parse_is_refused_naming_its_field() -> None:
    deep = b'{"model": "m", "messages": [], "response_format": {"type": "json_schema", '
    deep += b'"json_schema": {"name": "x", "schema": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000
    deep += b"}}}"
    with pytest.raises(ApiError) as refused:
        asgi.json_body(deep, None, 100_000)
    assert refused.value.param == "response_format.json_schema.schema"
    assert "nested too deeply in 'response_format.json_schema.schema'" in refused.value.message
    after_text = b'{"messages": [{"content": "' + b'{[\\"' * 1000 + b'"}], "tools": '
    after_text += b"[" * 5_000 + b"]" * 5_000 + b"}"
    with pytest.raises(ApiError) as refused:  # brackets in strings do not count
        asgi.json_body(after_text, None, 100_000)
    assert refused.value.param == "tools"
    many = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a, b, c"}],
                       "tools": [{"function": {"name": f"f{i}"}} for i in range(50)]})  # fmt: skip
    with pytest.raises(ApiError) as refused:
        asgi.json_body(many.encode(), None, 20)
    assert refused.value.param == "tools" and refused.value.code == "request_too_complex"
    assert "most of them in 'tools'" in refused.value.message
    assert body_scan.busiest_field(b'{"model": "m", "seed": 1}') is None
    assert body_scan.deep_field(b"[[[]]]", 5) is None
