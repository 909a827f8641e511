"""Adapters to serving frameworks outside conveyor (each an optional extra)."""
