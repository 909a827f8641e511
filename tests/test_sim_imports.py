"""The simulator never imports torch, transformers or the model runner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    from dataclasses import dataclass

    import conveyor.sim
    import conveyor.sim.profile_cli  # the `conveyor profile` parser, before it runs
    from conveyor.config import EngineArgs
    from conveyor.costs.factory import make_cost_model
    from conveyor.costs.profile import ProfileCostModel, fit_step_times
    from conveyor.costs.shape import BatchShape
    from conveyor.sim import SLO, Simulator, find_min_replicas, resolve_sim_model

    @dataclass
    class Item:
        request_id: str
        arrival_s: float
        prompt_token_ids: list
        output_len: int
        tenant: str = "default"
        priority: int = 0
        slo_ttft_ms: float = None
        slo_tpot_ms: float = None

    work = [Item(f"r{i}", i * 0.01, list(range(10 + i, 200 + i)), 8) for i in range(40)]
    args = EngineArgs(model="llama3-8b", max_num_seqs=16)
    model = resolve_sim_model(args)
    roofline = make_cost_model("roofline", model, hardware="h100", tp=2)
    assert len(Simulator(args, roofline, replicas=2, router="prefix_affinity")
               .run(work).finished) == 40
    shapes = [BatchShape(num_decodes=b, decode_context=b * c, max_decode_context=c,
                         num_sampled=b)
              for b in (1, 2, 4, 8) for c in (64, 256)]
    fit = fit_step_times(shapes, [0.001 + 1e-5 * s.decode_context + 1e-4 * s.num_decodes
                                  for s in shapes])
    profile = ProfileCostModel(fit, model=ProfileCostModel.model_fields(model, "llama3-8b"),
                               device="cuda", kv_cache_memory=1 << 34)
    profile.save(sys.argv[1])
    loaded = make_cost_model(sys.argv[1], model)
    assert len(Simulator(args, loaded).run(work).finished) == 40
    find_min_replicas(work, args, loaded, SLO(ttft_s=1.0), max_replicas=2)
    banned = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
              or m in ("conveyor.runner.model_runner", "conveyor.model.models.decoder",
                       "conveyor.executor.local", "conveyor.entrypoints.llm")]
    print("BANNED", banned)
""")


# `conveyor sim` through the command line (roofline with replicas and a capacity search,
# then a profile cost model, the bench report, records and plots).
CLI_SCRIPT = textwrap.dedent("""
    import sys

    from conveyor.config import EngineArgs
    from conveyor.entrypoints.cli import main
    from conveyor.costs.profile import ProfileCostModel, fit_step_times
    from conveyor.costs.shape import BatchShape
    from conveyor.sim import resolve_sim_model

    out = sys.argv[1]
    work = ["--workload", "conversation", "--num-requests", "30", "--request-rate", "20",
            "--input-scale", "0.2", "--output-scale", "0.2"]
    assert main(["sim", "--model", "llama3-8b", "--hardware", "h100", "--tp", "2",
                 "--replicas", "2", "--router", "prefix_affinity", *work,
                 "--out", out + "/roofline.json", "--plot", out]) == 0
    assert main(["sim", "--model", "llama3-8b", *work, "--find-capacity", "--slo-ttft",
                 "200", "--max-replicas", "4"]) in (0, 1)
    shapes = [BatchShape(num_decodes=b, decode_context=b * c, max_decode_context=c,
                         num_sampled=b)
              for b in (1, 2, 4, 8) for c in (64, 256)]
    fit = fit_step_times(shapes, [0.001 + 1e-5 * s.decode_context + 1e-4 * s.num_decodes
                                  for s in shapes])
    model = resolve_sim_model(EngineArgs(model="tiny"))
    ProfileCostModel(fit, model=ProfileCostModel.model_fields(model, "tiny"), device="cpu",
                     kv_cache_memory=1 << 26).save(out + "/p.json")
    assert main(["sim", "--model", "tiny", "--cost", out + "/p.json", *work,
                 "--out", out + "/profile.json"]) == 0
    banned = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")
              or m in ("conveyor.runner.model_runner", "conveyor.model.models.decoder",
                       "conveyor.executor.local", "conveyor.entrypoints.llm")]
    print("BANNED", banned)
""")


def test_simulating_imports_no_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "p.json")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "BANNED []" in proc.stdout, proc.stdout


def test_the_sim_command_imports_no_torch(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CLI_SCRIPT, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "BANNED []" in proc.stdout, proc.stdout[-2000:]
    assert (tmp_path / "roofline.records.jsonl").exists()
    assert (tmp_path / "latency_cdf.png").exists()


def test_the_check_can_fail(tmp_path):
    """Importing the local executor does pull torch in, so the check above is not vacuous."""
    script = "import sys, conveyor.executor.local; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.strip() == "True", proc.stderr
