"""Tensor parallelism's bottom layer: how a model splits over ranks (`layout.py`) and the
collectives the split model runs (`group.py`). The processes that hold the ranks are started by
`kvrail.worker.ranks`."""
