"""Quantized weights: ``--quantization int8`` and the kernels behind it. Greedy ids equal
transformers' on the dequantised float32 model, whatever the batching and the kernel."""

from __future__ import annotations

import functools

import pytest
import torch
from quant_helpers import dequantised_copy, int8_dequant

from conveyor import LLM, SamplingParams

from helpers import hf_greedy, make_checkpoint, random_prompts


def _int4_dequant(weight: torch.Tensor) -> torch.Tensor:
    from conveyor.model.quant.apply import int4_group
    from conveyor.model.quant.weight import quantize_int4

    return quantize_int4(weight, int4_group(weight.shape[1])).dequantize()


@functools.cache
def _reference_path(arch: str, method: str = "int8") -> str:
    # (the LM head in int8 under int4 too)
    return dequantised_copy(make_checkpoint(arch),
                            int8_dequant if method == "int8" else _int4_dequant,
                            head=int8_dequant)


@functools.cache
def _reference(arch: str, prompt: tuple[int, ...], n: int, method: str = "int8"
               ) -> list[int]:
    return hf_greedy(_reference_path(arch, method), list(prompt), n)


def _check(llm, arch: str, seed: int = 0, n: int = 8, method: str = "int8") -> None:
    prompts = random_prompts(n, lo=2, hi=50, seed=seed)
    params = [SamplingParams(max_tokens=4 + i % 9, temperature=0.0) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, p, sp) in enumerate(zip(outs, prompts, params)):
        want = _reference(arch, tuple(p), sp.max_tokens, method)
        assert out.outputs[0].token_ids == want, f"request {i}"


CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=13),
    "preempt": dict(num_kv_blocks=8, block_size=8),
}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_int8_greedy_matches_dequantised_reference(arch, config):
    llm = LLM(make_checkpoint(arch), dtype="float32", quantization="int8", **CONFIGS[config])
    _check(llm, arch)
    kinds = {type(m).__name__ for m in llm.engine.runner.model.modules()}
    assert "Linear" not in kinds, kinds  # every projection quantized
    from conveyor.model.quant.linear import RowRangeLinear, _QuantLinear

    head = llm.engine.runner.model.packed_lm_head
    # (the start-up choice may split it by row range: quantized backends on both sides)
    sides = (head.few, head.many) if isinstance(head, RowRangeLinear) else (head,)
    assert all(isinstance(m, _QuantLinear) for m in sides), sides


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_int4_greedy_matches_dequantised_reference(arch):
    llm = LLM(make_checkpoint(arch), dtype="float32", quantization="int4",
              max_num_batched_tokens=13)
    _check(llm, arch, method="int4")


@pytest.mark.parametrize("backend", ["native-int", "dequant"])
def test_int8_each_kernel(backend, monkeypatch):
    from conveyor.kernels.cpu import quant

    if backend == "native-int" and not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    monkeypatch.setenv("CONVEYOR_QUANT_LINEAR", backend)
    llm = LLM(make_checkpoint("qwen3"), dtype="float32", quantization="int8",
              max_num_batched_tokens=17)
    _check(llm, "qwen3", seed=3, n=5)


@pytest.mark.parametrize("bits,group,zero", [(8, 0, False), (8, 32, True), (4, 32, True),
                                              (4, 64, False), (4, 0, True)])
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_native_kernel_equals_dequantised_matmul(bits, group, zero, rows):
    from conveyor.kernels.cpu import quant
    from conveyor.model.quant.linear import NativeQuantLinear
    from conveyor.model.quant.weight import QuantWeight, quantize_int4, quantize_int8

    if quant.load() is None:
        pytest.skip("native kernels unavailable")
    gen = torch.Generator().manual_seed(bits * 100 + group + rows)
    w = torch.randn(40, 128, generator=gen)
    if bits == 4:
        qw = quantize_int4(w, group or 128, symmetric=not zero)
    else:
        qw = quantize_int8(w)
        if group:
            g = 128 // group
            qw = QuantWeight(qw.q, qw.scale.expand(-1, g).contiguous(),
                             torch.randint(-3, 3, (40, g), generator=gen).float() if zero
                             else None, 8, group)
    bias = torch.randn(40, generator=gen)
    x = torch.randn(rows, 128, generator=gen)
    want = x.double() @ qw.dequantize().double().T + bias.double()
    got = NativeQuantLinear(qw, bias)(x)
    # float32 sums of exact products: within float32 rounding of the exact result
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


