"""Tensor parallelism's pieces below the executor: a rank's shard of the model
(``parallel.py``: which heads, rows and vocabulary slice a rank holds, and the two
collectives the model calls) and the process group it runs in (``group.py``)."""
