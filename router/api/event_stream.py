"""The server-sent events response of a streamed generation (`EventStream`), with the end of
its body (`Last`), and a whole response's wait that ends when its client leaves
(`until_disconnect`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, TypeVar

from starlette.types import Receive, Scope, Send

from kvrail.router.api import asgi

REQUEST_ID_HEADER: Final = "x-request-id"
"""Every generation response's id header (OpenAI's name): the completion's `id`."""
T = TypeVar("T")


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client leaves meanwhile it is cancelled (which cancels the request
    on the workers) and `asgi.ClientLeft` is raised."""
    async with asgi.ClientWatch(receive):
        return await work


class Last(bytes):
    """A response body's last bytes: `EventStream` sends them with the end of the body, in one
    write."""


class EventStream:
    """An ASGI response of server-sent events, written straight to `send`, one message per
    chunk the body yields (`sse` yields one per piece: the events a piece makes leave in one
    write). The body generator is closed however the response ends; a client that disconnects
    (before the first byte included) cancels it at once (`asgi.ClientWatch`), which cancels the
    request."""

    def __init__(
        self, body: AsyncIterator[bytes], on_close: Callable[[], None], request_id: str
    ) -> None:
        self._body = body
        self._on_close = on_close
        self.headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (REQUEST_ID_HEADER.encode(), request_id.encode()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with asgi.ClientWatch(receive):
                await send({"type": "http.response.start", "status": 200, "headers": self.headers})
                last = False
                async for chunk in self._body:
                    last = type(chunk) is Last
                    await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if not last:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asgi.ClientLeft:
            pass  # counted as 499 by `sse`, cancelled on the workers by closing the body
        finally:
            await asyncio.shield(self._close())

    async def _close(self) -> None:
        aclose = getattr(self._body, "aclose", None)
        if aclose is not None:
            await aclose()
        self._on_close()