# (bits, K, group (0: the row), zero points): K and groups that are not multiples of the
# vector width; K over the buffered path's 256-column slices (partial sums carried)
ODD_SHAPES = [(8, 72, 0, False), (8, 72, 24, True), (8, 36, 12, True), (4, 96, 32, False),
              (4, 80, 16, True), (4, 72, 0, True), (4, 42, 14, True), (4, 10, 0, False),
              (8, 600, 0, False), (4, 520, 40, True), (8, 9, 3, True)]


@pytest.mark.parametrize("isa", ["avx2", "portable"])
@pytest.mark.parametrize("bits,k,group,zero", ODD_SHAPES)
def test_native_kernel_odd_shapes(isa, bits, k, group, zero):
    """Every row count 1..33 (the register path, the buffered tiles and their tails) and
    odd N against the float64 product of the dequantised weight; each row's result is the
    same bits whatever the rows beside it."""
    from conveyor.kernels.cpu import cpuinfo, quant
    from conveyor.model.quant.linear import NativeQuantLinear
    from conveyor.model.quant.weight import QuantWeight, quantize_int4, quantize_int8

    if isa == "avx2" and not {"avx2", "fma"} <= (cpuinfo.cpu_flags() or frozenset()):
        pytest.skip("this CPU does not run AVX2 + FMA")
    lib = quant.load(isa)
    if lib is None:
        pytest.skip("native kernels unavailable")
    assert bool(lib.qgemm_f32_simd()) == (isa == "avx2")
    gen = torch.Generator().manual_seed(bits * 1000 + k + group)
    n = 37
    w = torch.randn(n, k, generator=gen)
    if bits == 4:
        qw = quantize_int4(w, group or k, symmetric=not zero)
    else:
        qw = quantize_int8(w)
        if group:
            g = k // group
            qw = QuantWeight(qw.q, qw.scale.expand(-1, g).contiguous(),
                             torch.randint(-3, 3, (n, g), generator=gen).float() if zero
                             else None, 8, group)
    bias = torch.randn(n, generator=gen)
    mod = NativeQuantLinear(qw, bias, lib)
    x = torch.randn(33, k, generator=gen)
    want = x.double() @ qw.dequantize().double().T + bias.double()
    singles = torch.cat([mod(x[i:i + 1]) for i in range(33)])
    for rows in range(1, 34):
        got = mod(x[:rows])
        assert torch.allclose(got.double(), want[:rows], rtol=1e-5, atol=1e-4), rows
        assert torch.equal(got, singles[:rows]), rows


@pytest.mark.parametrize("bits,group,zero", [(8, 0, False), (4, 32, True), (4, 64, False)])
def test_native_fused_gate_up_equals_silu_of_the_halves(bits, group, zero):
    """A [gate; up] projection fused (silu(gate) * up from the kernel, its rows in panel
    pairs) against the unfused module's halves, at the register and buffered row counts;
    each row the same bits whatever the rows beside it."""
    from conveyor.kernels.cpu import quant
    from conveyor.model.quant.linear import NativeQuantLinear
    from conveyor.model.quant.weight import quantize_int4, quantize_int8

    if not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    gen = torch.Generator().manual_seed(bits + group)
    inter, k = 48, 128
    w = torch.randn(2 * inter, k, generator=gen)
    qw = quantize_int8(w) if bits == 8 else quantize_int4(w, group, symmetric=not zero)
    fused = NativeQuantLinear(qw, None, gate_up=True)
    assert fused.applies_silu_mul
    plain = NativeQuantLinear(qw, None)
    x = torch.randn(9, k, generator=gen)
    h = plain(x)
    want = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    singles = torch.cat([fused(x[i:i + 1]) for i in range(9)])
    for rows in (1, 2, 3, 4, 5, 9):
        got = fused(x[:rows])
        assert got.shape == (rows, inter)
        assert torch.allclose(got, want[:rows], rtol=1e-5, atol=1e-5), rows
        assert torch.equal(got, singles[:rows]), rows
    # I not a multiple of 16: not fused (the MLP applies silu itself)
    odd = NativeQuantLinear(quantize_int8(torch.randn(2 * 40, k, generator=gen)), None,
                            gate_up=True)
    assert not odd.applies_silu_mul


