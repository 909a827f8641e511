"""A model's projections: the linear backends (``native``: conveyor's GEMM with the
weight packed once; ``native-bf16``: the same on bfloat16 weights; ``onednn``; ``torch``:
plain ``F.linear``), the few-row split, their registry and packing a model's linears."""
