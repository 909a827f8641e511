"""Executors: what runs the model for the engine core (``conveyor.engine.core.Executor``).

    LocalExecutor      the model runner in this process (torch; ``executor/local.py``)
    CostModelExecutor  no model: fake tokens, step times from a cost model (no torch;
                       the simulator and the bench's model clock)

Each sizes the KV pool before the core exists (``determine_num_kv_blocks``), gets the
resolved config (``initialize``), then serves ``execute_model``. A tensor-parallel or
Ray executor plugs in through the same three calls; ``make_executor``
(``executor/factory.py``) picks one from the engine args. Import the torch ones from
their modules: this package imports no torch, and nothing of the engine above it.
"""

from conveyor.executor.cost_model import CostModelExecutor

__all__ = ["CostModelExecutor"]
