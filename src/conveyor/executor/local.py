"""The in-process executor: conveyor's model runner on this process's device (torch)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from conveyor.config import CacheConfig, EngineArgs, EngineConfig, ModelConfig
from conveyor.config.kv_window import kv_groups
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.executor.device import resolve_device
from conveyor.kv_transfer.worker import KVConnectorWorker
from conveyor.model.dtypes import resolve_compute_dtype
from conveyor.runner.model_runner import ModelRunner, default_kv_cache_memory, num_blocks_for


class LocalExecutor:
    """Loads the model at construction; the KV pool is sized after the weights are in
    (``determine_num_kv_blocks``: from what memory is left) and allocated by ``initialize``,
    which also runs the start-up warmup step."""

    def structured_outputs_unsupported(self) -> str | None:
        """Why structured outputs cannot be served (None: the runner's grammars can)."""
        return self.runner.grammars.unsupported()

    def __init__(self, args: EngineArgs) -> None:
        self.device = resolve_device(args.device)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        model = args.resolve_model()
        self.model_config: ModelConfig = dataclasses.replace(
            model, compute_dtype=resolve_compute_dtype(args.compute_dtype, model.dtype,
                                                       self.device))
        self.runner = ModelRunner(self.model_config, args.cache_config(), self.device,
                                  args.attention_backend, args.linear_backend,
                                  linear_rows=(args.max_num_seqs,
                                               args.max_num_batched_tokens),
                                  speculative=args.speculative, lora=args.lora_config())
        self.runner.grammars.prepare()  # llguidance's tokenizer, after the measurements
        self.warmup = args.warmup
        self.enforce_eager = args.enforce_eager
        self._profile_tokens = args.max_num_batched_tokens  # a full step, for the KV sizing
        self.kv_config = args.kv_transfer_config()
        if self.kv_config.enabled and args.speculative is not None:
            # A transfer moves the target's layers only; a draft model's would be missing.
            raise ValueError("--kv-role prefill/decode does not support speculative decoding")
        self.kv_worker: KVConnectorWorker | None = None
        self._steps: ThreadPoolExecutor | None = None  # async scheduling's step thread

    def determine_num_kv_blocks(self, cache: CacheConfig, model: ModelConfig,
                                max_num_seqs: int) -> int:
        peak = None
        if self.device.type == "cuda" and cache.num_kv_blocks is None \
                and cache.kv_cache_memory is None:
            # vLLM's rule: what a full dummy step peaks at is not the KV pool's.
            peak = self.runner.profile_peak_memory(self._profile_tokens,
                                                   model.max_model_len - 1)
        draft = getattr(self.runner.proposer, "kv_bytes_per_token", 0)
        if not draft or cache.num_kv_blocks is not None:
            return num_blocks_for(cache, model, self.device, max_num_seqs, peak)
        # A block also holds the draft model's layers: the same memory holds fewer. But the
        # default cap (what max_num_seqs full sequences can use) still applies as is: where
        # memory is plentiful the draft must not cost the target its concurrency.
        memory = (cache.kv_cache_memory if cache.kv_cache_memory is not None else
                  default_kv_cache_memory(self.device, cache.gpu_memory_utilization, peak))
        blocks = max(1, memory // ((model.kv_bytes_per_token + draft) * cache.block_size))
        if cache.kv_cache_memory is None and self.device.type != "cuda":
            blocks = min(blocks, max_num_seqs * -(-model.max_model_len // cache.block_size))
        return int(blocks)

    def initialize(self, config: EngineConfig) -> None:
        self.runner.allocate_kv_cache(config.cache.num_kv_blocks,
                                    groups=kv_groups(config))
        if config.kv_transfer.enabled:  # the connector's worker half, over this cache
            self.kv_worker = KVConnectorWorker(config.kv_transfer, config.cache.block_size)
            self.kv_worker.register_kv_caches(self.runner.kv_caches)
        if self.warmup:  # before any request: its K/V lands in blocks nobody owns yet
            self.runner.warmup(config.scheduler.max_num_batched_tokens,
                               config.model.max_model_len - 1)
        if (self.device.type == "cuda" and not self.enforce_eager
                and self.runner.attention.name == "triton"):
            from conveyor.runner.decode_graphs import DecodeGraphs

            # Contexts past 8,192 tokens run eagerly: the slot buffers stay small.
            self.runner.decode_graphs = DecodeGraphs(
                self.runner, config.scheduler.max_num_seqs,
                min(config.model.max_model_len, 8192), capture=True)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        worker = self.kv_worker
        if worker is None:
            return self.runner.execute(scheduler_output)
        meta = scheduler_output.kv_connector_meta
        worker.start_load_kv(meta)  # cancels first, then writes loads that arrived
        out = self.runner.execute(scheduler_output)
        worker.wait_for_save(meta)  # this step's prompts are in the cache: servable
        out.kv_report = worker.get_finished()
        return out

    def submit_model(self, scheduler_output: SchedulerOutput) -> Future:
        """``execute_model`` on the step thread (async scheduling): steps run one at a
        time in submission order while the caller schedules the next."""
        if self._steps is None:
            self._steps = ThreadPoolExecutor(1, thread_name_prefix="conveyor-step")
        return self._steps.submit(self.execute_model, scheduler_output)

    def shutdown(self) -> None:
        if self._steps is not None:
            self._steps.shutdown(wait=True)
        if self.kv_worker is not None:
            self.kv_worker.shutdown()
