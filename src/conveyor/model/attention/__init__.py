"""Attention over the paged KV cache: the step's metadata and flat-batch dispatch
(``metadata``, ``paged``), the backends (``native``: the C kernels on CPU; ``sdpa``: the
reference, anywhere) and their registry (``registry``)."""
