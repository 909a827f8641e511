"""The model's shape for the simulator: a ModelConfig from config.json, no weights, no torch."""

from __future__ import annotations

import os

from conveyor.config import EngineArgs, ModelConfig, load_model_config, model_config_from_hf
from conveyor.config.presets import PRESETS, preset_config


def resolve_sim_model(args: EngineArgs) -> ModelConfig:
    """``args.model`` as a folder with config.json, or a built-in shape name.

    Built-in shapes are read from the preset table directly rather than materialized
    with ``resolve_model_path``: that writes a tokenizer through transformers, which
    imports torch, and the simulator needs only the shape.
    """
    if os.path.isdir(args.model):
        return load_model_config(args.model, dtype=args.dtype, load_format="dummy",
                                 seed=args.seed, max_model_len=args.max_model_len,
                                 served_model_name=args.served_model_name or args.model)
    if args.model in PRESETS:
        return model_config_from_hf(preset_config(args.model), f"preset:{args.model}",
                                    dtype=args.dtype, load_format="dummy", seed=args.seed,
                                    max_model_len=args.max_model_len,
                                    served_model_name=args.served_model_name or args.model)
    raise ValueError(f"model {args.model!r} is neither a folder with config.json nor a "
                     f"built-in shape; built-in shapes: {', '.join(PRESETS)}")
