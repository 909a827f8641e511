"""Tiny PEFT LoRA adapters (non-zero B) of a tiny checkpoint, and PEFT's greedy tokens."""

from __future__ import annotations

import functools
import tempfile

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@functools.cache
def make_adapter(base: str, seed: int, r: int = 8, alpha: int = 16,
                 targets: tuple[str, ...] = tuple(TARGETS), rslora: bool = False) -> str:
    """A PEFT LoRA of ``base`` saved with save_pretrained, A and B random (B non-zero, so
    the adapter changes the tokens)."""
    import peft
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                          lora_dropout=0.0, use_rslora=rslora)
    pm = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    path = tempfile.mkdtemp(prefix=f"conveyor-lora-{seed}-")
    pm.save_pretrained(path)
    return path


@functools.cache
def _peft_model(base: str, adapter: str):
    import peft
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).eval()


@functools.cache
def peft_greedy(base: str, adapter: str | None, prompt: tuple[int, ...],
                max_new_tokens: int) -> list[int]:
    """PEFT's greedy continuation (transformers' for ``adapter`` None)."""
    from helpers import hf_greedy

    if adapter is None:
        return hf_greedy(base, list(prompt), max_new_tokens)
    model = _peft_model(base, adapter)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=model.config.eos_token_id,
                             pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
