"""compressed-tensors checkpoints written by compressed-tensors itself (its quantization
config applied to a transformers model, scales from its own ``calculate_qparams``, its
compressor, its ``update_config``), with the dequantised reference beside them."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import torch

from helpers import make_checkpoint

# name -> (weights' QuantizationArgs keywords, input activations' or None, format)
SCHEMES = {
    "w8a16": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None,
              "pack-quantized"),
    "w8a16-naive": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), None,
                    "int-quantized"),
    "w4a16-sym-g16": (dict(num_bits=4, type="int", symmetric=True, strategy="group",
                           group_size=16), None, "pack-quantized"),
    "w4a16-asym-g16": (dict(num_bits=4, type="int", symmetric=False, strategy="group",
                            group_size=16), None, "pack-quantized"),
    "w4a16-asym-channel": (dict(num_bits=4, type="int", symmetric=False, strategy="channel"),
                           None, "pack-quantized"),
    "w8a8-dynamic": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                     dict(num_bits=8, type="int", symmetric=True, strategy="token",
                          dynamic=True), "int-quantized"),
}


def _qparams(weight: torch.Tensor, args):
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = weight.shape
    group = args.group_size if args.strategy == "group" else k
    g = weight.view(n, k // group, group)
    return calculate_qparams(g.amin(2), g.amax(2), args)


@functools.cache
def write_checkpoint(scheme: str, arch: str = "qwen3") -> tuple[str, str]:
    """(compressed checkpoint, its dequantised float32 reference checkpoint)."""
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from safetensors.torch import save_file

    wargs, aargs, fmt = SCHEMES[scheme]
    src = make_checkpoint(arch)
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(**wargs)
    qscheme = QuantizationScheme(targets=["Linear"], weights=args,
                                 input_activations=(QuantizationArgs(**aargs) if aargs
                                                    else None))
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": qscheme}, ignore=["lm_head"]))
    reference = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ref_modules = dict(reference.named_modules())
    for name, m in model.named_modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        scale, zero = _qparams(m.weight.data, args)
        m.weight_scale.data.copy_(scale.view_as(m.weight_scale))
        if getattr(m, "weight_zero_point", None) is not None:
            m.weight_zero_point.data.copy_(zero.view_as(m.weight_zero_point))
        zp = getattr(m, "weight_zero_point", None)
        q = quantize(m.weight.data, m.weight_scale, zp, args)
        ref_modules[name].weight.data.copy_(dequantize(q, m.weight_scale, zp, args))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out = tempfile.mkdtemp(prefix=f"conveyor-ct-{scheme}-")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(out)
    ref = tempfile.mkdtemp(prefix=f"conveyor-ct-ref-{scheme}-")
    reference.save_pretrained(ref, safe_serialization=True)
    if aargs:
        _fake_quantize_inputs(ref, QuantizationArgs(**aargs))
    return out, ref


def _fake_quantize_inputs(ref: str, args) -> None:
    """The reference model (``helpers.hf_model``'s cached instance of ``ref``) with every
    projection's input fake-quantized by compressed-tensors' own dynamic scheme."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    from helpers import hf_model

    def hook(module, inputs):
        x = inputs[0]
        scale, zero = compute_dynamic_scales_and_zp(x, args, module)
        return (fake_quantize(x, scale, zero, args),)

    for name, m in hf_model(ref).named_modules():
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head"):
            m.register_forward_pre_hook(hook)
