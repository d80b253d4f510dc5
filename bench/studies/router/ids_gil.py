"""What a request id costs the event loop while another thread runs Python: one
`secrets.token_hex(16)` per id against `RandomIds` (ids read from the OS 256 at a time).

    .venv/bin/python -P bench/studies/router/ids_gil.py | tee bench/studies/router/ids_gil.txt

`os.urandom` lets go of the GIL; with a thread busy in Python (as a tokenizer thread can be),
taking it back can wait for the interpreter's switch interval (5 ms).
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time

from kvrail.router.app import RandomIds


def _busy(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def _times(make_id, count: int = 20_000) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        make_id()
        out.append(time.perf_counter() - start)
    return out


def main() -> int:
    stop = threading.Event()
    threading.Thread(target=_busy, args=(stop,), daemon=True).start()
    ids = RandomIds()
    for name, fn in (
        ("secrets.token_hex(16)", lambda: secrets.token_hex(16)),
        ("RandomIds", ids.next),
    ):
        t = sorted(_times(fn))
        p50, p99 = statistics.median(t) * 1e6, t[int(len(t) * 0.99)] * 1e6
        print(
            f"{name:22s} p50 {p50:7.1f} us  p99 {p99:8.1f} us  max {t[-1] * 1e3:6.2f} ms"
            f"  total {sum(t) * 1e3:7.1f} ms for {len(t)}"
        )
    stop.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
