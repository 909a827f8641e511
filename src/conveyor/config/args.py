"""``EngineArgs``: the flat, user-facing bag of options (CLI flags, ``LLM(...)`` keywords).

``EngineArgs.resolve_model()`` reads the checkpoint's config.json; the engine then derives
what depends on the hardware (KV pool size, the max model length it caps) once, with
``dataclasses.replace`` (``resolve_engine_config``), never by patching a built config.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from conveyor.config.cache import CacheConfig
from conveyor.config.kv_transfer import KV_FALLBACKS, KV_ROLES, KVTransferConfig
from conveyor.config.lora import LoRAConfig, parse_lora_modules
from conveyor.config.model import DTYPES, ModelConfig, load_model_config
from conveyor.config.names import POLICY_NAMES, PREDICTOR_NAMES
from conveyor.config.policy import SJF_AGING_S, SJF_OVERTAKE_FACTOR, PolicyConfig
from conveyor.config.presets import PRESETS, resolve_model_path
from conveyor.config.quantization import KV_CACHE_DTYPES, QUANTIZATION_CHOICES
from conveyor.config.scheduler import TOKEN_BUDGET_MODES, SchedulerConfig
from conveyor.config.speculative import SpeculativeConfig

DISTRIBUTED_BACKENDS = ("mp", "ray")


@dataclass
class EngineArgs:
    model: str = "tiny"
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    compute_dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    device: str = "auto"
    num_threads: int | None = None
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    warmup: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # Hybrid models (Gemma 2/3): keep whole contexts in every layer (vLLM's flag name)
    # instead of a block table per layer group (config/kv_window.py: kv_groups).
    disable_hybrid_kv_cache_manager: bool = False
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    batching: str = "continuous"
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    max_queue_len: int | None = None
    max_queue_wait_s: float | None = None
    queue_wait_action: str = "admit"
    max_preemptions_per_request: int | None = None
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    long_prefill_min_share: float = 0.5
    sjf_aging_s: float = SJF_AGING_S
    sjf_overtake_factor: float = SJF_OVERTAKE_FACTOR
    sjf_predictor: str = "hint"
    sjf_prompt_weight: float = 1.0
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    fair_preempt_gap: float | None = 0.0
    fair_rejoin_credit: float = 2048.0
    tenant_weights: dict[str, float] | None = None
    default_slo_ttft_ms: float | None = None
    default_slo_tpot_ms: float | None = None
    lpm_window: int = 64
    token_budget: str = "auto"
    # The token budget controller's step-cost model: a `conveyor profile` JSON, roofline:HW
    # (a100, h100, h200, cpu or a hardware JSON) or linear:BASE,PER_TOKEN,PER_SEQ seconds.
    # The simulator uses its own cost model when this is None.
    slo_cost_model: str | None = None
    slo_cost_scale: float = 1.0
    slo_late_action: str = "serve"
    slo_tie_break: str = "slack"
    slo_tie_quantum_ms: float = 50.0
    # {"method": "ngram" | "suffix" | "draft_model" | "synthetic", ...} (config/speculative.py),
    # a JSON string of it, or None (off).
    speculative_config: dict[str, Any] | str | SpeculativeConfig | None = None
    # Prefill/decode disaggregation (KVTransferConfig).
    kv_role: str = "both"
    kv_host: str = "127.0.0.1"
    kv_port: int | None = None
    kv_lease_timeout: float = 30.0
    kv_transfer_timeout: float = 10.0
    kv_transfer_fallback: str = "recompute"
    # Tensor parallelism (executor/tp.py): ranks, where they run (mp: processes on this
    # machine; ray: Ray actors in a placement group), and how long a step may take before
    # a silent rank counts as dead.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    distributed_timeout_s: float = 60.0
    # Schedule step n+1 while step n runs (engine/async_steps.py); outputs are the same.
    async_scheduling: bool = False
    # No CUDA graphs for decode steps (runner/decode_graphs.py: CUDA, triton attention).
    enforce_eager: bool = False
    # Multi-LoRA (config/lora.py): adapters in one step, the largest rank, adapters kept
    # loaded (default max_loras), and adapters served from start (name=path, or a dict).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] | dict[str, str] | None = None
    # Quantized weights (config/quantization.py): None, int8 (at load), or the checkpoint's
    # format; the checkpoint's quantization_config is read whatever this says.
    quantization: str | None = None
    # The KV pool's elements: auto, fp8 (fp8_e4m3), fp8_e5m2 or int8 (per-token, per-head
    # scales; model/quant/kv_cache.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        # Parsed (and checked) at once: a bad config fails before any model loads.
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, "
                             f"got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.kv_role != "both" and (self.tensor_parallel_size > 1
                                       or self.distributed_executor_backend == "ray"):
            # The KV connector's worker half reads one process's cache; TP ranks hold
            # a slice of the heads each.
            raise ValueError(f"--kv-role {self.kv_role} does not support tensor "
                             "parallelism or the Ray executor yet")
        if self.kv_cache_dtype != "auto" and self.kv_role != "both":
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} does not support "
                             f"--kv-role {self.kv_role} (the transfer moves plain pools)")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, "
                             f"got {self.distributed_timeout_s}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return self.speculative_config  # parsed in __post_init__

    # ---- CLI -----------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default="tiny",
                       help="Hugging Face checkpoint folder, or a built-in shape name with "
                            "--load-format dummy (tiny, smollm2-135m, llama3-8b, qwen3-0.6b)")
        g.add_argument("--tokenizer", default=None)
        g.add_argument("--dtype", default="auto", choices=DTYPES)
        g.add_argument("--compute-dtype", default="auto", choices=DTYPES,
                       help="the arithmetic's dtype; auto = --dtype, except float32 on the "
                            "bf16-rounded weights for bfloat16 on a CPU without bf16 "
                            "instructions (AVX-512 BF16, AMX, Arm BF16), where emulated bf16 "
                            "arithmetic is slow")
        g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"))
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--device", default="auto", help="auto | cpu | cuda")
        g.add_argument("--num-threads", type=int, default=None,
                       help="torch intra-op threads (default: all cores)")
        g.add_argument("--attention-backend", default="auto",
                       choices=("auto", "native", "sdpa", "triton", "flashinfer"),
                       help="decode attention: native = C kernel reading the paged cache in "
                            "place (CPU, float32/bfloat16; built with the system C compiler on "
                            "first use); sdpa = gather + SDPA (any device); triton = one "
                            "Triton kernel for the whole step (CUDA; pip install "
                            "'conveyor[triton]'); auto = native where it applies")
        g.add_argument("--linear-backend", default="auto",
                       choices=("auto", "torch", "onednn", "native", "native-bf16"),
                       help="projections and LM head: native = conveyor's GEMM kernel with "
                            "weights packed once and SwiGLU fused (CPU with AVX2, float32; "
                            "built on first use); native-bf16 = the same kernel reading "
                            "bfloat16 weights (a bfloat16 checkpoint computed in float32: "
                            "same results, half the bytes); onednn = weights packed once for "
                            "oneDNN (CPU, float32, or bfloat16 where the CPU has it); torch = "
                            "F.linear; auto = the fastest of those that apply, measured per "
                            "weight shape at start")
        g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="run one full step (max-num-batched-tokens prompt tokens) at "
                            "start, so the first requests do not pay for building kernels "
                            "and faulting in a full step's memory (vLLM's dummy run)")
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--num-kv-blocks", type=int, default=None)
        g.add_argument("--kv-cache-memory", type=_parse_bytes, default=None,
                       help="KV pool size in bytes (suffixes K, M, G accepted)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True)
        g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="hybrid models (Gemma 2/3: windowed and global layers): keep "
                            "whole contexts in every layer instead of freeing the windowed "
                            "layers' blocks behind the window")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="CUDA: the share of the device's memory for the engine: weights, "
                            "a full step's activations (profiled at start) and the KV pool, "
                            "which gets the rest")
        g.add_argument("--max-num-seqs", type=int, default=32)
        g.add_argument("--max-num-batched-tokens", type=int, default=512)
        g.add_argument("--batching", default="continuous", choices=("continuous", "static"))
        g.add_argument("--scheduling-policy", default="fcfs",
                       help=f"waiting order and preemption: {', '.join(sorted(POLICY_NAMES))} "
                            "(docs/scheduling.md)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=True)
        g.add_argument("--max-queue-len", type=int, default=None,
                       help="refuse new requests (429) while this many are waiting")
        g.add_argument("--max-queue-wait-s", type=float, default=None,
                       help="a request waiting this long goes next whatever the policy")
        g.add_argument("--queue-wait-action", default="admit", choices=("admit", "reject"),
                       help="what --max-queue-wait-s does to a request that never ran")
        g.add_argument("--max-preemptions-per-request", type=int, default=None,
                       help="a request preempted this often is no longer a victim")
        g.add_argument("--max-num-partial-prefills", type=int, default=1,
                       help="most prefills that advance in one step without ending (running "
                            "ones and new arrivals share the step's prefill tokens); above "
                            "--max-long-partial-prefills, waiting long prompts may also be "
                            "admitted paused so that short ones queued behind them pass")
        g.add_argument("--max-long-partial-prefills", type=int, default=1,
                       help="of those, most long ones (the others pause, keeping their "
                            "blocks), so short prompts pass beside long prefills")
        g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="a prefill with more prompt tokens left than this is long "
                            "(0: --max-num-batched-tokens)")
        g.add_argument("--long-prefill-min-share", type=float, default=0.5,
                       help="share of each step's prefill tokens the first long prefill "
                            "keeps whatever waits (its TTFT in steps stays within 1/share "
                            "of its steps alone); 1: it goes before every other prefill")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       default=False,
                       help="schedule step n+1 while step n runs (its sampled tokens are "
                            "placeholders until they arrive); the same tokens as without. "
                            "Steps with speculative decoding or a KV connector stay "
                            "synchronous")
        g.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: decode steps run eagerly (graphs are captured "
                            "for decode batches at padded sizes on CUDA with "
                            "--attention-backend triton)")
        g.add_argument("--sjf-aging-s", type=float, default=SJF_AGING_S,
                       help="sjf: never let a request that arrived this much later go "
                            f"first (default {SJF_AGING_S:g}: no aging)")
        g.add_argument("--sjf-overtake-factor", type=float, default=SJF_OVERTAKE_FACTOR,
                       metavar="K",
                       help="sjf: a waiting request of work w goes first once K * w of "
                            "work was admitted after it joined the queue (0: no bound; "
                            f"default {SJF_OVERTAKE_FACTOR:g})")
        g.add_argument("--sjf-predictor", default="hint", choices=sorted(PREDICTOR_NAMES),
                       help="sjf: expected output length (hint: expected_output_tokens, "
                            "else max_tokens)")
        g.add_argument("--sjf-prompt-weight", type=float, default=1.0,
                       help="sjf: cost of a prompt token still to prefill relative to an "
                            "output token (prefill is batched: below 1 fits engine time)")
        g.add_argument("--fair-input-weight", type=float, default=1.0)
        g.add_argument("--fair-output-weight", type=float, default=2.0)
        g.add_argument("--fair-preempt-gap", type=_parse_gap, default=0.0, metavar="TOKENS",
                       help="fair: preempt a running request to admit a waiting one whose "
                            "tenant has been served more than TOKENS (weighted) less; "
                            "'off' never preempts to admit")
        g.add_argument("--fair-rejoin-credit", type=float, default=2048.0, metavar="TOKENS",
                       help="fair: a tenant joining the backlog starts up to TOKENS "
                            "(weighted) below the least served backlogged one (0: VTC)")
        g.add_argument("--tenant-weights", type=_parse_weights, default=None,
                       help="per-tenant weights for the fair policy, e.g. a=2,b=1")
        g.add_argument("--default-slo-ttft-ms", type=float, default=None,
                       help="TTFT target of requests that carry none (edf, slo, metrics)")
        g.add_argument("--default-slo-tpot-ms", type=float, default=None,
                       help="TPOT target of requests that carry none (edf, slo, metrics)")
        g.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4}\'; methods ngram, suffix, '
                            'draft_model (with "model"), synthetic (with "acceptance_rate", '
                            'benchmarks only); k adapts to load unless "adaptive": false')
        g.add_argument("--lpm-window", type=int, default=64,
                       help="lpm: oldest waiting requests compared, and the most overtakes "
                            "any request suffers")
        g.add_argument("--token-budget", default="auto", choices=TOKEN_BUDGET_MODES,
                       help="per-step token budget: fixed (--max-num-batched-tokens), slo "
                            "(chosen each step so that running decodes meet their TPOT "
                            "targets, --max-num-batched-tokens the ceiling; needs a step-cost "
                            "model), auto (slo for --scheduling-policy slo)")
        g.add_argument("--slo-cost-model", default=None, metavar="SPEC",
                       help="the budget controller's step-cost model: a `conveyor profile` "
                            "JSON, roofline:HW (a100, h100, h200, cpu, or a hardware JSON), or "
                            "linear:BASE,PER_TOKEN,PER_SEQ (seconds); conveyor sim defaults "
                            "to its own cost model")
        g.add_argument("--slo-cost-scale", type=float, default=1.0,
                       help="multiply the step-cost model's predictions by this (a margin)")
        g.add_argument("--slo-late-action", default="serve", choices=("serve", "reject"),
                       help="slo: a waiting request that can no longer meet its TTFT target "
                            "is served after the others (serve) or rejected at once "
                            "(reject: HTTP 429, code slo_unattainable)")
        g.add_argument("--slo-tie-break", default="slack", choices=("slack", "fair"),
                       help="slo: order of on-time requests within one --slo-tie-quantum-ms "
                            "of latest start: by it (slack) or least-served tenant first "
                            "(fair, VTC counters)")
        g.add_argument("--slo-tie-quantum-ms", type=float, default=50.0)
        k = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
        k.add_argument("--kv-role", default="both", choices=KV_ROLES,
                       help="both: compute prompts and decode here (no KV transfer); "
                            "prefill: serve requests' prompt K/V to decode engines on "
                            "--kv-port; decode: pull a prefill engine's K/V for requests "
                            "that carry its handle (conveyor router --prefill/--decode)")
        k.add_argument("--kv-host", default="127.0.0.1",
                       help="address the prefill role binds and advertises in handles")
        k.add_argument("--kv-port", type=int, default=None,
                       help="TCP port of the prefill role's KV server")
        k.add_argument("--kv-lease-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="prefill: release a finished request's blocks this long after "
                            "it finished if no decode engine confirmed its pull")
        k.add_argument("--kv-transfer-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="decode: a pull that has not landed in this long fails")
        k.add_argument("--kv-transfer-fallback", default="recompute", choices=KV_FALLBACKS,
                       help="decode: when a pull fails, compute the prompt here (recompute) "
                            "or fail that request with an error (fail)")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="shard the model over this many ranks (Megatron-style; "
                            "gloo on CPU, NCCL on CUDA); the scheduler runs once")
        g.add_argument("--distributed-executor-backend", default="mp",
                       choices=DISTRIBUTED_BACKENDS,
                       help="where the ranks run: mp = processes on this machine; ray = "
                            "Ray actors in a placement group, one bundle per rank (for "
                            "more than one machine; pip install conveyor[ray])")
        g.add_argument("--distributed-timeout", dest="distributed_timeout_s", type=float,
                       default=60.0, metavar="SECONDS",
                       help="a rank that does not answer a step within this long counts "
                            "as dead: open requests fail and /health turns 503")
        lo = parser.add_argument_group("multi-LoRA (docs/lora.md)")
        lo.add_argument("--enable-lora", action="store_true",
                        help="serve PEFT LoRA adapters of the base model (the request's "
                             "model names one)")
        lo.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="adapters served from start")
        lo.add_argument("--max-loras", type=int, default=1,
                        help="most adapters in one step (requests of others wait)")
        lo.add_argument("--max-lora-rank", type=int, default=16,
                        help="largest adapter rank accepted")
        lo.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept loaded (default --max-loras)")
        g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                       help="int8: weight-only int8 per output channel, quantized at load "
                            "(LM head included); a checkpoint's quantization_config "
                            "(compressed-tensors, gptq, awq) is read without it")
        g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="the KV pool's elements: auto (the compute dtype), or one "
                            "byte (fp8 = fp8_e4m3, fp8_e5m2, int8) with a scale per token "
                            "and KV head; runs on the sdpa attention backend")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    # ---- resolution ----------------------------------------------------------------------
    def scheduler_config(self) -> SchedulerConfig:
        ms = 1e-3
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            batching=self.batching,
            scheduling_policy=self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_queue_len=self.max_queue_len,
            max_queue_wait_s=self.max_queue_wait_s,
            queue_wait_action=self.queue_wait_action,
            max_preemptions_per_request=self.max_preemptions_per_request,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            long_prefill_min_share=self.long_prefill_min_share,
            speculative=self.speculative,
            async_scheduling=self.async_scheduling,
            token_budget=self.token_budget,
            slo_cost_scale=self.slo_cost_scale,
            max_loras=self.max_loras if self.enable_lora else 0,
            max_cpu_loras=(self.max_cpu_loras or 0) if self.enable_lora else 0,
            policy=PolicyConfig(
                sjf_aging_s=self.sjf_aging_s,
                sjf_overtake_factor=self.sjf_overtake_factor,
                sjf_predictor=self.sjf_predictor,
                sjf_prompt_weight=self.sjf_prompt_weight,
                fair_input_weight=self.fair_input_weight,
                fair_output_weight=self.fair_output_weight,
                fair_preempt_gap=self.fair_preempt_gap,
                fair_rejoin_credit=self.fair_rejoin_credit,
                tenant_weights=tuple(sorted((self.tenant_weights or {}).items())),
                default_slo_ttft_s=(self.default_slo_ttft_ms * ms
                                    if self.default_slo_ttft_ms is not None else None),
                default_slo_tpot_s=(self.default_slo_tpot_ms * ms
                                    if self.default_slo_tpot_ms is not None else None),
                lpm_window=self.lpm_window,
                slo_late_action=self.slo_late_action,
                slo_tie_break=self.slo_tie_break,
                slo_tie_quantum_s=self.slo_tie_quantum_ms * ms,
            ),
        )

    def lora_config(self) -> LoRAConfig | None:
        """Multi-LoRA's options, None unless ``enable_lora``."""
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras,
                          parse_lora_modules(self.lora_modules))

    def kv_transfer_config(self) -> KVTransferConfig:
        return KVTransferConfig(role=self.kv_role, host=self.kv_host, port=self.kv_port,
                                lease_timeout_s=self.kv_lease_timeout,
                                transfer_timeout_s=self.kv_transfer_timeout,
                                fallback=self.kv_transfer_fallback)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                           kv_cache_memory=self.kv_cache_memory,
                           enable_prefix_caching=self.enable_prefix_caching,
                           gpu_memory_utilization=self.gpu_memory_utilization,
                           hybrid_kv_groups=not self.disable_hybrid_kv_cache_manager)

    def resolve_model(self) -> ModelConfig:
        path = resolve_model_path(self.model, self.load_format)
        is_preset = self.model in PRESETS and not os.path.isdir(self.model)
        return load_model_config(path, dtype=self.dtype,
                                 load_format="dummy" if is_preset else self.load_format,
                                 seed=self.seed, max_model_len=self.max_model_len,
                                 tokenizer=self.tokenizer,
                                 served_model_name=self.served_model_name or self.model,
                                 quantization=self.quantization,
                                 kv_cache_dtype=self.kv_cache_dtype)



def _parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMGT" else text
    return int(float(number) * mult)


def _parse_weights(text: str) -> dict[str, float]:
    out = {}
    for part in filter(None, text.split(",")):
        name, _, weight = part.partition("=")
        try:
            out[name.strip()] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected tenant=weight pairs separated by commas, got {part!r}") from None
    return out


def _parse_gap(text: str) -> float | None:
    """``--fair-preempt-gap``: a token count, or ``off`` (never preempt to admit)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of tokens or 'off', got {text!r}") from None
