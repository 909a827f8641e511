"""Attention over the paged KV cache: the step's metadata and flat-batch dispatch
(``metadata``, ``paged``), the backends (``native``: the C kernels on CPU; ``sdpa``: the
reference, anywhere; ``triton`` and ``flashinfer``: the whole step in one kernel call over
the step's sequence table, ``sequences``) and their registry (``registry``)."""
