"""A real target/draft model pair for speculative-decoding benchmarks, trained once and cached.

    python -m benchmarks.spec.spec_pair           # train if missing, print the manifest
    python -m benchmarks.spec.spec_pair --check   # also compare conveyor with transformers
    python -m benchmarks.spec.spec_pair --force   # retrain

No weights can be downloaded, so both models are trained here on a corpus every machine
has: the Python standard library's own ``*.py`` source (``site-packages``, files over
200 KB, files that are not UTF-8 and files that say they are generated are skipped).
About 5% of the files, picked by a hash of their relative path, are held out: the
reported losses and ``code_prompts`` come from them.

- tokenizer: byte-level BPE, 4,096 entries (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2), trained on
  the train files; the same files are saved into both model folders.
- target: Llama, hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 1024 (3.9M non-embedding
  parameters); draft: hidden 128, 2 layers, 4 / 2 heads, MLP 384 (0.39M, 10x fewer).
  float32 safetensors, untied embeddings, ``max_position_embeddings`` 2048, but trained on
  256-token windows only: quality falls off past ~256 positions.
- training: AdamW, linear warmup then cosine decay to 10%, batches of 8 random 256-token
  windows of the concatenated train files (``<s>`` file ``</s>`` ...), 2 threads, seed 0,
  bfloat16 autocast where the CPU has bf16 instructions (weights stay float32; faster,
  at the same loss). The target first; then the draft, **distilled from it**: its loss
  is 0.1 x the corpus token's cross entropy + 0.9 x KL(target || draft) over the whole
  next-token distribution (the target run on the same windows, no gradient), as drafts
  are trained to agree with their target (DistillSpec; EAGLE and Medusa train on the
  target's outputs too). A fixed number of steps (1500 target, 800 draft) keeps the
  result reproducible (the same held-out loss on different CPUs). ``--minutes-target`` /
  ``--minutes-draft`` instead size the step count from a 3-step timing run (not
  reproducible). A run that spends over 3x its planned
  time in CPU time (2.5x more planned without bf16; not wall time, so a busy machine
  does not cut it short) stops early and is marked ``truncated`` in the manifest.
- held-out loss (nats/token, float32, 128 fixed windows): target 4.06; draft 4.18
  distilled (4.44 trained on the corpus alone, v1). The draft's argmax equals the
  target's on 79% of the positions of the target's greedy continuations of 16
  ``code_prompts`` (64% for v1) and on 69% of held-out corpus positions (48%):
  ``draft_agreement`` in the manifest. Weak models: greedy output soon repeats itself.

Cache: ``$CONVEYOR_CACHE_DIR/spec_pair/v2`` (else ``~/.cache/conveyor/spec_pair/v2``) with
``target/``, ``draft/`` and ``manifest.json``; ``ensure_pair()`` trains only when the
manifest is missing. The Python version is recorded: another stdlib gives another pair.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import sysconfig
import time
from typing import Any

VERSION = "v2"  # v2: the draft is distilled from the target
SEED = 0
SEQ_LEN = 256
BATCH = 8
VOCAB_SIZE = 4096
SPECIALS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 (BpeTrainer adds them first, in order)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
HELDOUT_PER_10K = 500  # 5% of files
MAX_FILE_BYTES = 200_000
EVAL_WINDOWS = 128
EVAL_SEED = 1234
THREADS = 2
FP32_SLOWDOWN = 2.5  # planned time without bf16 autocast, against with it

# In this budget both models see 1-3M tokens, where loss follows the step count more than
# the size (a 0.4M model out-trained a 9.4M one step for step): so a modest target that runs
# many steps, and a 10x smaller draft that runs fewer, which keeps the two apart.
MODELS: dict[str, dict[str, Any]] = {
    "target": {"arch": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=1024),
               "steps": 1500, "lr": 3e-3, "minutes": 4.5},
    # The draft learns the target's next-token distribution (KL, weight 0.9) besides the
    # corpus token: it then agrees with the target's argmax more often than a draft
    # trained on the corpus alone, and its own held-out loss is lower too.
    "draft": {"arch": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=384),
              "steps": 800, "lr": 3e-3, "minutes": 5.5, "distill": 0.9},
}


def log(msg: str) -> None:
    print(f"[spec_pair] {msg}", file=sys.stderr, flush=True)


# ---- corpus -------------------------------------------------------------------------------
def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str) -> bool:
    # sha1 rather than hash(): str hashes are salted per process.
    h = int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:8], "big")
    return h % 10_000 < HELDOUT_PER_10K


def stdlib_files(root: str | None = None) -> list[tuple[str, str]]:
    """(relative posix path, text) of every usable stdlib ``.py`` file, sorted by path."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            full = os.path.join(dirpath, name)
            if os.path.getsize(full) > MAX_FILE_BYTES:  # pydoc topics, giant test modules
                continue
            try:
                with open(full, encoding="utf-8") as f:
                    text = f.read()
            except UnicodeDecodeError:  # the deliberately mis-encoded test modules
                continue
            # Codec tables, keyword lists, sysconfigdata: data, not code people write.
            if "generated" in "\n".join(text.splitlines()[:8]).lower():
                continue
            if text.strip():
                out.append((os.path.relpath(full, root).replace(os.sep, "/"), text))
    out.sort()
    return out


