"""Batching modes, scheduling policies and the prefix cache, on the real engine."""
