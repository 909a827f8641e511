"""Executes a ``SchedulerOutput``: builds the flat batch, runs the model, samples.

The runner makes no scheduling decision and owns no request state: it keeps a
persistent batch row per scheduled request (its token ids, block table and sampling
parameters), updated from the scheduler's diffs. Where a request is
(``num_computed_tokens``) comes from the scheduler every step, and exactly the
scheduler's ``sampling_req_ids`` sample.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from conveyor.config import (
    CacheConfig,
    ModelConfig,
    SpeculativeConfig,
    gpu_kv_cache_bytes,
    kv_blocks_for,
)
from conveyor.config.kv_window import KVGroups
from conveyor.config.lora import LoRAConfig
from conveyor.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from conveyor.distributed.parallel import SINGLE, TPShard
from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
from conveyor.model.attention.registry import select_attention_backend
from conveyor.model.autotune.plan import BackendPlan, ModelShape, plan_backends
from conveyor.model.layers.moe import pack_experts
from conveyor.model.loader import DTYPES, load_model
from conveyor.model.quant.apply import quantize_model
from conveyor.model.quant.kv_cache import attention_backend_for, quantized_kv_caches
from conveyor.runner import huge_pages
from conveyor.runner.decode_layout import attended, padded_slots, window_starts
from conveyor.runner.fused_decode import FusedDecode
from conveyor.runner.grammar import Grammars, apply_mask
from conveyor.runner.host_memory import keep_freed_host_memory
from conveyor.runner.lora import lora_rows, make_lora_manager
from conveyor.runner.prompt_logprobs import compute_prompt_logprobs, prompt_spans
from conveyor.runner.request_state import RequestState
from conveyor.runner.sampler import Sampler, SamplingRow
from conveyor.runner.verify import VerifyGroup, verify
from conveyor.runner.window_views import GroupTables, PrefillArgs, add_window_views
from conveyor.sampling_params import SamplingParams
from conveyor.spec.proposers import ProposeItem, Proposer, make_proposer
from conveyor.timings import PhaseTimings

logger = logging.getLogger(__name__)

# A step with nothing scheduled waits this long for an adapter load in flight (the engine
# would otherwise step again at once while requests wait only for it).
LORA_IDLE_WAIT_S = 0.01
# The longest an empty step waits for an ordered grammar compile to end (the engine has
# nothing else to run; a new request still gets in within this).
GRAMMAR_POLL_S = 0.005


def default_kv_cache_memory(device: torch.device, gpu_memory_utilization: float = 0.9,
                            peak_torch: int | None = None) -> int:
    """A sensible share of memory for the KV pool. On CUDA, ``gpu_memory_utilization``
    of the device less the profiled peak of weights and a full step (``peak_torch``,
    from ``ModelRunner.profile_peak_memory``; what torch holds now if not profiled)
    and what others hold outside torch."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        non_torch = max(0, total - free - reserved)
        peak = torch.cuda.memory_allocated(device) if peak_torch is None else peak_torch
        return gpu_kv_cache_bytes(total, gpu_memory_utilization, peak, non_torch)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(4 << 30, available * 0.25))


