"""Summarise a `py-spy record --format raw` file: samples per thread, then the frames that held
the most samples (inclusive), per thread.

    python3 bench/serving/pyspy_summary.py worker.txt --top 25
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path


def summarise(lines: Sequence[str], top: int) -> str:
    threads: Counter[str] = Counter()
    frames: Counter[tuple[str, str]] = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        names = stack.split(";")
        thread = names[0]
        threads[thread] += n
        for frame in set(names[1:]):  # inclusive: once per sample however deep the recursion
            if not frame.startswith(("_bootstrap", "run (threading", "_run_module", "_run_code")):
                frames[(thread, frame)] += n
    out = ["samples per thread:"]
    out += [f"  {n:6d}  {thread}" for thread, n in threads.most_common()]
    for thread, total in threads.most_common():
        out.append(f"\n{thread} ({total} samples), inclusive:")
        mine = [(f, n) for (t, f), n in frames.most_common() if t == thread][:top]
        out += [f"  {n:6d}  {100 * n / total:5.1f}%  {frame}" for frame, n in mine]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(summarise(args.raw.read_text().splitlines(), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