def test_quantization_errors(tmp_path):
    import json
    import shutil

    from conveyor.config.quantization import resolve_quantization

    with pytest.raises(ValueError, match="no quantization_config"):
        resolve_quantization({}, "gptq")
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        resolve_quantization({"quantization_config": {"quant_method": "bitsandbytes"}}, None)
    with pytest.raises(ValueError, match="quantized with gptq"):
        resolve_quantization({"quantization_config": {"quant_method": "gptq"}}, "int8")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_quantization({}, "fp4")
    src = make_checkpoint("qwen3")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bitsandbytes"):
        LLM(str(path), dtype="float32")
    with pytest.raises(ValueError, match="linear-backend"):
        LLM(src, dtype="float32", quantization="int8", linear_backend="onednn")


def _fake_times(shapes, backends, device, dtype, decode_rows, prefill_rows, counts=None):
    """Seconds by row count as a dequantise-then-GEMM backend and a register kernel
    scale: the kernel ahead at few rows, the dequantising one at many and at prefill."""
    out = {}
    for s in shapes:
        out[s.key] = {}
        for name in backends:
            if name.startswith("native-int"):
                t = (1.0 * decode_rows, 1.0 * max(prefill_rows, decode_rows))
            else:
                t = (10.0 + 0.5 * decode_rows, 10.0 + 0.1 * max(prefill_rows, decode_rows))
            out[s.key][name] = t
    return out


def test_row_ranges_send_one_row_calls_to_the_one_row_winner(monkeypatch, tmp_path):
    """Where the backend timed fastest at a server's rows (dequantise, then GEMM) loses at
    one row, calls of up to the measured row count go to the one-row winner and the larger
    ones to the other; greedy ids still equal the dequantised reference."""
    from conveyor.kernels.cpu import quant
    from conveyor.model.autotune import cache, fused_calls, linears
    from conveyor.model.autotune.row_ranges import SPLIT_ROWS
    from conveyor.model.quant.linear import DequantLinear, NativeQuantLinear, RowRangeLinear

    if not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    monkeypatch.setattr(cache, "_path", lambda kind: str(tmp_path / f"{kind}.json"))
    monkeypatch.setattr(linears, "measure", _fake_times)
    # (the dequantising backend is not one the fused step calls: no native timing)
    monkeypatch.setattr(fused_calls, "measure", lambda *a, **k: None)
    # (fake times: the kernel 1 a row, the other 10 + 0.5 a row: ahead up to 16 rows,
    # behind by more than TIE at 32; at 128 decode + 512 prefill rows the other wins)
    assert 16 in SPLIT_ROWS and 32 in SPLIT_ROWS
    llm = LLM(make_checkpoint("qwen3"), dtype="float32", quantization="int4",
              max_num_seqs=128, max_num_batched_tokens=512)
    model = llm.engine.runner.model
    split = [m for m in model.modules() if isinstance(m, RowRangeLinear)]
    assert len(split) == 4 * len(model.layers) + 1, "qkv, o, gate_up, down; and the head"
    calls = []
    for m in split:
        assert isinstance(m.few, NativeQuantLinear) and isinstance(m.many, DequantLinear)
        assert m.max_rows == 16
        m.few.register_forward_hook(lambda mod, i, o: calls.append(("few", i[0].shape[0])))
        m.many.register_forward_hook(lambda mod, i, o: calls.append(("many", i[0].shape[0])))
    for rows in (1, 16, 17):
        calls.clear()
        x = torch.randn(rows, split[0].in_features)
        got = split[0](x)
        assert calls == [("few" if rows <= 16 else "many", rows)]
        want = split[0].few(x) if rows > 16 else split[0].many(x)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    calls.clear()
    _check(llm, "qwen3", method="int4")
    assert {("few", 1), ("many", 1)} & set(calls) == {("few", 1)}  # decode rows: the kernel


# (N, K, group (0: the row), zero points): odd N, K not a multiple of 8 or 16, groups
# that are not multiples of the vector width, K past a few groups
A16_SHAPES = [(37, 128, 32, True), (40, 96, 0, False), (16, 10, 0, True), (33, 520, 40, True),
              (64, 1024, 128, False), (5, 36, 12, True)]


