"""``conveyor bench --backend openai`` against a live ``conveyor serve``: the client path the
peers table uses, end to end."""

from __future__ import annotations

import json
import os

from conveyor.entrypoints.cli import main

from helpers import make_checkpoint
from server_helpers import serve

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_bench_openai_backend_against_live_server(tmp_path, capsys) -> None:
    with serve(make_checkpoint("llama"), "--served-model-name", "live") as server:
        out = tmp_path / "live.json"
        argv = ["bench", "--backend", "openai", "--base-url", server.url,
                "--openai-model", "live", "--workload", os.path.join(DATA, "azure_sample.csv"),
                "--request-rate", "inf", "--input-scale", "0.05", "--output-scale", "0.1",
                "--vocab-size", "384", "--out", str(out), "--no-progress"]
        assert main(argv) == 0
        metrics = server.metrics()
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["num_completed"] == 5
    # Output lengths are forced with ignore_eos: the stream carried exactly these tokens.
    assert summary["total_output_tokens"] == 4 + 11 + 6 + 2 + 30
    assert metrics["conveyor:generation_tokens_total"] == 4 + 11 + 6 + 2 + 30
    assert summary["latency"]["ttft"]["median"] > 0
    assert "output tokens/s" in capsys.readouterr().out
