"""The native CPU kernels alone: attention, elementwise, GEMM, and the core's peak."""
