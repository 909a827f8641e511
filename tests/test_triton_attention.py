"""The ``triton`` attention backend on the CPU, under Triton's interpreter: its kernels
against the reference attention (float32 and float16), greedy tokens equal transformers'
through it (float32) with chunked prefill, prefix hits, preemption and a sliding window;
and the compile check (cubins for sm_80 and sm_90, no GPU).

The interpreter must be switched on before triton is imported, so where this process has
not got it (the whole suite's run) one test reruns this file in a child process with
``TRITON_INTERPRET=1`` and passes or fails with it."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:
    def test_the_triton_backend_under_the_interpreter() -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                               "no:cacheprovider", __file__], env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]

    def test_every_triton_kernel_compiles_for_sm80_and_sm90() -> None:
        """``scripts/triton_compile_check.py`` builds cubins for both targets (ptxas
        included) and fails on a compile error or a shared-memory overrun."""
        root = os.path.join(os.path.dirname(__file__), "..")
        env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
        proc = subprocess.run([sys.executable, os.path.join(root, "scripts",
                                                            "triton_compile_check.py"),
                               "--arch", "sm_80,sm_90", "--quick"], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        assert "12 builds, 0 failed" in proc.stdout, proc.stdout

else:
    from conveyor import LLM, SamplingParams
    from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
    from conveyor.model.attention.paged import paged_attention
    from conveyor.model.attention.registry import select_attention_backend
    from conveyor.model.attention.sdpa import sdpa_decode
    from conveyor.runner.decode_layout import attended, padded_slots, window_starts

    from helpers import hf_greedy, make_checkpoint, random_prompts

    BS = 4  # block size of the hand-built batches

    def _batch(dtype: torch.dtype, hq: int, hkv: int, d: int, window: int | None, seed=0):
        """A step of two decodes, a fresh prompt and a chunk after a cached prefix over a
        paged cache with scattered blocks: (q, k, v, caches, metadata for SDPA)."""
        g = torch.Generator().manual_seed(seed)
        num_blocks = 40
        caches = [torch.randn(num_blocks * BS, hkv, d, generator=g).to(dtype) for _ in "kv"]
        perm = torch.randperm(num_blocks, generator=g).tolist()
        tables = [perm[0:5], perm[5:14], perm[14:20], perm[20:32]]
        # (cached tokens before the step, new tokens): decode, decode, fresh, prefix chunk
        shape = [(6, 1), (30, 1), (0, 19), (21, 13)]
        slots, pos, decode_tables, decode_ctx, prefills, cursor = [], [], [], [], [], 2
        for (start, n), table in zip(shape, tables):
            p = list(range(start, start + n))
            pos += p
            slots += [table[x // BS] * BS + x % BS for x in p]
        for (start, n), table in zip(shape[:2], tables[:2]):
            decode_tables.append(table)
            decode_ctx.append(start + n)
        for (start, n), table in zip(shape[2:], tables[2:]):
            ctx = start + n
            if start == 0 and (window is None or n <= window):
                prefills.append(PrefillSegment(cursor, n))
            else:
                cols = torch.arange(ctx)
                qp = torch.arange(start, ctx)[:, None]
                mask = cols[None, :] <= qp
                if window is not None:
                    mask &= cols[None, :] > qp - window
                ctx_slots = torch.tensor([table[x // BS] * BS + x % BS for x in range(ctx)])
                prefills.append(PrefillSegment(cursor, n, ctx_slots, mask))
            cursor += n
        t = len(slots)
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        k = torch.randn(t, hkv, d, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, generator=g).to(dtype)
        import numpy as np

        lens = np.asarray(decode_ctx, dtype=np.int32)
        dslots = padded_slots(decode_tables, max(decode_ctx), BS)
        starts = window_starts(lens, window)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), num_decodes=2,
            decode_slots=torch.from_numpy(dslots), decode_lens=torch.from_numpy(lens),
            decode_starts=torch.from_numpy(starts),
            decode_mask=torch.from_numpy(attended(dslots.shape[1], lens, starts)),
            decode_kernel=sdpa_decode, prefills=prefills, sliding_window=window)
        return q, k, v, caches, meta, torch.tensor(pos)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("heads", [(4, 2, 16), (6, 2, 24), (2, 2, 32)])
    @pytest.mark.parametrize("window", [None, 7])
    def test_unified_kernel_matches_the_reference(dtype, heads, window) -> None:
        q, k, v, (kc, vc), meta, _ = _batch(dtype, *heads, window)
        scale = heads[2] ** -0.5
        want_k, want_v = kc.clone(), vc.clone()
        want = paged_attention(q, k, v, want_k, want_v, meta, scale)
        backend = select_attention_backend("triton", "cpu", dtype, *heads[:2], heads[2])
        meta.decode_kernel = backend.decode_kernel()
        got = paged_attention(q, k, v, kc, vc, meta, scale)
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # the KV write
        tol = 2e-6 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        # As a plain decode kernel (decode rows alone), as autotune and the draft call it.
        decode = meta.decode_kernel(q[:2], kc, vc, meta, scale)
        torch.testing.assert_close(decode, want[:2], atol=tol, rtol=tol)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_softcap_caps_the_scores(dtype) -> None:
        q, k, v, (kc, vc), meta, _ = _batch(dtype, 4, 2, 16, None, seed=1)
        backend = select_attention_backend("triton", "cpu", dtype, 4, 2, 16)
        cap = 3.0
        got = backend.decode_kernel().unified(q, k, v, kc, vc, meta, 0.25, softcap=cap)
        # Reference: every query over its context slots, scores capped before softmax.
        rows = [(0, meta.decode_slots[0, :7]), (1, meta.decode_slots[1, :31])]
        rows += [(2 + i, meta.slot_mapping[2:21][:i + 1]) for i in range(19)]
        rows += [(21 + i, meta.prefills[1].ctx_slots[:22 + i]) for i in range(13)]
        for row, slots in rows:
            keys = kc[slots].float().repeat_interleave(2, 1)
            vals = vc[slots].float().repeat_interleave(2, 1)
            s = torch.einsum("hd,nhd->hn", q[row].float(), keys) * 0.25
            p = (cap * torch.tanh(s / cap)).softmax(-1)
            want = torch.einsum("hn,nhd->hd", p, vals)
            tol = 2e-6 if dtype == torch.float32 else 2e-3
            torch.testing.assert_close(got[row].float(), want, atol=tol, rtol=tol)
        assert not math.isnan(float(got.float().sum()))

    CONFIGS = {
        "chunked": ("llama", dict(max_num_batched_tokens=13)),
        "preempt": ("llama", dict(num_kv_blocks=7, block_size=8)),
        "window_chunked": ("mistral", dict(max_num_batched_tokens=11)),
    }

    @pytest.mark.parametrize("config", list(CONFIGS))
    def test_greedy_through_triton_matches_transformers(config) -> None:
        arch, kwargs = CONFIGS[config]
        path = make_checkpoint(arch)
        rng = random.Random(3)
        prompts = random_prompts(6, lo=3, hi=40, seed=3)
        params = [SamplingParams(max_tokens=rng.randint(4, 12), temperature=0.0)
                  for _ in prompts]
        llm = LLM(path, dtype="float32", attention_backend="triton", **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for out, prompt, sp in zip(outs, prompts, params):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, sp.max_tokens)
        if config == "preempt":
            assert llm.stats()["num_preemptions"] > 0

    def test_prefix_hits_through_triton_match_transformers() -> None:
        path = make_checkpoint("llama")
        rng = random.Random(7)
        base = [rng.randrange(4, 384) for _ in range(24)]
        prompts = [base[:16] + [11], base[:19] + [12, 13], base[:24]]
        llm = LLM(path, dtype="float32", attention_backend="triton", block_size=8,
                  num_kv_blocks=32, max_num_seqs=1)
        params = SamplingParams(max_tokens=4, temperature=0.0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for out, prompt in zip(outs, prompts):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, 4)
        assert llm.stats()["prefix_cache_hits"] > 0

    def test_padded_static_decode_batches_of_the_cuda_graphs_match_transformers() -> None:
        """What a CUDA graph replays (runner/decode_graphs.py), run eagerly: decode steps
        padded to the next size through the static buffers, padding rows with no query
        and no KV write; the tokens stay transformers'."""
        from conveyor.runner.decode_graphs import DecodeGraphs

        path = make_checkpoint("mistral")  # a sliding window too
        llm = LLM(path, dtype="float32", attention_backend="triton", max_num_seqs=5,
                  max_num_batched_tokens=64)
        runner = llm.engine.runner
        graphs = DecodeGraphs(runner, 5, 128, capture=False)
        assert graphs.sizes == [1, 2, 4, 5]
        runner.decode_graphs = graphs
        prompts = random_prompts(5, lo=3, hi=30, seed=8)
        params = [SamplingParams(max_tokens=2 + 2 * i, temperature=0.0) for i in range(5)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for out, prompt, sp in zip(outs, prompts, params):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, sp.max_tokens)
        assert graphs.num_replays >= 6 and set(graphs.metas) >= {1, 2, 4}

    def test_triton_applies_to_what_the_interpreter_computes_right_and_comes_last() -> None:
        from conveyor.model.attention.registry import attention_backend_names_for

        assert "triton" not in attention_backend_names_for("cpu", torch.bfloat16, 4, 2, 16)
        names = attention_backend_names_for("cpu", torch.float32, 4, 2, 16)
        assert names[-1] == "triton"  # auto takes it only where nothing else applies
