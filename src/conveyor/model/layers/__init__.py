"""The layers every decoder family shares: RMS norm, rotary embedding, the vocab-parallel
embedding and the elementwise steps (in PyTorch or fused native kernels)."""
