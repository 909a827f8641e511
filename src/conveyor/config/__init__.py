"""Engine configuration: the bottom layer, importing nothing else of conveyor but ``envs``.

    args          EngineArgs: the flat, user-facing options (CLI flags, ``LLM(...)``)
    model         ModelConfig, read from a checkpoint's config.json
    presets       built-in model shapes for dummy-weight runs
    cache         CacheConfig and the KV pool sizing rule
    scheduler     SchedulerConfig and the token budget modes
    policy        PolicyConfig: the scheduling policies' knobs
    speculative   SpeculativeConfig: which proposer, how many draft tokens
    kv_transfer   KVTransferConfig: prefill/decode disaggregation
    engine        EngineConfig, frozen, and its one derivation from the args
    names         the policy and predictor names the checks accept

Torch-free: the scheduler, the simulator and the API server all read it.
"""

from conveyor.config.args import DISTRIBUTED_BACKENDS, EngineArgs
from conveyor.config.cache import CacheConfig, gpu_kv_cache_bytes, kv_blocks_for
from conveyor.config.engine import EngineConfig, resolve_engine_config
from conveyor.config.kv_transfer import KV_FALLBACKS, KV_ROLES, KVTransferConfig
from conveyor.config.model import (
    ARCHITECTURE_OF_MODEL_TYPE,
    DTYPES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    kv_hash_key,
    load_model_config,
    model_config_from_hf,
)
from conveyor.config.names import POLICY_NAMES, PREDICTOR_NAMES
from conveyor.config.policy import PolicyConfig
from conveyor.config.scheduler import TOKEN_BUDGET_MODES, SchedulerConfig
from conveyor.config.speculative import SpeculativeConfig

__all__ = [
    "ARCHITECTURE_OF_MODEL_TYPE",
    "DISTRIBUTED_BACKENDS",
    "DTYPES",
    "KV_FALLBACKS",
    "KV_ROLES",
    "POLICY_NAMES",
    "PREDICTOR_NAMES",
    "SUPPORTED_ARCHITECTURES",
    "TOKEN_BUDGET_MODES",
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "KVTransferConfig",
    "ModelConfig",
    "PolicyConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "gpu_kv_cache_bytes",
    "kv_blocks_for",
    "kv_hash_key",
    "load_model_config",
    "model_config_from_hf",
    "resolve_engine_config",
]
