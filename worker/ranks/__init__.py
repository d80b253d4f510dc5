"""The processes of a tensor-parallel worker: rank 0 (the worker process) starts ranks 1..N-1
(`launch.py`), each its own process on its own device (`__main__.py`), and drives them."""
