"""Step-cost models: how long one engine step of a given shape takes.

One protocol, ``StepCostModel`` (``protocol.py``): ``step_time(BatchShape) -> seconds``.
Its users: the SLO token budget (``core/budget.py``), the simulator (``conveyor.sim``),
the bench's model clock, the cost-model executor and speculative decoding's online fit.
Its implementations: ``LinearStepCost`` (three constants), ``RooflineCostModel``
(compute and memory bounds from shapes and a hardware spec), ``ProfileCostModel``
(fitted to step times measured by ``conveyor profile``); ``make_cost_model`` and
``load_step_cost`` (``factory.py``) build them from command-line strings.

Below the core in the layer order: it imports only ``conveyor.config`` and itself, and
nothing here imports torch (a profile needs numpy, imported only by ``profile.py``).
"""
