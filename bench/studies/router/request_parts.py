"""The router's fixed work per chat request, part by part, in-process: CPU time per call.

    taskset -c 1 .venv/bin/python -P bench/studies/router/request_parts.py  # request_parts.txt

Each part runs 3,000 times on `overhead.py`'s chat request (the same body and prompt), with the
real tokenizer of the default model; what it does not time (HTTP, tasks, NATS, metrics, system
calls) is the rest of a request's cost in `overhead.py`'s figures (README).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the router process sets it

from kvrail.messages import GenerateRequest
from kvrail.router.api import schemas, streaming
from kvrail.router.api.sampling import Defaults, requested
from kvrail.router.discovery.index import prompt_hashes
from kvrail.router.text.tokenizer import TextCodec
from kvrail.settings import load_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "router"))  # overhead, lean_http
from overhead import MESSAGES, MODEL


def per_call_us(fn: Callable[[], Any], n: int = 3000) -> float:
    fn()
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def main() -> int:
    settings = load_settings(environ=dict(os.environ))
    codec = TextCodec.load(settings.model, settings.cache_dir)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
            "stream": True}  # fmt: skip
    raw = json.dumps(body).encode()
    request = schemas.ChatCompletionRequest.model_validate(json.loads(raw))
    messages = request.template_messages()
    ids = codec.chat_prompt(messages)
    asked = requested(request)
    params = asked.params(16, Defaults())
    job = GenerateRequest("chatcmpl-" + "0" * 32, tuple(ids), "_INBOX.x.events",
                          time.time() + 60, params)  # fmt: skip
    reply = streaming.Reply("chat", "chatcmpl-x", MODEL, 1, len(ids))
    parts: dict[str, Callable[[], Any]] = {
        "json.loads and the pydantic model": lambda: schemas.ChatCompletionRequest.model_validate(
            json.loads(raw)
        ),
        "chat prompt: template, sentinel render, encode": lambda: codec.chat_prompt(messages),
        "  of which one template render": lambda: codec.render_chat(messages),
        "sampling parameters (requested, params)": lambda: requested(request).params(
            16, Defaults()
        ),
        "prompt block hashes (block 16)": lambda: prompt_hashes(ids, 16, "f" * 64),
        "GenerateRequest.encode": job.encode,
        "the detokenizer": lambda: codec.detokenizer(ids, (), 0),
        "the first chunk (role)": lambda: streaming._event(reply.chunk("", None, first=True)),
    }
    print(f"# {len(ids)} prompt tokens; CPU per call")
    for name, fn in parts.items():
        print(f"{name:45s} {per_call_us(fn):7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
