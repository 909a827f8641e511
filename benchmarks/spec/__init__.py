"""Speculative decoding: the trained target/draft pair and the method grids."""
