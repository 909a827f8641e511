"""Scheduling policies: strategy objects behind one protocol, registered by name.

    fcfs      arrival order
    sjf       least remaining work (prompt to prefill + predicted output), with aging
    priority  lower ``priority`` first, FCFS within a class, preempts less urgent work
    fair      weighted fair queuing across tenants by served tokens (VTC), preempts the
              most served tenant to admit a less served one
    edf       earliest TTFT / TPOT deadline first, on-time requests before late ones
    lpm       longest cached prefix first within a bounded window of the queue
    slo       least TTFT slack first, lost requests served last or rejected; the
              scheduler's token budget controller keeps running decodes within TPOT

See base.py for the protocol and docs/scheduling.md for when to choose which.
"""

from conveyor.core.policies.base import (
    POLICIES,
    PolicyContext,
    SchedulingPolicy,
    make_policy,
    register_policy,
)
from conveyor.core.policies.edf import EDFPolicy
from conveyor.core.policies.fair import FairPolicy
from conveyor.core.policies.fcfs import FCFSPolicy
from conveyor.core.policies.keyed import KeyedPolicy
from conveyor.core.policies.lpm import LPMPolicy
from conveyor.core.policies.predictors import PREDICTORS, register_predictor
from conveyor.core.policies.priority import PriorityPolicy
from conveyor.core.policies.sjf import SJFPolicy
from conveyor.core.policies.slo import SLOPolicy

__all__ = [
    "POLICIES",
    "PREDICTORS",
    "EDFPolicy",
    "FCFSPolicy",
    "FairPolicy",
    "KeyedPolicy",
    "LPMPolicy",
    "PolicyContext",
    "PriorityPolicy",
    "SJFPolicy",
    "SLOPolicy",
    "SchedulingPolicy",
    "make_policy",
    "register_policy",
    "register_predictor",
]
