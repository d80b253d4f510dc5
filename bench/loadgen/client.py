"""The client loop: one streamed request timed chunk by chunk, and the open and closed loops that
send a load point's requests from this process."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import openai
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from .stats import RequestResult
from .workload import Arrival, RequestSpec, Workload, arrival_times, make_request, system_prompts

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    model: str
    api_key: str = "EMPTY"
    endpoint: Endpoint = "chat"
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class LoadPoint:
    arrival: Arrival
    rate: float | None = None
    concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    num_warmup: int = 0

    @property
    def label(self) -> str:
        if self.arrival == "closed":
            return f"concurrency {self.concurrency}"
        return f"{self.arrival} {self.rate:g}/s"


@dataclass(slots=True)
class Progress:
    label: str
    total: int | None
    num_sent: int = 0
    num_done: int = 0
    num_errors: int = 0
    started: float = field(default_factory=time.perf_counter)

    def line(self) -> str:
        total = f"/{self.total}" if self.total is not None else ""
        return (
            f"[{self.label}] sent {self.num_sent}{total}  done {self.num_done}  "
            f"errors {self.num_errors}  in flight {self.num_sent - self.num_done}  "
            f"{time.perf_counter() - self.started:.0f}s"
        )


async def _show(progress: Progress) -> None:
    tty = sys.stderr.isatty()
    while True:
        if tty:
            print("\r" + progress.line(), end="", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5)
        else:
            await asyncio.sleep(10)
            print(progress.line(), file=sys.stderr, flush=True)


def _error_name(err: BaseException) -> str:
    status = getattr(err, "status_code", None)
    return f"{type(err).__name__}({status})" if status is not None else type(err).__name__


def _chunk_text(chunk: ChatCompletionChunk | Completion) -> tuple[str, str | None]:
    """The text a streamed chunk carries, and its finish reason."""
    if isinstance(chunk, ChatCompletionChunk):
        texts = [c.delta.content or "" for c in chunk.choices]
    else:
        texts = [c.text for c in chunk.choices]
    finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), None)
    return "".join(texts), finish


async def send_request(
    client: openai.AsyncOpenAI, target: Target, spec: RequestSpec, point_start: float
) -> RequestResult:
    """Send one streamed request and time every chunk."""
    result = RequestResult(
        spec.index, spec.is_warmup, 0.0, 0.0,
        approx_prompt_tokens=spec.approx_prompt_tokens, prefix_id=spec.prefix_id,
    )  # fmt: skip
    if target.endpoint == "chat":
        messages: list[ChatCompletionMessageParam] = []
        if spec.system:
            messages.append({"role": "system", "content": spec.system})
        messages.append({"role": "user", "content": spec.user})
        await stream_into(client, target, result, point_start, spec.max_tokens, messages=messages)
    else:
        prompt = f"{spec.system}\n\n{spec.user}" if spec.system else spec.user
        await stream_into(client, target, result, point_start, spec.max_tokens, prompt=prompt)
    return result


async def stream_into(
    client: openai.AsyncOpenAI, target: Target, result: RequestResult, point_start: float,
    max_tokens: int, *, messages: list[ChatCompletionMessageParam] | None = None,
    prompt: str | None = None,
) -> str:  # fmt: skip
    """Send one streamed request now (chat `messages` or a completions `prompt`), time every
    chunk into `result` (its start, end, chunk times, usage, finish reason or error) and return
    the text it streamed (a multi-turn client's next prompt holds it)."""
    start = time.perf_counter()
    result.start_s = result.end_s = start - point_start
    options: dict[str, Any] = {
        "model": target.model, "max_tokens": max_tokens, "temperature": target.temperature,
        "stream_options": {"include_usage": True}, "extra_body": target.extra_body,
    }  # fmt: skip
    texts: list[str] = []
    stream: openai.AsyncStream[ChatCompletionChunk] | openai.AsyncStream[Completion]
    try:
        if messages is not None:
            stream = await client.chat.completions.create(messages=messages, stream=True, **options)
        else:
            assert prompt is not None, "give messages or a prompt"
            stream = await client.completions.create(prompt=prompt, stream=True, **options)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                result.response_id = result.response_id or chunk.id
                text, finish_reason = _chunk_text(chunk)
                if text:
                    result.chunk_times_s.append(now - start)
                    texts.append(text)
                if finish_reason:
                    result.finish_reason = finish_reason
                if chunk.usage is not None:
                    result.output_tokens = chunk.usage.completion_tokens
                    result.prompt_tokens = chunk.usage.prompt_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    result.cached_tokens = getattr(details, "cached_tokens", None)
        if result.finish_reason is None:
            result.error = "IncompleteStream"
        elif not result.chunk_times_s:
            result.error = "EmptyOutput"
        elif result.prompt_tokens is None:  # no usage: count text chunks instead
            result.output_tokens = len(result.chunk_times_s)
    except (openai.APIError, httpx.HTTPError, TimeoutError, OSError) as err:
        result.error = _error_name(err)
    result.end_s = time.perf_counter() - point_start
    return "".join(texts)


def in_shard(index: int, shard: int, num_shards: int) -> bool:
    """Whether request `index` of an open loop is sent by client process `shard` of
    `num_shards` (round robin, so every process sends every rate's share at the same times)."""
    return index % num_shards == shard


async def _open_loop(
    client: openai.AsyncOpenAI,
    target: Target,
    workload: Workload,
    point: LoadPoint,
    progress: Progress,
    shard: tuple[int, int] = (0, 1),
    start: float | None = None,
) -> list[RequestResult]:
    """The requests of `point`'s schedule in `shard` (this process's index, the number of
    processes), each sent at its time after `start` (a `perf_counter` value, which on Linux is
    the same clock in every process; default: now)."""
    assert point.rate is not None
    times = arrival_times(
        point.arrival, point.rate, workload.seed, num_warmup=point.num_warmup,
        num_requests=point.num_requests, duration_s=point.duration_s,
    )  # fmt: skip
    mine = [(i, at) for i, at in enumerate(times) if in_shard(i, *shard)]
    progress.total = len(mine)
    prefixes = system_prompts(workload)
    start = time.perf_counter() if start is None else start

    async def one(spec: RequestSpec) -> RequestResult:
        result = await send_request(client, target, spec, start)
        progress.num_done += 1
        progress.num_errors += result.error is not None
        return result

    tasks = []
    for index, at in mine:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        spec = make_request(workload, prefixes, index, index < point.num_warmup)
        tasks.append(asyncio.create_task(one(spec)))
        progress.num_sent += 1
    return list(await asyncio.gather(*tasks))


async def _closed_loop(
    client: openai.AsyncOpenAI,
    target: Target,
    workload: Workload,
    point: LoadPoint,
    progress: Progress,
) -> list[RequestResult]:
    assert point.concurrency is not None
    prefixes = system_prompts(workload)
    if point.num_requests is not None:
        progress.total = point.num_warmup + point.num_requests
    indices = itertools.count()
    start = time.perf_counter()
    measure_until: float | None = None  # set when the first measured request is sent
    results: list[RequestResult] = []

    async def client_loop() -> None:
        nonlocal measure_until
        while True:
            index = next(indices)
            is_warmup = index < point.num_warmup
            if point.num_requests is not None and index >= point.num_warmup + point.num_requests:
                return
            if point.duration_s is not None and not is_warmup:
                if measure_until is None:
                    measure_until = time.perf_counter() + point.duration_s
                elif time.perf_counter() >= measure_until:
                    return
            progress.num_sent += 1
            result = await send_request(
                client, target, make_request(workload, prefixes, index, is_warmup), start
            )
            results.append(result)
            progress.num_done += 1
            progress.num_errors += result.error is not None

    await asyncio.gather(*(client_loop() for _ in range(point.concurrency)))
    return sorted(results, key=lambda r: r.index)
