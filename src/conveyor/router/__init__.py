"""``conveyor router``: an HTTP front door in front of ``conveyor serve`` replicas.

``policies`` (which replica, no HTTP), ``health`` (each replica's state and the checker
that keeps it current), ``app`` (the FastAPI proxy). Data parallelism is the one mode so
far (``--replica URL`` ...); another mode (prefill/decode disaggregation) adds its own
flags and app beside it.
"""
