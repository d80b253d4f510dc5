"""How much slower the chat prompt is when other work ran between two calls, as in the router.

    taskset -c 1 .venv/bin/python -P bench/router/cold_cache.py   # output: cold_cache.txt

`request_parts.py` times each part in a tight loop, where its code and data stay in the CPU's
caches. In the router, other requests' HTTP, NATS and streaming work run between two prompts.
Here, before each call, the "cold" run touches 8 MiB and reads 50,000 small dicts (a stand-in for
that work, not a measure of it); the call's own thread CPU time is what is counted, so the
touching is not.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the router process sets it

from kvrail.router.text.tokenizer import TextCodec
from kvrail.settings import load_settings

sys.path.insert(0, str(Path(__file__).parent))
from overhead import MESSAGES

_BYTES = bytearray(8 << 20)
_OBJECTS = [{"a": i, "b": str(i)} for i in range(200_000)]


def other_work() -> None:
    _BYTES[::64] = b"\x01" * (len(_BYTES) // 64)
    total = 0
    for o in _OBJECTS[::4]:
        total += o["a"]


def per_call_us(codec: TextCodec, cold: bool, n: int = 2000) -> float:
    spent = 0.0
    for _ in range(n):
        if cold:
            other_work()
        start = time.thread_time()
        codec.chat_prompt(MESSAGES)
        spent += time.thread_time() - start
    return spent / n * 1e6


def main() -> None:
    settings = load_settings(environ=dict(os.environ))
    codec = TextCodec.load(settings.model, settings.cache_dir)
    gc.collect()
    gc.freeze()  # the stand-in's objects are never collected, as the router's startup heap
    print("# chat prompt (template, sentinel render, encode): thread CPU per call")
    for round_ in (1, 2):
        hot, cold = per_call_us(codec, cold=False), per_call_us(codec, cold=True)
        print(f"round {round_}: back to back {hot:6.1f} us, after other work {cold:6.1f} us")


if __name__ == "__main__":
    main()