def _check_a16_bound(qw, bias: torch.Tensor, x: torch.Tensor, bits: int) -> None:
    """``NativeA16Linear`` over ``qw`` on each build: within (absmax(x) / 65534) * sum |w|
    of the float64 product with the dequantised weight plus float32 rounding, one row at a
    time and at every row count 1..9 (the same bits), the AVX2 and portable builds alike."""
    from conveyor.kernels.cpu import cpuinfo, quant
    from conveyor.model.quant.linear import NativeA16Linear

    w = qw.dequantize().double()
    want = x.double() @ w.T + bias.double()
    bound = (x.abs().amax(1, keepdim=True).double() / 65534) * w.abs().sum(1) \
        + 1e-5 * (x.double().abs() @ w.abs().T + 1)
    results = {}
    for isa in ("avx2", "portable"):
        if isa == "avx2" and not {"avx2", "fma"} <= (cpuinfo.cpu_flags() or frozenset()):
            continue
        lib = quant.load(isa)
        if lib is None:
            pytest.skip("native kernels unavailable")
        mod = NativeA16Linear(qw, bias, lib)
        assert mod.gemm.bits == bits
        singles = torch.cat([mod(x[i:i + 1]) for i in range(9)])
        assert ((singles.double() - want).abs() <= bound).all(), isa
        for rows in range(1, 10):
            assert torch.equal(mod(x[:rows]), singles[:rows]), (isa, rows)
        results[isa] = singles
    if len(results) == 2:
        assert torch.equal(results["avx2"], results["portable"])


@pytest.mark.parametrize("n,k,group,zero", A16_SHAPES)
def test_a16_kernel_within_its_stated_bound(n, k, group, zero):
    """``qgemm_a16`` (x rounded to int16 per row, integer sums): within (absmax(x) /
    65534) * sum |w| of the float64 product with the dequantised weight, plus float32
    rounding, at every row count 1..9 (the 4-row blocks and their tails); each row the same
    bits whatever the rows beside it; the AVX2 and portable bodies the same bits."""
    from conveyor.model.quant.weight import quantize_int4

    gen = torch.Generator().manual_seed(n * 1000 + k + group)
    qw = quantize_int4(torch.randn(n, k, generator=gen), group or k, symmetric=not zero)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(9, k, generator=gen) * torch.logspace(-2, 2, 9).view(-1, 1)
    _check_a16_bound(qw, bias, x, bits=4)


# (N, K, group (0: the row), zero points): K past one and several 512-column int32 blocks
# (and not a multiple of one), groups of any even size (past a block too), odd N
A16_I8_SHAPES = [(37, 128, 32, True), (40, 96, 0, False), (16, 10, 0, True),
                 (33, 1100, 0, False), (19, 2060, 1030, True), (64, 1024, 128, False),
                 (5, 36, 12, True), (17, 576, 0, False)]


