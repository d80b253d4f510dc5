"""The KV index's lookup per request: `KvIndex.match_tiers` on a 512-block prompt (8k tokens).

    PYTHONPATH=<a tree's view> .venv/bin/python -P bench/router/index_match.py

Four workers, two holding the whole prompt in GPU memory, two another one; the time of a lookup
that matches (every block followed on two workers) and of one whose first block no worker holds
(a new prompt: nothing to follow). Best of 5 repeats of 200 lookups. Runs on trees before the
index had tiers too (`match_all`), for A/B runs.
"""

from __future__ import annotations

import timeit

from kvrail.messages import KvEvent
from kvrail.router.discovery.index import KvIndex


def main() -> None:
    index = KvIndex()
    prompt = [f"{i:032x}" for i in range(512)]
    other = [f"{i + 10**6:032x}" for i in range(512)]
    new = [f"{i + 10**7:032x}" for i in range(512)]
    for w in range(4):
        held = prompt if w < 2 else other
        index.load_state(KvEvent(f"w{w}", 1, 0, cleared=True, stored=tuple(held)))
    match = getattr(index, "match_tiers", None) or index.match_all
    for name, hashes in (("matching", prompt), ("no first block", new)):
        best = min(timeit.repeat(lambda h=hashes: match(h), number=200, repeat=5)) / 200
        print(f"{name}: {best * 1e6:.1f} us")


if __name__ == "__main__":
    main()
