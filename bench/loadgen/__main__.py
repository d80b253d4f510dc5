"""`python -P bench/loadgen ...`: the load generator's command line (and, with `--shard K`, one
client process of `--client-processes`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from kvrail.testing.scripts import load_script

# Run as a folder, this file is `__main__` outside its package: load the package by path.
lg: Any = load_script("kvrail_bench_loadgen", Path(__file__).resolve().parent / "__init__.py")

if sys.argv[1:2] == ["--shard"]:  # a child of shards._run_sharded
    asyncio.run(lg.shards._shard_main(int(sys.argv[2])))
    sys.exit(0)
sys.exit(lg.main())
