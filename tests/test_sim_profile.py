"""The profile cost model: the fit, its file, and `conveyor profile` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_helpers import make_workload, tiny_args

from conveyor.config import EngineArgs
from conveyor.costs.factory import make_cost_model
from conveyor.costs.profile import FEATURES, ProfileCostModel, StepFit, fit_step_times, nnls
from conveyor.costs.shape import BatchShape
from conveyor.sim import Simulator
from conveyor.sim.model import resolve_sim_model

TRUE = dict(step=2e-3, matrix=1e-3, rows=5e-5, tokens=1e-5, tokens_over_knee=3e-5,
            prefill_attention=2e-8, decode_attention=4e-8, sampled=1e-4,
            tokens_under_small_knee=4e-5, prefill_rows=3e-4, prefill_prior=2e-6)
KNEE = 128
SMALL_KNEE = 8


def true_time(s: BatchShape) -> float:
    t = s.num_prefill_tokens + s.num_decodes
    return (TRUE["step"] + TRUE["matrix"] * (t >= 2)
            + TRUE["rows"] * (s.num_prefills + s.num_decodes) + TRUE["tokens"] * t
            + TRUE["tokens_over_knee"] * max(0, t - KNEE)
            + TRUE["prefill_attention"] * s.prefill_attention
            + TRUE["decode_attention"] * s.num_decodes * s.max_decode_context
            + TRUE["sampled"] * s.num_sampled
            + TRUE["tokens_under_small_knee"] * min(t, SMALL_KNEE)
            + TRUE["prefill_rows"] * s.num_prefills
            + TRUE["prefill_prior"] * (s.prefill_context - s.num_prefill_tokens))


def prefill(p: int, prior: int = 0, rows: int = 1) -> BatchShape:
    """``rows`` chunks of ``p`` tokens, each after ``prior`` computed ones."""
    return BatchShape(num_prefill_tokens=rows * p, num_prefills=rows,
                      prefill_attention=rows * (p * prior + p * (p + 1) // 2),
                      prefill_context=rows * (prior + p), num_sampled=rows)


def grid_shapes() -> list[BatchShape]:
    shapes = [BatchShape(num_decodes=b, decode_context=b * c, max_decode_context=c,
                         num_sampled=b)
              for b in (1, 2, 4, 8, 16, 32) for c in (32, 128, 512)]
    shapes += [BatchShape(num_prefill_tokens=p, num_prefills=1,
                          prefill_attention=p * (p + 1) // 2, prefill_context=p, num_sampled=1)
               for p in (16, 64, 128, 256, 512)]
    shapes += [BatchShape(num_prefill_tokens=p, num_prefills=1,
                          prefill_attention=p * 64 + p * (p + 1) // 2, prefill_context=p + 64,
                          num_decodes=b, decode_context=b * 100, max_decode_context=100,
                          num_sampled=b)
               for p in (64, 256) for b in (4, 16)]
    # Continued chunks (after a cached prefix) and several prompts in one step.
    shapes += [prefill(p, prior) for p in (4, 16, 64) for prior in (32, 128, 512)]
    shapes += [prefill(p, rows=r) for p in (4, 32) for r in (2, 4)]
    return shapes


def test_the_fit_recovers_a_known_piecewise_model():
    shapes = grid_shapes()
    fit = fit_step_times(shapes, [true_time(s) for s in shapes], "padded")
    assert (fit.knee, fit.small_knee) == (KNEE, SMALL_KNEE)
    for name in FEATURES:
        assert fit.coefficients[name] == pytest.approx(TRUE[name], rel=1e-6, abs=1e-12)
    assert fit.median_rel_error < 1e-9


def test_a_step_costs_each_term_by_hand():
    coef = dict(step=0.01, matrix=0.002, rows=1e-4, tokens=1e-3, tokens_over_knee=2e-3,
                prefill_attention=1e-7, decode_attention=1e-6, sampled=5e-4,
                tokens_under_small_knee=4e-3, prefill_rows=3e-3, prefill_prior=1e-5)
    fit = StepFit(knee=20, coefficients=coef, median_rel_error=0, p90_rel_error=0,
                  num_samples=0, num_dropped=0, decode_layout="paged", small_knee=8)
    model = ProfileCostModel(fit, model={}, device="cpu", kv_cache_memory=1)
    # 16 tokens continuing a prompt after 100 computed ones, beside 3 decodes (ctx 150).
    shape = BatchShape(num_prefill_tokens=16, num_prefills=1,
                       prefill_attention=16 * 100 + 16 * 17 // 2, prefill_context=116,
                       num_decodes=3, decode_context=150, max_decode_context=60,
                       num_sampled=4)
    # T = 19: under the knee (20), over the small knee (8).
    expected = (0.01 + 0.002 + 1e-4 * 4 + 1e-3 * 19 + 0.0 + 1e-7 * 1736 + 1e-6 * 150
                + 5e-4 * 4 + 4e-3 * 8 + 3e-3 * 1 + 1e-5 * 100)
    assert model.step_time(shape) == pytest.approx(expected, rel=1e-12)
    # One decode row: no step up, its one token under the small knee.
    one = BatchShape(num_decodes=1, decode_context=10, max_decode_context=10, num_sampled=1)
    assert model.step_time(one) == pytest.approx(
        0.01 + 1e-4 + 1e-3 + 1e-6 * 10 + 5e-4 + 4e-3, rel=1e-12)


def test_a_format_1_profile_still_loads_and_predicts_what_it_did(tmp_path):
    """Profiles from before the prefill terms: those terms at zero, the old formula."""
    old = dict(zip(FEATURES[:8], (0.017, 0.0013, 0.0, 0.0, 4.7e-4, 4e-7, 1.5e-6, 4.8e-4)))
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({
        "format": "conveyor-profile/1", "model": {"name": "m"}, "device": "cpu",
        "kv_cache_memory": 1 << 20, "features": list(FEATURES[:8]),
        "fit": {"knee": 2.0, "coefficients": old, "median_rel_error": 0.04,
                "p90_rel_error": 0.11, "num_samples": 10, "num_dropped": 0,
                "decode_layout": "paged"}, "meta": {}, "samples": []}))
    model = ProfileCostModel.load(str(path))
    shape = BatchShape(num_prefill_tokens=16, num_prefills=1, prefill_attention=12168,
                       prefill_context=768, num_decodes=1, decode_context=81,
                       max_decode_context=81, num_sampled=2)
    assert model.step_time(shape) == pytest.approx(
        0.017 + 0.0013 + 4.7e-4 * 15 + 4e-7 * 12168 + 1.5e-6 * 81 + 4.8e-4 * 2, rel=1e-12)
    bad = json.loads(path.read_text())
    bad["features"] = list(FEATURES)
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="profile again"):
        ProfileCostModel.load(str(path))


def test_a_fit_to_a_runs_many_token_counts_stays_close():
    """A real run's steps have hundreds of distinct token counts; the knees are searched
    over a geometric few of them, and the fit still lands within a percent or two."""
    shapes = [BatchShape(num_decodes=b, decode_context=b * c, max_decode_context=c,
                         num_sampled=b) for b in range(1, 33) for c in (40, 300)]
    shapes += [prefill(p, prior) for p in range(2, 500, 3) for prior in (0, 200)]
    fit = fit_step_times(shapes, [true_time(s) for s in shapes], "padded")
    assert fit.median_rel_error < 0.01 and fit.p90_rel_error < 0.03


def test_the_fit_shrugs_off_a_shared_machines_noise():
    # A shared machine: 1% jitter, one repeat of a third of the shapes loses a 5 ms time
    # slice to another process, and every repeat of a few shapes does.
    rng = np.random.default_rng(0)
    base = grid_shapes()
    slowed_all = {base[i] for i in rng.choice(len(base), 3, replace=False)}
    shapes, times = [], []
    for s in base:
        hit = rng.integers(3) if rng.random() < 1 / 3 else -1
        for k in range(3):  # three repeats of each shape
            shapes.append(s)
            times.append(true_time(s) * (1 + rng.normal(0, 0.01))
                         + (0.005 if k == hit or s in slowed_all else 0.0))
    model = ProfileCostModel(fit_step_times(shapes, times), model={}, device="cpu",
                             kv_cache_memory=1)
    errors = [abs(model.step_time(s) / true_time(s) - 1) for s in base]
    assert max(errors) < 0.1 and np.median(errors) < 0.03


def test_the_fit_predicts_the_typical_step_not_the_luckiest():
    """With symmetric jitter of 8% the fit is unbiased: the fastest of three repeats would
    be ~7% low, and simulated latencies add up typical steps."""
    rng = np.random.default_rng(1)
    base = grid_shapes()
    shapes = base * 3
    times = [true_time(s) * (1 + rng.normal(0, 0.08)) for s in shapes]
    model = ProfileCostModel(fit_step_times(shapes, times), model={}, device="cpu",
                             kv_cache_memory=1)
    bias = np.mean([model.step_time(s) / true_time(s) - 1 for s in base])
    assert abs(bias) < 0.025


def test_the_decode_term_follows_the_runners_layout():
    """Decode batches of unequal contexts: a paged kernel costs the sum of the contexts,
    a padded one the batch times the longest; each fit recovers its own kind exactly."""
    shapes = [BatchShape(num_decodes=b, decode_context=b * c // 2 + c // 2,
                         max_decode_context=c, num_sampled=b)
              for b in (1, 2, 4, 8, 16) for c in (64, 256, 1024)]
    shapes += [BatchShape(num_prefill_tokens=p, num_prefills=1,
                          prefill_attention=p * (p + 1) // 2, prefill_context=p, num_sampled=1)
               for p in (16, 64, 256)]

    def paged_time(s: BatchShape) -> float:
        return 2e-3 + 1e-5 * (s.num_prefill_tokens + s.num_decodes) + 1e-6 * s.decode_context

    times = [paged_time(s) for s in shapes]
    paged = fit_step_times(shapes, times, "paged")
    padded = fit_step_times(shapes, times, "padded")
    assert paged.median_rel_error < 1e-9
    assert paged.coefficients["decode_attention"] == pytest.approx(1e-6)
    # A batch of one long context among short ones: only the right layout predicts it.
    skewed = BatchShape(num_decodes=16, decode_context=1024 + 15 * 16,
                        max_decode_context=1024, num_sampled=16)

    def predict(fit):
        return ProfileCostModel(fit, model={}, device="cpu", kv_cache_memory=1
                                ).step_time(skewed)

    assert predict(paged) == pytest.approx(paged_time(skewed))
    assert predict(padded) > 1.5 * paged_time(skewed)
    with pytest.raises(ValueError, match="decode_layout"):
        fit_step_times(shapes, times, "ragged")


def test_too_few_shapes_is_a_clear_error():
    with pytest.raises(ValueError, match="distinct batch shapes"):
        fit_step_times([BatchShape(num_decodes=1)] * 10, [0.01] * 10)
    with pytest.raises(ValueError, match="positive"):
        fit_step_times(grid_shapes(), [0.0] * len(grid_shapes()))


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(3, 5), st.integers(0, 10_000))
def test_nnls_satisfies_its_optimality_conditions(m_extra, n, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n + m_extra, n))
    b = rng.normal(size=n + m_extra)
    x = nnls(a, b)
    grad = a.T @ (b - a @ x)  # -1/2 the gradient of the squared residual
    assert (x >= 0).all()
    assert (grad <= 1e-8).all()  # no coordinate could still lower the residual
    assert np.allclose(grad[x > 1e-10], 0, atol=1e-8)


def test_a_profile_file_round_trips_and_guards_its_model(tmp_path):
    shapes = grid_shapes()
    model = resolve_sim_model(tiny_args())
    profile = ProfileCostModel(fit_step_times(shapes, [true_time(s) for s in shapes], "padded"),
                               model=ProfileCostModel.model_fields(model, "tiny"),
                               device="cpu", kv_cache_memory=1 << 20)
    path = tmp_path / "p.json"
    profile.save(str(path), list(zip(shapes, map(true_time, shapes))))
    loaded = make_cost_model(str(path), model)
    assert all(loaded.step_time(s) == pytest.approx(true_time(s)) for s in shapes)
    assert loaded.cap_kv_to_useful  # profiled on a CPU: the engine caps its default pool
    assert len(json.loads(path.read_text())["samples"]) == len(shapes)
    other = resolve_sim_model(EngineArgs(model="smollm2-135m"))
    with pytest.raises(ValueError, match="hidden_size 576 vs 64"):
        make_cost_model(str(path), other)
    with pytest.raises(ValueError, match="profile already"):
        make_cost_model(str(path), model, tp=2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a profile"):
        ProfileCostModel.load(str(bad))


def test_conveyor_profile_measures_the_real_engine(tmp_path, capsys):
    from conveyor.entrypoints.cli import main

    out = tmp_path / "tiny.json"
    rc = main(["profile", "--model", "tiny", "--load-format", "dummy", "--num-threads", "1",
               "--batch-sizes", "1,2,4", "--context-lens", "16,48", "--prefill-tokens",
               "16,32,64", "--decode-steps", "2", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    assert "fit error" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["model"]["name"] == "tiny"
    shapes = [BatchShape(**{k: v for k, v in s.items() if k != "seconds"})
              for s in data["samples"]]
    assert any(s.num_decodes == 4 and s.num_prefills == 0 for s in shapes)
    assert any(s.num_prefill_tokens == 64 for s in shapes)
    # A prompt continued after its cached prefix: 16 tokens gathering 16 prior ones.
    assert any(s.num_prefill_tokens == 16 and s.prefill_context == 32 for s in shapes)
    assert all(s["seconds"] > 0 for s in data["samples"])
    # The simulator runs on it (the tiny shape matches), with the machine's KV default.
    args = tiny_args(max_num_seqs=4)
    res = Simulator(args, make_cost_model(str(out), resolve_sim_model(args))).run(
        make_workload(10, seed=9))
    assert len(res.finished) == 10 and res.sim_time > 0


def test_the_decode_grid_reaches_whole_batches_after_chunked_prefills():
    """b requests of c tokens under a small budget: all b still decode together at the end."""
    from conveyor.sim.profiler import ProfileGrid, profile_steps

    grid = ProfileGrid(batch_sizes=(4,), context_lens=(48,), prefill_tokens=(16,),
                       decode_steps=3, repeats=1)
    samples, _ = profile_steps(tiny_args(max_num_batched_tokens=64), grid, log=lambda m: None)
    pure = [s for s, _ in samples if s.num_prefills == 0 and s.num_decodes == 4]
    assert len(pure) >= 3 and all(s.max_decode_context >= 48 for s in pure)
    assert any(s.num_prefills and s.num_decodes for s, _ in samples)  # mixed steps too
