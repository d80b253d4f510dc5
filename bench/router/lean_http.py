"""A minimal HTTP/1.1 client for the router benchmarks: one keep-alive connection, POST a JSON
body, read the answer whole (Content-Length or chunked) or event by event.

Why not httpx: measured on the 2-core development VM (2026-12-01), httpx spends about 2.5 ms of
its own per request (p50 through the router: 4.5-5.1 ms with httpx, 2.1-2.3 ms with this
client, on the same router in the same run), so a benchmark that uses it measures the client as
much as the router, and the clients' core saturates before the router's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class HttpError(Exception):
    pass


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def close(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """The status and the whole body of a POST."""
        status, chunked, length = await self._send(path, body)
        if not chunked:
            return status, await self._reader.readexactly(length)
        return status, b"".join([part async for part in self._chunks()])

    async def post_events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed POST (each `data: ...` without its blank line);
        raises HttpError for a status other than 200."""
        status, chunked, length = await self._send(path, body)
        if status != 200 or not chunked:
            rest = await self._reader.readexactly(length) if not chunked else b""
            raise HttpError(f"HTTP {status}: {rest[:200]!r}")
        pending = b""
        async for part in self._chunks():
            pending += part
            *events, pending = pending.split(b"\n\n")
            for event in events:
                yield event

    async def _send(self, path: str, body: bytes) -> tuple[int, bool, int]:
        head = (
            f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self._writer.write(head.encode() + body)
        status_line = await self._reader.readline()
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise HttpError(f"bad status line {status_line[:100]!r}")
        chunked, length = False, 0
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        return int(parts[1]), chunked, length

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            size = int((await self._reader.readline()).split(b";", 1)[0], 16)
            data = await self._reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return
            yield data[:-2]