def split_files(files: list[tuple[str, str]]) -> tuple[list[str], list[str], list[str]]:
    """(train texts, held-out texts, held-out relative paths)."""
    train = [t for p, t in files if not is_heldout(p)]
    held = [(p, t) for p, t in files if is_heldout(p)]
    return train, [t for _, t in held], [p for p, _ in held]


# ---- tokenizer ----------------------------------------------------------------------------
def train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def wrap_tokenizer(tok: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=2048)


def encode_corpus(tok: Any, texts: list[str]) -> Any:
    """``<s> file </s>`` for every file, concatenated, as one int32 tensor."""
    import torch

    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.int32)


# ---- models -------------------------------------------------------------------------------
def llama_config(arch: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=2048,
                       tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=BOS_ID,
                       eos_token_id=EOS_ID, pad_token_id=PAD_ID, **arch)


def param_counts(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    return {"total": total, "non_embedding": total - emb}


def bf16_autocast_ok() -> bool:
    """bf16 matmuls only pay on CPUs with bf16 instructions (2.5x here); elsewhere fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: Any, lr: float) -> Any:
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(model: Any, opt: Any, batch: Any, lr: float, autocast: bool,
               teacher: Any = None, distill: float = 0.0) -> float:
    """One AdamW step; returns the cross entropy on the batch's next tokens. With a
    ``teacher``, the loss is ``(1 - distill) * CE + distill * KL(teacher || model)`` per
    token (the teacher's full next-token distribution, not only the corpus token)."""
    import torch
    import torch.nn.functional as F

    for group in opt.param_groups:
        group["lr"] = lr
    x, y = batch[:, :-1], batch[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=x).logits
    logits = logits.float().reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(logits, y.reshape(-1))
    loss = ce
    if teacher is not None and distill > 0.0:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            t_logits = teacher(input_ids=x).logits
        t_logp = F.log_softmax(t_logits.float().reshape(-1, logits.shape[-1]), dim=-1)
        kl = F.kl_div(F.log_softmax(logits, dim=-1), t_logp, log_target=True,
                      reduction="batchmean")
        loss = (1.0 - distill) * ce + distill * kl
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ce.item()


def sample_batch(data: Any, gen: Any, batch: int = BATCH) -> Any:
    import torch

    starts = torch.randint(0, data.numel() - SEQ_LEN - 1, (batch,), generator=gen)
    offs = torch.arange(SEQ_LEN + 1)
    return data[starts[:, None] + offs[None, :]].long()


def steps_for_minutes(model: Any, lr: float, data: Any, minutes: float,
                      autocast: bool) -> int:
    """Steps that fit ``minutes``, timed on a throwaway copy (the real run keeps its seed)."""
    import torch

    probe = copy.deepcopy(model)
    opt = make_optimizer(probe, lr)
    gen = torch.Generator().manual_seed(99)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        train_step(probe, opt, sample_batch(data, gen), lr, autocast)
        times.append(time.perf_counter() - t0)
    per_step = min(times[1:])  # the first step pays for allocation
    return max(20, int(minutes * 60 / per_step))


def train_model(name: str, data: Any, minutes: float | None, autocast: bool,
                teacher: Any = None) -> tuple[Any, dict]:
    import torch
    from transformers import LlamaForCausalLM

    spec = MODELS[name]
    distill = spec.get("distill", 0.0) if teacher is not None else 0.0
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config(spec["arch"])).float().train()
    steps = spec["steps"] if minutes is None else steps_for_minutes(
        model, spec["lr"], data, minutes, autocast)
    planned_s = 60 * (minutes if minutes is not None else spec["minutes"])
    if not autocast and minutes is None:
        # The minutes were planned with bf16 autocast; without bf16 instructions the same
        # steps take FP32_SLOWDOWN times longer, so the cap that stops a run grows alike.
        planned_s *= FP32_SLOWDOWN
    opt = make_optimizer(model, spec["lr"])
    gen = torch.Generator().manual_seed(SEED + (1 if name == "target" else 2))
    losses: list[float] = []
    t0, c0 = time.perf_counter(), time.process_time()
    done = 0
    for step in range(steps):
        losses.append(train_step(model, opt, sample_batch(data, gen),
                                 lr_at(step, steps, spec["lr"]), autocast, teacher, distill))
        done = step + 1
        if done % 50 == 0 or done == steps:
            log(f"{name} step {done}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.3f} "
                f"{time.perf_counter() - t0:.0f}s")
        # The guard counts CPU time, not wall time: a machine shared with other work only
        # slows the run down, while one far slower than planned is stopped.
        cpu_s = (time.process_time() - c0) / THREADS
        if cpu_s > 3 * planned_s:
            log(f"{name}: stopping at step {done}: {cpu_s:.0f} CPU-s per thread, over 3x "
                f"the planned {planned_s:.0f}s")
            break
    train_s = time.perf_counter() - t0
    cpu_s = (time.process_time() - c0) / THREADS
    model.eval()
    info = {"steps": done, "planned_steps": steps, "truncated": done < steps,
            "distill": distill,
            "batch": BATCH, "seq_len": SEQ_LEN, "peak_lr": spec["lr"],
            "train_tokens": done * BATCH * SEQ_LEN, "train_time_s": round(train_s, 1),
            "train_cpu_s_per_thread": round(cpu_s, 1),
            "final_train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "params": param_counts(model), "arch": spec["arch"]}
    return model, info


def heldout_loss(model: Any, data: Any) -> float:
    """Mean per-token cross entropy (nats) in float32 on a fixed sample of windows."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(EVAL_SEED)
    windows = sample_batch(data, gen, EVAL_WINDOWS)
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in windows.split(16):
            logits = model(input_ids=chunk[:, :-1]).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                     chunk[:, 1:].reshape(-1), reduction="sum").item()
            count += chunk[:, 1:].numel()
    return total / count


def draft_agreement(target: Any, draft: Any, data: Any, prompts: list[list[int]],
                    new_tokens: int = 64) -> dict[str, float]:
    """How often the draft's argmax is the target's: on held-out windows (teacher-forced
    on the corpus), and on the target's own greedy continuations of ``prompts`` (what
    greedy speculation meets), each continuation position with its true prefix."""
    import torch

    gen = torch.Generator().manual_seed(EVAL_SEED)
    windows = sample_batch(data, gen, EVAL_WINDOWS // 4)[:, :-1]
    with torch.no_grad():
        same = (target(input_ids=windows).logits.argmax(-1)
                == draft(input_ids=windows).logits.argmax(-1)).float().mean().item()
        ids = torch.tensor(prompts)
        out = target.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=PAD_ID)
        n = ids.shape[1]
        pred = draft(input_ids=out[:, :-1]).logits.argmax(-1)[:, n - 1:]
        greedy = (pred == out[:, n:]).float().mean().item()
    return {"heldout_windows": round(same, 4), "target_greedy": round(greedy, 4),
            "prompts": len(prompts), "new_tokens": new_tokens}


# ---- cache --------------------------------------------------------------------------------
def default_cache_dir() -> str:
    base = os.environ.get("CONVEYOR_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "conveyor")
    return os.path.join(base, "spec_pair", VERSION)


def cpu_model_name() -> str:
    from conveyor.kernels.cpu.cpuinfo import cpu_model_name as conveyor_cpu_model

    return conveyor_cpu_model()


def _sha256_dir(path: str, names: list[str]) -> str:
    h = hashlib.sha256()
    for n in sorted(names):
        with open(os.path.join(path, n), "rb") as f:
            h.update(n.encode() + b"\0" + f.read())
    return h.hexdigest()


def _with_paths(manifest: dict, cache_dir: str) -> dict:
    # Absolute paths are recomputed on load, so a moved cache still works.
    manifest["target_path"] = os.path.join(cache_dir, "target")
    manifest["draft_path"] = os.path.join(cache_dir, "draft")
    return manifest


def build_pair(cache_dir: str, minutes_target: float | None = None,
               minutes_draft: float | None = None) -> dict:
    """Train tokenizer, target and draft into ``cache_dir`` (built aside, then renamed)."""
    import tokenizers
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    torch.set_flush_denormal(True)  # tiny Adam moments must not fall onto the slow path
    t_all = time.perf_counter()
    tmp = f"{cache_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    files = stdlib_files()
    train_texts, held_texts, held_paths = split_files(files)
    log(f"{len(files)} stdlib files: {len(train_texts)} train, {len(held_texts)} held out")
    tok = train_tokenizer(train_texts)
    train_data = encode_corpus(tok, train_texts)
    held_data = encode_corpus(tok, held_texts)
    log(f"tokens: {train_data.numel()} train, {held_data.numel()} held out")
    hf_tok = wrap_tokenizer(tok)
    tok_files: list[str] = []
    for name in MODELS:
        d = os.path.join(tmp, name)
        hf_tok.save_pretrained(d)
        tok_files = sorted(os.listdir(d))
    tok_hashes = {_sha256_dir(os.path.join(tmp, n), tok_files) for n in MODELS}
    assert len(tok_hashes) == 1, "target and draft tokenizer files differ"

    autocast = bf16_autocast_ok()
    minutes = {"target": minutes_target, "draft": minutes_draft}
    models: dict[str, dict] = {}
    trained: dict[str, Any] = {}
    for name in MODELS:  # the target first: the draft learns from it
        model, info = train_model(name, train_data, minutes[name], autocast,
                                  teacher=trained.get("target"))
        info["heldout_loss"] = round(heldout_loss(model, held_data), 4)
        log(f"{name}: held-out loss {info['heldout_loss']:.4f} nats/token")
        model.save_pretrained(os.path.join(tmp, name), safe_serialization=True)
        models[name] = info
        trained[name] = model
    agreement = draft_agreement(trained["target"], trained["draft"], held_data,
                                code_prompts(os.path.join(tmp, "target"), 16, 128))
    log(f"draft argmax = target argmax: {agreement}")
    del trained

    t, d = models["target"]["params"], models["draft"]["params"]
    manifest = {
        "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "corpus": {"stdlib": stdlib_root(), "python": platform.python_version(),
                   "files_train": len(train_texts), "files_heldout": len(held_texts),
                   "tokens_train": train_data.numel(), "tokens_heldout": held_data.numel(),
                   "heldout_sample": held_paths[:10]},
        "tokenizer": {"type": "byte-level BPE", "vocab_size": tok.get_vocab_size(),
                      "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
                      "files_sha256": tok_hashes.pop()},
        "eval": {"windows": EVAL_WINDOWS, "seq_len": SEQ_LEN, "seed": EVAL_SEED,
                 "metric": "mean per-token cross entropy, nats, float32"},
        "training": {"seed": SEED, "threads": THREADS, "optimizer": "AdamW(0.9, 0.95), wd 0.1",
                     "schedule": "linear warmup 5%, cosine to 10% of peak",
                     "autocast": "bfloat16" if autocast else "none (float32)"},
        "target": models["target"],
        "draft": models["draft"],
        "non_embedding_ratio": round(t["non_embedding"] / d["non_embedding"], 2),
        "draft_agreement": agreement,
        "total_time_s": round(time.perf_counter() - t_all, 1),
        "cpu": cpu_model_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    shutil.rmtree(cache_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
    os.replace(tmp, cache_dir)
    return _with_paths(manifest, cache_dir)


def ensure_pair(cache_dir: str | None = None, force: bool = False, *,
                minutes_target: float | None = None,
                minutes_draft: float | None = None) -> dict:
    """The cached pair's manifest (with absolute ``target_path``/``draft_path``); trains
    only when the manifest is missing or ``force``. The minutes apply to training only."""
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    manifest_file = os.path.join(cache_dir, "manifest.json")
    if not force and os.path.isfile(manifest_file):
        with open(manifest_file) as f:
            return _with_paths(json.load(f), cache_dir)
    return build_pair(cache_dir, minutes_target, minutes_draft)


# ---- prompts ------------------------------------------------------------------------------
_DEF_LINE = re.compile(r"[ \t]*(async[ \t]+)?def[ \t]")
_BODY_LINE = re.compile(r"[ \t]{4,}[A-Za-z_]")


def code_prompts(tokenizer_path: str, num: int, prompt_tokens: int,
                 seed: int = 0) -> list[list[int]]:
    """``num`` prompts of exactly ``prompt_tokens`` token ids, each cut from a held-out file
    at the start of a line: half at a ``def`` line, half at an indented line (inside a
    function or class). Round-robin over the held-out files in a seeded order, so a file
    gives a second prompt only once every file has given one."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_path, "tokenizer.json"))
    rng = random.Random(seed)
    _, held_texts, _ = split_files(stdlib_files())
    texts = [t for t in held_texts if len(t) > 3 * prompt_tokens]
    if not texts:
        raise ValueError(f"no held-out file is long enough for {prompt_tokens} tokens")
    rng.shuffle(texts)
    candidates: list[tuple[list[int], list[int]] | None] = [None] * len(texts)
    prompts: list[list[int]] = []
    seen: set[tuple[int, int]] = set()
    misses = 0
    i = 0
    while len(prompts) < num:
        k = i % len(texts)
        i += 1
        text = texts[k]
        if candidates[k] is None:
            defs, body, pos = [], [], 0
            for line in text.splitlines(keepends=True):
                if _DEF_LINE.match(line):
                    defs.append(pos)
                elif _BODY_LINE.match(line):
                    body.append(pos)
                pos += len(line)
            candidates[k] = (defs, body)
        defs, body = candidates[k]
        pool = defs if (rng.random() < 0.5 and defs) or not body else body
        ids = None
        for _ in range(8):
            if not pool:
                break
            start = rng.choice(pool)
            if (k, start) in seen:
                continue
            # Encode a generous slice, not the whole rest of the file; only the slice's
            # last word can tokenize differently, and it is cut away.
            enc = tok.encode(text[start:start + 8 * prompt_tokens + 256],
                             add_special_tokens=False).ids
            if len(enc) >= prompt_tokens + 2:
                seen.add((k, start))
                ids = enc[:prompt_tokens]
                break
        if ids is None:
            misses += 1
            if misses > 4 * len(texts) + num:
                raise ValueError(f"could only cut {len(prompts)} of {num} prompts")
            continue
        prompts.append(ids)
    return prompts


# ---- checks -------------------------------------------------------------------------------
def check_with_conveyor(path: str, prompt_tokens: int = 128, max_tokens: int = 64) -> dict:
    """Greedy tokens from conveyor against transformers' ``generate(do_sample=False)`` for one
    held-out prompt; on a mismatch, the reference's top-2 logit gap there (a near tie can
    flip under float32 rounding differences)."""
    import torch
    from transformers import AutoModelForCausalLM

    from conveyor import LLM, SamplingParams

    torch.set_num_threads(THREADS)
    prompt = code_prompts(path, 1, prompt_tokens, seed=7)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    ref = out[0, len(prompt):].tolist()
    llm = LLM(model=path, dtype="float32", device="cpu", num_threads=THREADS, seed=0)
    got = list(llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                            use_tqdm=False)[0].outputs[0].token_ids)
    result: dict[str, Any] = {"path": path, "prompt_tokens": len(prompt),
                              "new_tokens": len(ref), "match": got == ref}
    if got != ref:
        n = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got),
                                                                           len(ref)))
        result["first_mismatch"] = n
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ref[:n]])).logits[0, -1]
        top = logits.topk(2).values
        result["ref_top2_gap"] = round((top[0] - top[1]).item(), 6)
    tok = llm.get_tokenizer()
    result["text"] = tok.decode(prompt[-24:]) + "<|>" + tok.decode(got)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="retrain even if cached")
    parser.add_argument("--check", action="store_true",
                        help="compare conveyor's greedy tokens with transformers' on both")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--minutes-target", type=float, default=None,
                        help="size the target's steps to this wall time (default: fixed "
                             f"{MODELS['target']['steps']} steps)")
    parser.add_argument("--minutes-draft", type=float, default=None,
                        help="size the draft's steps to this wall time (default: fixed "
                             f"{MODELS['draft']['steps']} steps)")
    args = parser.parse_args()
    manifest = ensure_pair(args.cache_dir, args.force, minutes_target=args.minutes_target,
                           minutes_draft=args.minutes_draft)
    print(json.dumps(manifest, indent=2))
    if args.check:
        ok = True
        for key in ("target_path", "draft_path"):
            res = check_with_conveyor(manifest[key])
            print(json.dumps(res, indent=2))
            ok &= res["match"]
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
