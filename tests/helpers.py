"""Factories shared by the tests: tiny checkpoints, engines, fake request streams."""

from __future__ import annotations

import functools
import os
import random
import tempfile

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_config(arch: str, **overrides):
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
           "qwen3": tf.Qwen3Config}[arch]
    kw = dict(_BASE)
    if arch == "llama":
        kw["tie_word_embeddings"] = False
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}
    if arch == "mistral":
        kw["sliding_window"] = 24  # short enough that the tests cross it
    if arch == "qwen2":
        kw["tie_word_embeddings"] = True
    if arch == "qwen3":
        kw["head_dim"] = 32
        kw["tie_word_embeddings"] = True
    kw.update(overrides)
    return cls(**kw)


@functools.cache
def make_checkpoint(arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Write a tiny random HF checkpoint (safetensors + tokenizer); cached per session."""
    import transformers as tf

    from conveyor.config.presets import save_synthetic_tokenizer

    cfg = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger-than-default weights give peaked, tie-free logits (greedy is well defined).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    path = tempfile.mkdtemp(prefix=f"conveyor-{arch}-")
    model.save_pretrained(path, safe_serialization=True)
    save_synthetic_tokenizer(path, cfg.vocab_size)
    return path


@functools.cache
def hf_model(path: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt (the reference)."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=model.config.eos_token_id,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt),
                                                                       dtype=torch.long))
    return out[0, len(prompt):].tolist()


def random_prompts(n: int, vocab: int = 384, lo: int = 3, hi: int = 60,
                   seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def cpu_threads() -> int:
    return int(os.environ.get("CONVEYOR_TEST_THREADS", "1"))


def gate_steps(engine, steps: int | None = None, until=None) -> None:
    """Hold an ``LLMEngine``'s steps back, whatever the machine's speed.

    ``steps`` more steps may run (None: any number); with ``until``, the engine is held
    once ``until(engine)`` is true after a step. A held step schedules nothing and
    returns no output, so an engine loop around it stays responsive: adds, aborts and
    calls are served, no request moves. Call it on the engine loop, through
    ``AsyncEngine.call`` (``functools.partial`` for the arguments; an engine-core
    process needs module-level functions, ``until`` included).
    """
    if not hasattr(engine, "_ungated_step"):
        engine._ungated_step = engine.step

        def gated_step():
            gate = engine._step_gate
            if gate["steps"] == 0:
                return _held_step_result(engine)
            if gate["steps"] is not None:
                gate["steps"] -= 1
            outs = engine._ungated_step()
            if gate["until"] is not None and gate["until"](engine):
                gate["steps"] = 0
            return outs

        engine.step = gated_step
    engine._step_gate = {"steps": steps, "until": until}


def _held_step_result(engine):
    """What a step that scheduled nothing returns: an empty ``EngineCoreOutputs`` from an
    engine core, no outputs from an ``LLMEngine``."""
    from conveyor.engine.core import EngineCore
    from conveyor.engine.messages import EngineCoreOutputs

    if isinstance(engine, EngineCore):
        return EngineCoreOutputs([], engine.clock(), scheduled=False)
    return []


def steps_are_held(engine) -> bool:
    """Whether ``gate_steps`` holds this engine now."""
    return getattr(engine, "_step_gate", {}).get("steps") == 0


def fake_execute(out, vocab: int = 100, eos: int | None = None):
    """A stand-in for the model runner: one token per request that reaches its end.

    The token is a function of the request id and position only, so it is the same
    whatever the batch; ``eos`` is never produced.
    """
    from conveyor.core.scheduler_output import ModelRunnerOutput

    result = ModelRunnerOutput(lora_loaded=out.lora_load_ids)  # adapters: at once
    for rid in out.sampling_req_ids:
        token = (hash(rid) + out.num_scheduled_tokens[rid]) % vocab
        if token == eos:
            token = (token + 1) % vocab
        result.sampled_token_ids[rid] = [token]
    return result


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 32, batching: str = "continuous",
                   enable_prefix_caching: bool = False, max_model_len: int | None = None,
                   **sched_kwargs):
    from conveyor.config import SchedulerConfig
    from conveyor.core.kv_cache_manager import KVCacheManager
    from conveyor.core.scheduler import Scheduler

    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, batching=batching,
                          **sched_kwargs)
    return Scheduler(cfg, kv, max_model_len or num_blocks * block_size)


def make_request(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0,
                 **kwargs):
    from conveyor.request import Request
    from conveyor.sampling_params import SamplingParams

    prompt = [(7 * i + len(rid)) % 50 + 1 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, arrival, max_tokens=max_tokens, **kwargs)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out
