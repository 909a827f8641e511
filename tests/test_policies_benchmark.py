"""benchmarks/scheduling/policies.py end to end on a small sample, in virtual time: it
writes its verdicts, records and figures, and each policy run is the `conveyor bench`
command it prints (same figures, as virtual time makes both deterministic)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.environ.get("CONVEYOR_TRACES", os.path.join(REPO, "..", "shared", "traces"))
AZURE = os.path.join(TRACES, "azure_conv_2023.csv")

pytestmark = pytest.mark.skipif(not os.path.isfile(AZURE),
                                reason=f"shared traces not found ({AZURE})")


def run(argv: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_small_sweep_writes_verdicts_and_replays_as_conveyor_bench(tmp_path):
    out = tmp_path / "policies"
    text = run(["-m", "benchmarks.scheduling.policies", "--traces", "azure",
                "--num-requests", "24", "--policies", "fcfs,sjf,priority,fair", "--clock", "model",
                "--step-cost", "0.005,3e-05,0.0003", "--out", str(out)])
    for line in ("sjf cuts mean TTFT vs fcfs", "priority: urgent p99 TTFT within 2x",
                 "fair: light tenants' mean TTFT within 2x"):
        assert any(line in v and v.split()[0] in ("PASS", "FAIL")
                   for v in text.splitlines()), line
    doc = json.loads((out / "policies.json").read_text())
    azure = doc["azure"]
    assert set(azure["runs"]) == {"fcfs", "sjf", "priority", "fair"}
    assert azure["step_cost"] == "0.005,3e-05,0.0003"
    assert (out / "share_azure.png").stat().st_size > 0
    records = [json.loads(line) for line in (out / "records_azure.jsonl").open()]
    assert {r["run"] for r in records} >= {"capacity", "fcfs", "urgent-alone",
                                            "lights-alone"}

    # The printed command of the sjf run, through `conveyor bench`, gives its figures.
    cmd = shlex.split(azure["commands"]["sjf"])
    assert cmd[:2] == ["conveyor", "bench"]
    bench_out = tmp_path / "sjf.json"
    run(["-m", "conveyor.entrypoints.cli", "bench", *cmd[2:], "--no-progress",
         "--out", str(bench_out)])
    again = json.loads(bench_out.read_text())["runs"][0]["summary"]
    assert again["latency"]["ttft"] == pytest.approx(azure["runs"]["sjf"]["latency"]["ttft"])
    assert again["duration_s"] == pytest.approx(azure["runs"]["sjf"]["duration_s"])
