"""Plain ASGI for the generation endpoints: their request body, and the client's departure.

`kvrail.router.app` serves `/v1/chat/completions` and `/v1/completions` without FastAPI's
per-request machinery (routing, dependency solving, its middleware stack and Starlette's
streaming response cost more than the rest of a short request together; `bench/router/`
measured it). What FastAPI did for them is here, with the same outcomes:

- `read_body` reads the body, refusing one above the limit with a 413 whether or not the
  client sent a Content-Length;
- `json_body` parses it as FastAPI does (JSON when the content type is JSON or absent, the raw
  bytes otherwise, so validation refuses them), with FastAPI's error records, so
  `errors.validation_error` words every problem as it did. Unlike FastAPI it bounds the work:
  Python's parser holds the GIL and the event loop for the whole body (16 MiB of numbers took
  0.45 s on a 2-vCPU VM, in another thread as much), so a body with more commas than a request
  for the model's context can need is refused before it is parsed (`max_commas`), and one
  nested deeper than the parser's recursion limit is refused, not a 500; either refusal names
  the field that made it (`body_scan`);
- `ClientWatch` cancels the work of a request whose client disconnected, at once (no polling),
  and turns that cancellation into `ClientLeft`.
"""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any

from starlette.types import Receive, Scope

from kvrail.router.api import body_scan
from kvrail.router.api.errors import ApiError, validation_error


class ClientLeft(Exception):
    """The client disconnected before its response was complete."""


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower case), decoded as Latin-1 as HTTP allows."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body. Raises ApiError (413 past `limit` bytes), ClientLeft."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body above {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def json_body(raw: bytes, content_type: str | None, max_commas: int) -> Any:
    """The body as FastAPI hands it to validation: None when empty (a `missing` body), parsed
    JSON when the content type is JSON or absent, else the bytes themselves. Raises ApiError
    (400) for JSON that does not parse, nests too deeply, or has more than `max_commas` commas
    (a bound on its values, and so on the parser's time, counted in about a millisecond a MiB
    where parsing takes tens)."""
    if not raw:
        raise validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    if content_type is not None and not _is_json(content_type):
        return raw
    commas = raw.count(b",")
    if commas > max_commas:
        field = body_scan.busiest_field(raw)
        raise ApiError(
            400, f"the request body has {commas} commas{_most_in(field)}, more than a request for "
            f"this model can need ({max_commas}); it was not parsed", param=field,
            code="request_too_complex",
        )  # fmt: skip
    try:
        return json.loads(raw)
    except RecursionError:
        field = body_scan.deep_field(raw, _PARSED_DEPTH)
        raise ApiError(
            400, f"the request body is not valid JSON (nested too deeply{_deep_in(field)})",
            param=field, code="invalid_json",
        ) from None  # fmt: skip
    except ValueError as err:  # JSONDecodeError, not UTF-8
        reason = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8"
        raise validation_error(
            [{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
              "ctx": {"error": reason}}]
        ) from None  # fmt: skip


# Deeper than this is past what `json.loads` can parse anyway (its limit is the interpreter's
# recursion limit, about 1,000, less the frames already in use).
_PARSED_DEPTH = 500


def _most_in(field: str | None) -> str:
    return f" (most of them in '{field}')" if field else ""


def _deep_in(field: str | None) -> str:
    return f" in '{field}'" if field else ""


def _is_json(content_type: str) -> bool:
    """`application/json` or `application/<anything>+json`, parameters ignored."""
    media = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


class ClientWatch:
    """`async with ClientWatch(receive):` around the work of one request whose body was read.

    A task waits for the client's `http.disconnect`; if it comes while the block runs, the task
    that entered the block is cancelled (so every await in it ends, and the request is cancelled
    on the workers) and the block raises `ClientLeft`. A cancellation from anywhere else passes
    through unchanged. On exit the waiting task is cancelled.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._task: asyncio.Task[Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._inside = False
        self.left = False

    async def __aenter__(self) -> ClientWatch:
        self._task = asyncio.current_task()
        self._inside = True
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.left = True
        if self._inside and self._task is not None:
            self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._inside = False
        if self._watcher is not None:
            self._watcher.cancel()
        task = self._task
        # The waiting task's frame holds this object: without these two references no cycle
        # joins them, and a request's objects are freed when it ends, not by the collector.
        self._task = self._watcher = None
        if self.left and task is not None and task.cancelling():
            remaining = task.uncancel()  # ours, whether or not the block let it through
            if exc_type is asyncio.CancelledError and remaining == 0:
                raise ClientLeft from None
