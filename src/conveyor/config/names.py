"""The names the config accepts for things registered in core (policies, predictors).

The config sits below core, so it cannot read core's registries. It keeps their names
instead: the built-in ones here, and whatever a plugin registers later
(``core.policies.register_policy`` and ``register_predictor`` add theirs), so that a bad
name fails when the config is built, before any engine starts. ``test_config_checks``
holds these sets equal to core's registries.
"""

from __future__ import annotations

POLICY_NAMES: set[str] = {"edf", "fair", "fcfs", "lpm", "priority", "sjf", "slo"}
PREDICTOR_NAMES: set[str] = {"hint", "max_tokens"}
