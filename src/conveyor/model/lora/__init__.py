"""Multi-LoRA on the shared decoder: PEFT adapters loaded and sharded (``adapter.py``),
the projections that add each row's adapter delta (``layers.py``), and the runner's cache
of loaded adapters and per-step row groups (``manager.py``)."""