def num_blocks_for(cache: CacheConfig, model: ModelConfig, device: torch.device,
                   max_num_seqs: int, peak_torch: int | None = None) -> int:
    """KV blocks from ``num_kv_blocks``, else ``kv_cache_memory``, else a default share.

    The default on CPU is also capped at what ``max_num_seqs`` sequences of full
    length can use, so a tiny model does not zero gigabytes it will never touch.
    """
    return kv_blocks_for(cache, model, max_num_seqs,
                         default_memory=lambda: default_kv_cache_memory(
                             device, cache.gpu_memory_utilization, peak_torch),
                         cap_to_useful=device.type != "cuda")


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cache_cfg: CacheConfig,
                 device: torch.device, attention_backend: str = "auto",
                 linear_backend: str = "auto",
                 linear_rows: tuple[int, int] = (32, 512),
                 speculative: SpeculativeConfig | None = None,
                 tp: TPShard = SINGLE, lora: LoRAConfig | None = None) -> None:
        """``linear_rows``: the decode and prefill row counts ``auto`` times the linear
        backends at (max_num_seqs, the token budget). ``speculative``: the proposer runs
        here, after each step's sampling; its drafts are verified at the next step.
        ``tp``: this rank's shard under tensor parallelism (its heads, its KV pool of
        its KV heads); every rank runs the same steps and samples the same tokens."""
        self.cfg = model_cfg
        self.cache_cfg = cache_cfg
        self.device = device
        if device.type == "cpu":  # activations: reuse freed pages, never re-fault them
            keep_freed_host_memory()
        self.block_size = cache_cfg.block_size
        self.tp = tp
        self.heads = tp.heads(model_cfg.num_heads, model_cfg.num_kv_heads)
        self.model = load_model(model_cfg, device, tp)
        # Quantized projections in place first (model/quant/apply.py); the float ones left
        # are planned below.
        linear_backend = quantize_model(self.model, model_cfg.quantization, device,
                                        DTYPES[model_cfg.math_dtype], linear_rows,
                                        linear_backend, tp)
        attention_backend = attention_backend_for(model_cfg.kv_cache_dtype, attention_backend,
                                                  device, DTYPES[model_cfg.math_dtype])
        # Multi-LoRA (None: off): projections wrapped before they are packed.
        self.lora = make_lora_manager(lora, self.model, DTYPES[model_cfg.math_dtype], tp)
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # A hybrid model's layer groups (None: one block table for every layer).
        self.kv_groups: KVGroups | None = None
        self.num_window_blocks = 0
        self.sampler = Sampler(model_cfg.vocab_size, device, seed=model_cfg.seed)
        self.requests: dict[str, RequestState] = {}
        # Structured outputs: a grammar matcher per constrained request (runner/grammar.py).
        self.grammars = Grammars(model_cfg.tokenizer, model_cfg.vocab_size,
                                 model_cfg.eos_token_ids)
        self.sliding_window = self.model.sliding_window
        # Per-layer windows (Gemma 2/3): each one's metadata view (runner/window_views.py).
        self.layer_windows = sorted(set(self.model.layer_windows), key=lambda w: w or 0)
        # One plan of backends (model/autotune/plan.py: measured on this machine where
        # ``auto`` has a choice), then applied.
        self.backend_plan = plan_backends(self.model, ModelShape(
            self.heads.num_heads, self.heads.num_kv_heads, model_cfg.head_dim,
            DTYPES[model_cfg.math_dtype],
            # The checkpoint's dtype where the arithmetic's differs (bf16 computed in fp32:
            # the weights' values are bf16 ones, which native-bf16 reads as such).
            DTYPES[model_cfg.dtype] if model_cfg.dtype != model_cfg.math_dtype else None),
            device, attention_backend, linear_backend, linear_rows)
        self._apply_backends(self.backend_plan)
        self.speculative = speculative
        self.proposer: Proposer | None = None
        if speculative is not None:
            if speculative.method == "draft_model":
                from conveyor.runner.draft_model import DraftModelProposer

                self.proposer = DraftModelProposer(speculative, model_cfg, cache_cfg, device,
                                                   self.backend_plan.attention,
                                                   make_runner=ModelRunner)
            else:
                self.proposer = make_proposer(speculative)
        # Tests set this to read each sampling request's float32 logits of the last step.
        self.timings = PhaseTimings()
        self.record_logits = False
        self.last_logits: dict[str, torch.Tensor] = {}
        self.decode_graphs = None  # runner/decode_graphs.py's, set by the executor
        self.fused_decode: FusedDecode | None = None  # set once the KV cache is allocated

    def _apply_backends(self, plan: BackendPlan) -> None:
        """The plan's attention kernels and elementwise ops installed, the model's linears
        packed for its linear backends."""
        heads = (self.heads.num_heads, self.heads.num_kv_heads, self.cfg.head_dim)
        self.attention = select_attention_backend(plan.attention, self.device,
                                                  DTYPES[self.cfg.math_dtype], *heads)
        self.decode_kernel = self.attention.decode_kernel()
        self.prefill_kernel = self.attention.prefill_kernel() if plan.own_prefill else None
        layer_ops = self.attention.layer_ops()
        if layer_ops is not None:
            self.model.ops = layer_ops
        self.linear_backend = plan.linear
        # Shape key -> backend of every projection (empty unless measured per shape).
        self.linear_choice: dict[str, str] = plan.linear_by_shape
        self.few_rows = plan.few_rows  # calls of up to this many rows to conveyor's GEMM
        if plan.experts:  # (packed first: the per-shape choice leaves them out)
            pack_experts(self.model, plan.experts)
        if self.linear_choice:
            self.packed_linears = self.model.pack_linears_by_shape(
                self.linear_choice, self.few_rows, plan.gemm_lib) > 0
        else:
            self.packed_linears = self.linear_backend != "torch"
            if self.packed_linears:
                self.model.pack_linears(self.linear_backend)

    def allocate_kv_cache(self, num_blocks: int | None = None, max_num_seqs: int = 1,
                          groups: KVGroups | None = None) -> int:
        """Allocate the KV pool (sized from free memory unless given); returns its blocks.
        ``groups``: a hybrid model's layer groups (config/kv_window.py), each layer's K/V
        in its group's pool (``num_blocks`` is then the full group's)."""
        if groups is not None:
            if self.proposer is not None and hasattr(self.proposer, "allocate_kv_cache"):
                raise ValueError("a draft model's layers read whole block tables: no "
                                 "layer groups with one (kv_groups is off with it)")
            full = self._kv_pool(groups.num_full_blocks, groups.num_full_layers)
            windowed = self._kv_pool(groups.num_window_blocks, groups.num_window_layers)
            per_group = (iter(full), iter(windowed))
            self.kv_caches = [next(per_group[g]) for g in groups.layer_groups]
            self.num_blocks, self.num_window_blocks = (groups.num_full_blocks,
                                                       groups.num_window_blocks)
            self.kv_groups = groups
            self._build_fused_decode()
            return self.num_blocks
        if num_blocks is None:
            num_blocks = num_blocks_for(self.cache_cfg, self.cfg, self.device, max_num_seqs)
        self.kv_caches = self._kv_pool(num_blocks, self.cfg.num_layers)
        self.num_blocks = num_blocks
        if self.proposer is not None and hasattr(self.proposer, "allocate_kv_cache"):
            self.proposer.allocate_kv_cache(num_blocks)  # the draft's layers, same blocks
        self._build_fused_decode()
        return num_blocks

    def _build_fused_decode(self) -> None:
        """Small decode-only steps as one native call where the model allows it
        (runner/fused_decode.py); never with adapters."""
        self.fused_decode = None if self.lora is not None or self.device.type != "cpu" \
            else FusedDecode.build(self.model, self.kv_caches, self.decode_kernel)

    def _kv_pool(self, num_blocks: int, num_layers: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V tensors of ``num_blocks`` blocks for each of ``num_layers`` layers."""
        dtype = DTYPES[self.cfg.math_dtype]
        shape = (num_blocks * self.block_size, self.heads.num_kv_heads, self.cfg.head_dim)
        if self.cfg.kv_cache_dtype != "auto":  # one byte an element (model/quant/kv_cache.py)
            return quantized_kv_caches(num_layers, *shape, self.cfg.kv_cache_dtype, dtype,
                                       self.device)
        if self.device.type == "cpu":
            # One pool for every layer's K and V, on huge pages where the OS takes the
            # advice (runner/huge_pages.py: a decode step's scattered block reads)
            pool, advised = huge_pages.zeros((num_layers, 2, *shape), dtype)
            logger.info("KV pool: %.1f MiB, huge pages %s", pool.numel()
                        * pool.element_size() / 2**20, "advised" if advised else "not advised")
            return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]
        return [(torch.zeros(shape, dtype=dtype, device=self.device),
                 torch.zeros(shape, dtype=dtype, device=self.device))
                for _ in range(num_layers)]

    def profile_peak_memory(self, num_tokens: int, max_len: int) -> int:
        """CUDA: bytes torch holds at the peak of one full dummy step (weights plus a
        ``num_tokens`` step's activations), the KV pool it needs for it left out. Run
        before the real pool is sized (``num_blocks_for(..., peak_torch=)``)."""
        assert self.device.type == "cuda" and not self.kv_caches
        blocks = -(-max(1, num_tokens) // self.block_size) + 1
        self.allocate_kv_cache(blocks)
        kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                       for k, v in self.kv_caches)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.warmup(num_tokens, max_len)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - kv_bytes
        self.kv_caches, self.num_blocks = [], 0
        torch.cuda.empty_cache()
        return peak

    def warmup(self, num_tokens: int, max_len: int) -> int:
        """One step of ``num_tokens`` prompt tokens (prompts of up to ``max_len``) through
        the whole path, inputs to sampling, as vLLM's dummy run does at start: kernels get
        built and a full step's working memory gets faulted in (on this project's CPU the
        first full 2,048-token step of a fresh server paid ~94k page faults, +0.45 s), so
        no request pays for it. Call it before the engine schedules anything: it writes
        K/V into blocks that no request owns yet (their content is only read after an
        owner writes it), and its requests are dropped after the step. Greedy, so it draws
        nothing from the sampler's generator. Returns the tokens run (fewer if the KV
        pool is smaller)."""
        per = max(1, min(num_tokens, max_len))
        new_reqs, block, left = [], 0, num_tokens
        grouped = self.kv_groups is not None  # (the windowed pool's ids: the same ones)
        limit = min(self.num_blocks, self.num_window_blocks) if grouped else self.num_blocks
        while left > 0:
            length = min(per, left)
            blocks = -(-length // self.block_size)
            if block + blocks > limit:
                break
            ids = list(range(block, block + blocks))
            new_reqs.append(NewRequestData(
                f"__warmup__{len(new_reqs)}", [0] * length, [],
                SamplingParams(max_tokens=1, temperature=0.0), ids, 0,
                window_block_ids=list(ids) if grouped else None))
            block, left = block + blocks, left - length
        if not new_reqs:
            return 0
        scheduled = {r.req_id: len(r.prompt_token_ids) for r in new_reqs}
        self.execute(SchedulerOutput(new_reqs=new_reqs, num_scheduled_tokens=scheduled,
                                     total_num_scheduled_tokens=sum(scheduled.values()),
                                     sampling_req_ids=set(scheduled)))
        self.execute(SchedulerOutput(finished_req_ids=set(scheduled)))
        self.timings.reset()
        return sum(scheduled.values())

    # ---- state ---------------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        if self.lora is not None and (out.lora_load or out.lora_release):
            self.lora.order(out.lora_load, out.lora_release)  # (loads on their thread)
        for rid in out.finished_req_ids:
            dropped = self.requests.pop(rid, None)
            if self.lora is not None and dropped is not None:
                self.lora.request_dropped(rid, dropped.lora_id)
            self.grammars.drop(rid, finished=rid not in out.preempted_req_ids)
            if self.proposer is not None and rid not in out.preempted_req_ids:
                self.proposer.finish(rid)
        for new in out.new_reqs:
            self.requests[new.req_id] = RequestState(
                new.req_id, new.prompt_token_ids, list(new.output_token_ids),
                new.sampling_params, list(new.block_ids), new.num_computed_tokens,
                lora_id=new.lora_request.lora_int_id if new.lora_request else 0,
                window_block_ids=(list(new.window_block_ids)
                                  if new.window_block_ids is not None else None))
            if self.lora is not None:
                self.lora.request_added(new.req_id, new.lora_request)
            if new.sampling_params.structured_outputs is not None:
                self.grammars.add(new.req_id, new.sampling_params.structured_outputs,
                                  new.output_token_ids)
        for cached in out.cached_reqs:
            state = self.requests[cached.req_id]
            if cached.num_kept_blocks is not None:
                del state.block_ids[cached.num_kept_blocks:]  # lookahead given back
            state.block_ids.extend(cached.new_block_ids)
            if state.window_block_ids is not None:  # the windowed layers' table
                if cached.num_kept_blocks is not None:
                    del state.window_block_ids[cached.num_kept_blocks:]
                state.window_block_ids.extend(cached.new_window_block_ids or ())
            state.num_computed_tokens = cached.num_computed_tokens
        for key in out.grammar_evictions:  # (before the orders: a key may come back)
            self.grammars.evict(key)
        for key, params in out.grammar_compiles.items():
            self.grammars.order(key, params)

    # ---- execution -----------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = self._execute(out)
        if self.lora is not None:  # adapters loaded since: an idle step waits a little
            result.lora_loaded, result.lora_failed = self.lora.poll(
                LORA_IDLE_WAIT_S if out.is_empty else 0.0)
        # Grammars ordered earlier that compiled (or failed) meanwhile, as data for the
        # scheduler (core/grammar_gate.py); an empty step has nothing else to do, so it
        # waits a little for one instead of the engine spinning.
        self.grammars.report(result.grammars_ready, result.grammar_errors,
                             GRAMMAR_POLL_S if out.is_empty else 0.0)
        return result

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(out)
        if out.is_empty:
            return ModelRunnerOutput()
        spec = out.scheduled_spec_tokens
        # Decodes first, a request verifying drafts among them (one decode row per token).
        def prefill_last(rid: str) -> bool:
            return out.num_scheduled_tokens[rid] != 1 and rid not in spec

        order = sorted(out.num_scheduled_tokens, key=prefill_last if self.lora is None else
                       # (then by adapter: each adapter's rows contiguous)
                       lambda rid: (prefill_last(rid), self.requests[rid].lora_id))
        input_ids, positions, meta, logits_rows = self._prepare(order, out)
        constrained = [(i, rid) for i, (_, rid) in enumerate(logits_rows) if rid in self.grammars]
        if constrained:  # the grammars' bitmask fill runs beside the forward pass
            self.grammars.start_mask(constrained, spec)
        if self.lora is not None:
            self.lora.set_step(lora_rows(order, out.num_scheduled_tokens, self.requests))
        t1 = time.perf_counter()
        # Decode steps through CUDA graphs where they are on (runner/decode_graphs.py).
        graphs = self.decode_graphs
        hidden = graphs.run(input_ids, positions, meta) if graphs is not None else None
        fused = self.fused_decode
        if hidden is None and fused is not None and fused.applies(meta, input_ids.shape[0]):
            hidden = fused(self.model.embed_tokens(input_ids), positions, meta)
        elif hidden is None:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        t2 = time.perf_counter()
        self.timings.add("prepare", t1 - t0)
        self.timings.add("forward", t2 - t1)
        result = ModelRunnerOutput()
        if any(self.requests[rid].params.prompt_logprobs is not None for rid in order):
            # Only requests that asked: their prompt positions' top-k, slice by slice.
            spans = prompt_spans(order, out.num_scheduled_tokens, self.requests)
            if spans:
                result.prompt_logprobs = compute_prompt_logprobs(hidden, spans,
                                                                 self.model.compute_logits)
            now = time.perf_counter()
            self.timings.add("prompt_logprobs", now - t2)
            t2 = now
        if not logits_rows:
            return result
        idx = torch.tensor([row for row, _ in logits_rows], device=self.device)
        logits = self.model.compute_logits(hidden[idx])  # [N, vocab]
        t3 = time.perf_counter()
        self.timings.add("logits", t3 - t2)
        if constrained:
            # A request verifying drafts has a row per draft position: each masked by its
            # grammar after the drafts before it.
            logits = apply_mask(logits, self.grammars.take_mask())
            now = time.perf_counter()
            self.timings.add("grammar_mask", now - t3)
            t3 = now
        if spec:
            self._verify(logits, logits_rows, spec, result)
        else:
            states = [self.requests[rid] for _, rid in logits_rows]
            if self.record_logits:
                self.last_logits = {s.req_id: logits[i].float().cpu()
                                    for i, s in enumerate(states)}
            sampled = self.sampler(logits, [SamplingRow(s.params, s.prompt_token_ids,
                                                        s.output_token_ids) for s in states])
            for state, token, lp in zip(states, sampled.token_ids, sampled.logprobs):
                state.append([token])
                result.sampled_token_ids[state.req_id] = [token]
                if lp is not None:
                    result.logprobs[state.req_id] = [lp]
        if constrained:
            t_accept = time.perf_counter()
            for rid in dict.fromkeys(rid for _, rid in constrained):  # once per request
                self.grammars.accept(rid, result.sampled_token_ids[rid])
            self.timings.add("grammar_accept", time.perf_counter() - t_accept)
        t4 = time.perf_counter()
        self.timings.add("sample", t4 - t3)
        if out.num_spec_wanted and self.proposer is not None:
            self._propose(out, result)
            result.propose_s = time.perf_counter() - t4
            self.timings.add("propose", result.propose_s)
        return result

    def _verify(self, logits: torch.Tensor, logits_rows: list[tuple[int, str]],
                spec: dict[str, list[int]], result: ModelRunnerOutput) -> None:
        """Sample every sampling request, verifying the drafts of those that have some
        (its rows are consecutive in ``logits_rows``)."""
        groups, states = [], []
        for _, rid in logits_rows:
            if states and states[-1].req_id == rid:
                continue
            state = self.requests[rid]
            drafts = spec.get(rid, [])
            outs = state.output_token_ids
            rows = [SamplingRow(state.params, state.prompt_token_ids,
                                outs + drafts[:j] if j else outs)
                    for j in range(len(drafts) + 1)]
            q = None
            if state.draft_q is not None and drafts:
                proposed, probs = state.draft_q
                # The scheduler verifies a prefix of what was proposed, never other tokens:
                # drafts drawn from q and checked as one-hot would not be lossless.
                assert proposed[:len(drafts)] == drafts, (state.req_id, proposed, drafts)
                q = probs[:len(drafts)].to(logits.device)
            groups.append(VerifyGroup(rows, drafts, q))
            states.append(state)
        synthetic = (self.speculative.acceptance_rate
                     if self.speculative.method == "synthetic" else None)
        res = verify(self.sampler, logits, groups, synthetic)
        for state, tokens, lps in zip(states, res.token_ids, res.logprobs):
            state.append(tokens)
            result.sampled_token_ids[state.req_id] = tokens
            if lps is not None:
                result.logprobs[state.req_id] = lps

    def _propose(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        items = []
        for rid, k in out.num_spec_wanted.items():
            state = self.requests.get(rid)
            if state is not None and rid in result.sampled_token_ids:
                items.append(ProposeItem(rid, state.token_ids(), k, state.block_ids,
                                         state.params, len(state.prompt_token_ids)))
                state.draft_q = None
        if items:
            result.spec_token_ids = self.proposer.propose_batch(items)
            result.propose_steady = self.proposer.last_steady
            for rid, probs in getattr(self.proposer, "last_probs", {}).items():
                if rid in result.spec_token_ids:
                    self.requests[rid].draft_q = (result.spec_token_ids[rid], probs)

    def _prepare(self, order: list[str], out: SchedulerOutput
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[int, str]]]:
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[np.ndarray] = []
        slot_chunks: list[np.ndarray] = []
        logits_rows: list[tuple[int, str]] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        prefills: list[PrefillSegment] = []
        prefill_args: list[PrefillArgs] = []
        sampling = out.sampling_req_ids
        cursor = 0
        spec = out.scheduled_spec_tokens
        # A hybrid model's windowed layers: their own table's slots, decode tables, chunks.
        grouped = self.kv_groups is not None
        w_slot_chunks: list[np.ndarray] = []
        w_decode_tables: list[list[int]] = []
        w_prefill_args: list[PrefillArgs] = []
        for rid in order:
            state = self.requests[rid]
            n = out.num_scheduled_tokens[rid]
            start = state.num_computed_tokens
            ctx = start + n
            drafts = spec.get(rid) if spec else None
            if drafts:
                # Its last real token then its drafts, each a decode row that attends up
                # to itself (all of the step's K/V is written before attention reads).
                ids.extend(state.tokens(start, start + 1))
                ids.extend(drafts)
                pos = np.arange(start, ctx, dtype=np.int64)
                table = np.asarray(state.block_ids, dtype=np.int64)
                pos_chunks.append(pos)
                slot_chunks.append(table[pos // bs] * bs + pos % bs)
                if grouped:
                    w_table = np.asarray(state.window_block_ids, dtype=np.int64)
                    w_slot_chunks.append(w_table[pos // bs] * bs + pos % bs)
                    w_decode_tables.extend([state.window_block_ids] * n)
                for j in range(n):
                    decode_tables.append(state.block_ids)
                    decode_ctx.append(start + 1 + j)
                    logits_rows.append((cursor + j, rid))
                cursor += n
                continue
            ids.extend(state.tokens(start, ctx))
            pos = np.arange(start, ctx, dtype=np.int64)
            table = np.asarray(state.block_ids, dtype=np.int64)
            pos_chunks.append(pos)
            slot_chunks.append(table[pos // bs] * bs + pos % bs)
            if grouped:
                w_table = np.asarray(state.window_block_ids, dtype=np.int64)
                w_slot_chunks.append(w_table[pos // bs] * bs + pos % bs)
            if n == 1:
                decode_tables.append(state.block_ids)
                decode_ctx.append(ctx)
                if grouped:
                    w_decode_tables.append(state.window_block_ids)
            else:
                prefills.append(self._prefill_segment(cursor, n, start, table))
                prefill_args.append((cursor, n, start, table))
                if grouped:
                    w_prefill_args.append((cursor, n, start, w_table))
            if rid in sampling:  # the scheduler's decision: its chunk reaches the end
                logits_rows.append((cursor + n - 1, rid))
            cursor += n
        meta = AttentionMetadata(slot_mapping=self._to_device(np.concatenate(slot_chunks)),
                                 num_decodes=len(decode_ctx), prefills=prefills,
                                 decode_kernel=self.decode_kernel,
                                 prefill_kernel=self.prefill_kernel,
                                 sliding_window=self.sliding_window)
        if decode_ctx:
            self._decode_layout(meta, decode_tables, decode_ctx)
        if len(self.layer_windows) > 1:
            own = None
            if grouped:
                w_slots = (self._to_device(padded_slots(w_decode_tables, max(decode_ctx), bs))
                           if decode_ctx else None)
                own = {self.kv_groups.window: GroupTables(
                    self._to_device(np.concatenate(w_slot_chunks)), w_slots, w_prefill_args)}
            add_window_views(meta, self.sliding_window, self.layer_windows, prefill_args,
                             decode_ctx, self._prefill_segment, own)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = self._to_device(np.concatenate(pos_chunks))
        return input_ids, positions, meta, logits_rows

    def _decode_layout(self, meta: AttentionMetadata, tables: list[list[int]],
                       ctx_lens: list[int]) -> None:
        """Padded context slots [B, max_ctx], lengths and window starts (and a mask for SDPA).

        Padding slots point at slot 0 (block 0 is always allocated memory); they are
        never attended.
        """
        slots = padded_slots(tables, max(ctx_lens), self.block_size)
        lens = np.asarray(ctx_lens, dtype=np.int32)
        starts = window_starts(lens, self.sliding_window)
        meta.decode_slots = self._to_device(slots)
        meta.decode_lens = self._to_device(lens)
        meta.decode_starts = self._to_device(starts)
        if self.decode_kernel.needs_mask:
            meta.decode_mask = torch.from_numpy(attended(slots.shape[1], lens, starts)).to(
                self.device)

    def _prefill_segment(self, cursor: int, n: int, start: int, table: np.ndarray,
                         window: int | str | None = "model") -> PrefillSegment:
        """``window``: the layers' of this segment (``"model"``: the model-level one)."""
        ctx = start + n
        window = self.sliding_window if window == "model" else window
        if start == 0 and (window is None or n <= window):
            return PrefillSegment(cursor, n)  # plain causal over its own new K/V
        cols = np.arange(ctx, dtype=np.int64)
        q_pos = np.arange(start, ctx, dtype=np.int64)[:, None]
        mask = cols[None, :] <= q_pos
        if window is not None:
            mask &= cols[None, :] > q_pos - window
        slots = table[cols // self.block_size] * self.block_size + cols % self.block_size
        return PrefillSegment(cursor, n, self._to_device(slots),
                              torch.from_numpy(mask).to(self.device))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)
