"""`conveyor sim` end to end: options, cost models, the bench report, capacity search."""

from __future__ import annotations

import json
import statistics

import pytest
from sim_helpers import make_workload

from conveyor.bench.report import load_summaries
from conveyor.bench.workload import load_workload
from conveyor.config import EngineArgs
from conveyor.costs.factory import make_cost_model
from conveyor.costs.profile import ProfileCostModel, fit_step_times
from conveyor.costs.shape import BatchShape
from conveyor.entrypoints.cli import main
from conveyor.sim import SLO, Simulator, find_max_rate, find_min_replicas, resolve_sim_model
from conveyor.sim.cli import parse_sim_args

WORKLOAD = ["--workload", "conversation", "--num-requests", "40", "--request-rate", "20",
            "--input-scale", "0.25", "--output-scale", "0.25", "--seed", "3"]
ROOFLINE = ["--model", "llama3-8b", "--max-num-seqs", "8", "--max-num-batched-tokens", "1024"]


def sim(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["sim", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def step_s(s: BatchShape) -> float:
    """A CPU-like step: 5 ms, 0.2 ms per row, 40 us per token, decode attention."""
    return (5e-3 + 2e-4 * (s.num_prefills + s.num_decodes)
            + 4e-5 * (s.num_prefill_tokens + s.num_decodes)
            + 1e-8 * s.num_decodes * s.max_decode_context)


def write_profile(path, model: str = "tiny") -> str:
    """A profile of ``model`` fitted to ``step_s`` (exactly representable by the fit)."""
    shapes = [BatchShape(num_decodes=b, decode_context=b * c, max_decode_context=c,
                         num_sampled=b) for b in (1, 2, 4, 8, 16) for c in (32, 128, 512)]
    shapes += [BatchShape(num_prefill_tokens=p, num_prefills=1,
                          prefill_attention=p * (p + 1) // 2, prefill_context=p,
                          num_sampled=1) for p in (16, 64, 256, 512)]
    config = resolve_sim_model(EngineArgs(model=model))
    profile = ProfileCostModel(fit_step_times(shapes, [step_s(s) for s in shapes]),
                               model=ProfileCostModel.model_fields(config, model),
                               device="cpu", kv_cache_memory=1 << 26)
    profile.save(str(path))
    return str(path)


def library_run(argv: list[str], cost: str, **kw):
    """The same simulation through the library: (requests, SimResult)."""
    args = parse_sim_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    model = resolve_sim_model(engine_args)
    requests = load_workload(args, model.vocab_size)
    cost_model = make_cost_model(cost, model, hardware=args.hardware, tp=args.tp)
    return requests, Simulator(engine_args, cost_model, model=model, **kw).run(requests)


def test_roofline_run_reports_what_the_simulator_computes(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = [*ROOFLINE, *WORKLOAD, "--hardware", "a100", "--replicas", "2",
            "--router", "round_robin"]
    rc, text, _ = sim([*argv, "--out", str(out)], capsys)
    assert rc == 0
    assert "events/s" in text and "roofline a100 x tp1" in text
    summary = load_summaries(str(out))["sim"]
    _, result = library_run(argv, "roofline", replicas=2, router="round_robin")
    ttfts = [m.ttft for m in result.finished.values()]
    tpots = [m.tpot for m in result.finished.values() if m.tpot is not None]
    assert summary.num_completed == len(result.finished) == 40
    assert summary.duration_s == pytest.approx(result.sim_time)
    assert summary.latency["ttft"].median == pytest.approx(1e3 * statistics.median(ttfts))
    assert summary.latency["tpot"].median == pytest.approx(1e3 * statistics.median(tpots))
    assert summary.extra["replicas"] == 2 and summary.extra["router"] == "round_robin"
    assert summary.extra["num_steps"] == result.num_steps
    records = (tmp_path / "sim.records.jsonl").read_text().splitlines()
    assert len(records) == 40 and json.loads(records[0])["run"] == "sim"
    # The options reach the simulator: an H100 is faster than an A100.
    out_h100 = tmp_path / "h100.json"
    assert sim([*argv[:-6], "--hardware", "h100", "--replicas", "2", "--router",
                "round_robin", "--out", str(out_h100)], capsys)[0] == 0
    h100 = load_summaries(str(out_h100))["sim"]
    assert h100.latency["tpot"].median < summary.latency["tpot"].median


def test_profile_cost_run_and_refused_requests(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json")
    out = tmp_path / "sim.json"
    # A 256-token limit refuses the longest prompts, as the engine would.
    argv = ["--model", "tiny", "--max-model-len", "256", "--cost", profile, *WORKLOAD]
    rc, text, _ = sim([*argv, "--out", str(out)], capsys)
    assert rc == 0
    assert "profile of tiny on cpu" in text
    requests, result = library_run(argv, profile)
    too_long = {r.request_id for r in requests if r.prompt_len > 256}
    assert too_long and set(result.errors) == too_long
    summary = load_summaries(str(out))["sim"]
    assert summary.num_failed == len(too_long)
    assert summary.duration_s == pytest.approx(result.sim_time)
    failed = [json.loads(line) for line in (tmp_path / "sim.records.jsonl").open()
              if json.loads(line)["error"]]
    assert {r["request_id"] for r in failed} == too_long
    assert all(r["error"].startswith("invalid: ") for r in failed)


def test_bad_options_are_clear_errors(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json")
    cases = [
        ([*ROOFLINE, *WORKLOAD, "--hardware", "tpu9"], "neither a preset"),
        ([*ROOFLINE, *WORKLOAD, "--replicas", "0"], "--replicas must be >= 1"),
        ([*ROOFLINE, *WORKLOAD, "--find-capacity"], "needs --slo-ttft"),
        ([*ROOFLINE, *WORKLOAD, "--async-scheduling"], "--async-scheduling is not simulated"),
        (["--model", "tiny", "--cost", profile, "--tp", "2", *WORKLOAD], "profile already"),
        (["--model", "smollm2-135m", "--cost", profile, *WORKLOAD], "hidden_size 576 vs 64"),
        (["--model", "tiny", "--cost", str(tmp_path / "none.json"), *WORKLOAD],
         "cannot read profile"),
    ]
    for argv, message in cases:
        rc, _, err = sim(argv, capsys)
        assert rc == 2 and message in err, (argv, err)


def test_bench_compare_reads_a_real_run_against_a_simulated_one(tmp_path, capsys):
    """The same workload through the real engine and the simulator, compared by bench."""
    workload = ["--workload", "conversation", "--num-requests", "12", "--request-rate", "inf",
                "--input-scale", "0.05", "--output-scale", "0.05", "--seed", "1"]
    engine = ["--model", "tiny", "--load-format", "dummy", "--dtype", "float32",
              "--num-threads", "1", "--max-num-seqs", "4", "--num-kv-blocks", "256"]
    real, simulated = tmp_path / "real.json", tmp_path / "sim.json"
    assert main(["bench", *engine, *workload, "--out", str(real)]) == 0
    profile = write_profile(tmp_path / "p.json")
    assert main(["sim", *engine, "--cost", profile, *workload, "--out", str(simulated)]) == 0
    capsys.readouterr()
    assert main(["bench", "compare", str(real), str(simulated)]) == 0
    text = capsys.readouterr().out
    assert "run engine vs sim" in text
    completed = next(line for line in text.splitlines() if line.startswith("completed"))
    assert completed.split()[-3:] == ["12", "12", "1.00x"]
    a, b = load_summaries(str(real))["engine"], load_summaries(str(simulated))["sim"]
    # The same requests: the same prompt and output tokens in total.
    assert (a.total_input_tokens, a.total_output_tokens) == \
        (b.total_input_tokens, b.total_output_tokens)
    assert a.extra["num_kv_blocks"] == b.extra["num_kv_blocks"] == 256


def capacity_case(tmp_path) -> tuple[list[str], str]:
    profile = write_profile(tmp_path / "p.json")
    return (["--model", "tiny", "--cost", profile, "--max-num-seqs", "4",
             "--max-num-batched-tokens", "256", "--workload", "conversation",
             "--num-requests", "60", "--request-rate", "100", "--input-scale", "0.1",
             "--output-scale", "0.1", "--slo-ttft", "150", "--slo-tpot", "30"], profile)


def test_find_capacity_replicas(tmp_path, capsys):
    argv, profile = capacity_case(tmp_path)
    out = tmp_path / "cap.json"
    rc, text, _ = sim([*argv, "--find-capacity", "--out", str(out)], capsys)
    assert rc == 0
    args = parse_sim_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    model = resolve_sim_model(engine_args)
    requests = load_workload(args, model.vocab_size)
    expected = find_min_replicas(requests, engine_args, make_cost_model(profile, model),
                                 SLO(ttft_s=0.15, tpot_s=0.03, attainment=0.9))
    assert expected.value is not None and expected.value > 1  # one replica is not enough
    assert f"answer: {expected.value:g} replicas; {expected.failing:g} repl" in text
    assert text.count("  probe ") == len(expected.probes)
    doc = json.loads(out.read_text())
    assert doc["capacity"]["value"] == expected.value
    # The report that follows is the workload on that many replicas, and it meets the SLOs.
    summary = load_summaries(str(out))["sim"]
    assert summary.extra["replicas"] == expected.value
    assert summary.slo_attainment >= 0.9


def test_find_capacity_rate(tmp_path, capsys):
    argv, profile = capacity_case(tmp_path)
    out = tmp_path / "cap.json"
    rc, text, _ = sim([*argv, "--find-capacity", "rate", "--replicas", "2", "--out", str(out)],
                      capsys)
    assert rc == 0
    args = parse_sim_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    model = resolve_sim_model(engine_args)
    requests = load_workload(args, model.vocab_size)
    expected = find_max_rate(requests, engine_args, make_cost_model(profile, model),
                             SLO(ttft_s=0.15, tpot_s=0.03, attainment=0.9), replicas=2)
    assert expected.value is not None and expected.failing is not None
    assert f"answer: {expected.value:.4g} req/s per replica" in text
    summary = load_summaries(str(out))["sim"]
    assert summary.slo_attainment >= 0.9
    # The reported run is the workload compressed to the answer's rate on 2 replicas.
    arrivals = [json.loads(line)["arrival_s"] for line in (tmp_path / "cap.records.jsonl").open()]
    assert (len(arrivals) - 1) / (max(arrivals) - min(arrivals)) == pytest.approx(
        2 * expected.value)


def test_find_capacity_out_of_reach_says_so(tmp_path, capsys):
    argv, _ = capacity_case(tmp_path)
    rc, text, _ = sim([*argv, "--find-capacity", "--slo-ttft", "1", "--max-replicas", "2"],
                      capsys)
    assert rc == 1
    assert "answer: none" in text


def test_the_pool_is_allocated_only_as_far_as_the_workload_can_fill_it():
    """A pool larger than the workload's whole footprint makes the same decisions as one
    just that big, so the simulator allocates only that (the logical size is reported)."""
    items = make_workload(40, seed=5, mean_gap_s=0.002)
    args = EngineArgs(model="tiny", num_kv_blocks=100_000, max_num_seqs=8,
                      max_num_batched_tokens=128)
    cost = make_cost_model("roofline", resolve_sim_model(args), hardware="cpu")
    sim_ = Simulator(args, cost)
    pool = sim_.pool_blocks(items)
    assert pool < 1000
    capped = sim_.run(items)
    full = Simulator(args, cost)
    full.pool_blocks = lambda items: 100_000  # type: ignore[method-assign]
    uncapped = full.run(items)
    assert capped.finished == uncapped.finished
    assert capped.replicas[0].num_kv_blocks == 100_000
    assert capped.replicas[0].peak_kv_blocks == uncapped.replicas[0].peak_kv_blocks
    # A pool the workload can fill is allocated whole.
    tight = Simulator(EngineArgs(model="tiny", num_kv_blocks=40, max_num_seqs=8,
                                 max_num_batched_tokens=128), cost)
    assert tight.pool_blocks(items) == 40
