"""The simulator: its fidelity to the real engine, its speed, and studies run in it."""
