"""Hardware specs for the roofline cost model: presets and JSON files of the same fields.

Units: TFLOP/s (1e12), GB/s (1e9 bytes/s), GiB (2**30 bytes) of memory per device.
Peaks are the vendor's dense (no sparsity) figures; the efficiency factors say how
much of them a serving engine's kernels reach, and are stated here so they can be
argued with:

- ``compute_efficiency`` 0.6: large bf16 GEMMs reach 60-75% of dense peak on
  A100/H100; a step mixes them with smaller, less efficient kernels.
- ``memory_efficiency`` 0.8: streaming weights and KV reaches about 80% of HBM peak.
- ``memory_utilization`` 0.9: the share of device memory the engine takes for weights
  plus KV (vLLM's default ``gpu_memory_utilization``); the rest is activations,
  CUDA context and fragmentation.
- ``step_overhead_ms``: per-step time outside the kernels (scheduling, input
  preparation, sampling, launches) for an engine with CUDA graphs; on the CPU preset
  it is the Python overhead of conveyor's own step on this class of machine.

The GPU presets describe an engine with paged attention kernels and CUDA graphs, not
conveyor's GPU path as it is (eager PyTorch, never measured on a GPU: see the README's
simulator section and ``scripts/gpu_check.sh``). They answer scheduling questions at GPU
scale; they are not conveyor's GPU speed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_tflops: float  # dense 16-bit (bf16/fp16) matmul peak, per device
    memory_bandwidth_gbps: float  # per device
    memory_gib: float  # per device
    step_overhead_ms: float
    peak_tflops_fp32: float | None = None  # for float32 models; None: peak_tflops
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    memory_utilization: float = 0.9
    # Tensor parallelism: per-direction device-to-device bandwidth and per all-reduce latency.
    interconnect_gbps: float = 0.0
    allreduce_latency_us: float = 0.0
    device_type: str = "cuda"  # cuda | cpu (the engine caps a CPU's default KV pool)

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "memory_bandwidth_gbps", "memory_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be > 0, "
                                 f"got {getattr(self, name)!r}")
        for name in ("compute_efficiency", "memory_efficiency", "memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name!r}: {name} must be in (0, 1], "
                                 f"got {getattr(self, name)!r}")
        if self.step_overhead_ms < 0 or self.allreduce_latency_us < 0 \
                or self.interconnect_gbps < 0:
            raise ValueError(f"hardware {self.name!r}: step_overhead_ms, interconnect_gbps "
                             "and allreduce_latency_us must be >= 0")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"hardware {self.name!r}: device_type must be 'cuda' or 'cpu', "
                             f"got {self.device_type!r}")

    def peak_flops(self, dtype: str) -> float:
        tflops = self.peak_tflops_fp32 if dtype == "float32" and self.peak_tflops_fp32 \
            else self.peak_tflops
        return tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * (1 << 30)


HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # A100-SXM4-80GB: 312 TFLOP/s bf16 dense, 19.5 fp32, 2,039 GB/s HBM2e, NVLink3 600 GB/s
    # bidirectional (300 per direction).
    "a100": HardwareSpec("a100", peak_tflops=312.0, peak_tflops_fp32=19.5,
                         memory_bandwidth_gbps=2039.0, memory_gib=80.0, step_overhead_ms=1.0,
                         interconnect_gbps=300.0, allreduce_latency_us=10.0),
    # H100-SXM5-80GB: 989 TFLOP/s bf16 dense, 67 fp32, 3,350 GB/s HBM3, NVLink4 900 GB/s
    # bidirectional (450 per direction).
    "h100": HardwareSpec("h100", peak_tflops=989.0, peak_tflops_fp32=67.0,
                         memory_bandwidth_gbps=3350.0, memory_gib=80.0, step_overhead_ms=1.0,
                         interconnect_gbps=450.0, allreduce_latency_us=8.0),
    # H200-SXM-141GB: the H100's compute with 4,800 GB/s HBM3e and 141 GB (~140 GiB).
    "h200": HardwareSpec("h200", peak_tflops=989.0, peak_tflops_fp32=67.0,
                         memory_bandwidth_gbps=4800.0, memory_gib=140.0, step_overhead_ms=1.0,
                         interconnect_gbps=450.0, allreduce_latency_us=8.0),
    # A 2-core AVX2 server CPU (Zen 3 at ~2.45 GHz: 2 cores x 32 fp32 FLOP/cycle), about
    # 20 GB/s of memory bandwidth for two cores. The engine takes at most a quarter of
    # memory for KV by default on CPU (min(4 GiB, 25% of free)): memory_utilization 0.25.
    "cpu": HardwareSpec("cpu", peak_tflops=0.157, memory_bandwidth_gbps=20.0, memory_gib=16.0,
                        step_overhead_ms=1.0, compute_efficiency=0.5, memory_efficiency=0.6,
                        memory_utilization=0.25, device_type="cpu"),
}


def load_hardware(spec: str) -> HardwareSpec:
    """A preset name (a100, h100, h200, cpu) or a JSON file with HardwareSpec's fields."""
    if spec in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[spec]
    if not os.path.isfile(spec):
        raise ValueError(f"hardware {spec!r} is neither a preset "
                         f"({', '.join(HARDWARE_PRESETS)}) nor a JSON file")
    with open(spec) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"hardware file {spec}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"hardware file {spec}: expected a JSON object of fields")
    fields = {f.name: f for f in dataclasses.fields(HardwareSpec)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"hardware file {spec}: unknown field(s) {', '.join(unknown)}; "
                         f"fields are {', '.join(fields)}")
    data.setdefault("name", os.path.splitext(os.path.basename(spec))[0])
    missing = [name for name, f in fields.items() if name not in data
               and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"hardware file {spec}: missing field(s) {', '.join(missing)}")
    return HardwareSpec(**data)