def _int8_weight(n: int, k: int, group: int, zero: bool, gen, extreme: bool = False):
    from conveyor.model.quant.weight import QuantWeight

    group = group or k
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    if extreme:  # every product at its largest: the int32 block sums at their bound
        q.fill_(-128)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    z = torch.randn(n, k // group, generator=gen) * 3 if zero else None
    return QuantWeight(q, scale, z, 8, group)


@pytest.mark.parametrize("n,k,group,zero,extreme",
                         [(*s, False) for s in A16_I8_SHAPES] + [(21, 1536, 0, False, True)])
def test_a16_i8_kernel_within_its_stated_bound(n, k, group, zero, extreme):
    """``qgemm_a16_i8`` (int8 weight, x rounded to int16 per row, int32 sums in blocks of
    512 columns): within (absmax(x) / 65534) * sum |w| of the float64 product with the
    dequantised weight, plus float32 rounding, at every row count 1..9; each row the same
    bits whatever the rows beside it; the AVX2 and portable bodies the same bits. The
    extreme case (every weight -128, x one sign) puts each block's int32 sum at its
    bound: a longer block overflows and fails it."""

    gen = torch.Generator().manual_seed(n * 1000 + k + group)
    qw = _int8_weight(n, k, group, zero, gen, extreme)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(9, k, generator=gen) * torch.logspace(-2, 2, 9).view(-1, 1)
    if extreme:
        x = x.abs() + 1
        x[:, 0] = x.amax(1) * 1.0001  # (the other entries round to near 32767 too)
    _check_a16_bound(qw, bias, x, bits=8)


@pytest.mark.parametrize("bits", [4, 8])
def test_a16_scratch_any_rows_and_threads(bits):
    """x's int16 copy lives in the calling thread's scratch (kept up to a size, a block of
    its own past it): a call too large to keep, the kept scratch's calls after it, and
    calls from two threads at once give each row the bits of its one-row call."""
    import threading

    from conveyor.kernels.cpu import quant
    from conveyor.model.quant.linear import NativeA16Linear
    from conveyor.model.quant.weight import quantize_int4

    if quant.load() is None:
        pytest.skip("native kernels unavailable")
    gen = torch.Generator().manual_seed(bits)
    k = 2048
    qw = (quantize_int4(torch.randn(24, k, generator=gen), 128) if bits == 4
          else _int8_weight(24, k, 0, False, gen))
    mod = NativeA16Linear(qw, None)
    rows = 1100  # (x's int16 copy alone: 4.3 MiB, past what a thread keeps)
    x = torch.randn(rows, k, generator=gen)
    picks = [0, 1, 517, rows - 1]
    singles = torch.cat([mod(x[i:i + 1]) for i in picks])
    assert torch.equal(mod(x)[picks], singles)
    assert torch.equal(torch.cat([mod(x[i:i + 1]) for i in picks]), singles)
    xs = [torch.randn(3, k, generator=gen) for _ in range(2)]
    want = [mod(t) for t in xs]
    got: list[list[bool]] = [[], []]

    def run(i: int) -> None:
        for _ in range(200):
            got[i].append(torch.equal(mod(xs[i]), want[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[0]) and all(got[1]) and len(got[0]) == len(got[1]) == 200


def test_a16_i8_refuses_what_it_cannot_take():
    """Odd K or group: the module refuses it, the backend hands it to ``native-int``."""
    from conveyor.model.quant.backends import NativeInt8A16Backend, Scheme
    from conveyor.model.quant.linear import NativeA16Linear, NativeQuantLinear

    gen = torch.Generator().manual_seed(3)
    qw = _int8_weight(16, 9, 0, False, gen)
    with pytest.raises(ValueError, match="even K"):
        NativeA16Linear(qw, None)
    cpu = torch.device("cpu")
    assert NativeInt8A16Backend.supports(Scheme(8, 3), cpu, torch.float32)
    assert NativeInt8A16Backend.supports(Scheme(4), cpu, torch.float32)
    assert NativeInt8A16Backend.supports(Scheme(8, act_int8=True), cpu, torch.float32)
    if NativeInt8A16Backend.supports(Scheme(8), cpu, torch.float32) is None:
        back = NativeInt8A16Backend(cpu, torch.float32)
        assert type(back.make_linear(qw, None)) is NativeQuantLinear
        assert type(back.make_linear(_int8_weight(16, 10, 0, False, gen), None)) \
            is NativeA16Linear


@pytest.mark.parametrize("bits", [4, 8])
def test_a16_greedy_matches_dequantised_reference(bits: int, monkeypatch):
    """Every int4 / int8 projection on ``native-int4-a16`` / ``native-int8-a16`` (int8: the
    tied LM head too): greedy ids equal the dequantised float32 model's, under batching
    and chunked prefill."""
    from conveyor.kernels.cpu import quant
    from conveyor.model.quant import apply
    from conveyor.model.quant.linear import NativeA16Linear

    if not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    real = apply.candidates
    monkeypatch.setattr(apply, "candidates", lambda scheme, device, dtype: (
        [f"native-int{bits}-a16"] if scheme.bits == bits else real(scheme, device, dtype)))
    llm = LLM(make_checkpoint("qwen3"), dtype="float32", quantization=f"int{bits}",
              max_num_batched_tokens=13)
    mods = [m for m in llm.engine.runner.model.modules()
            if isinstance(m, NativeA16Linear) and m.bits == bits]
    layers = len(llm.engine.runner.model.layers)
    if bits == 8:  # the projections and the head
        assert len(mods) >= 4 * layers
        assert all(m.bits == 8 for m in llm.engine.runner.model.modules()
                   if isinstance(m, NativeA16Linear))
    else:  # (the int8 LM head may be an a16 module too: native-int8-a16 is a candidate)
        assert len(mods) == 4 * layers
    _check(llm, "qwen3", seed=5, method=f"int{bits}")
