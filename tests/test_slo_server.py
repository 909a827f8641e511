"""The slo policy behind the HTTP server: an early rejection is a 429 that says why, and
/metrics shows the rejection, the SLO outcomes and the chosen per-step budget."""

from __future__ import annotations

import asyncio

from test_server_app import app_client, completion

# A linear step-cost model whose steps take 10 s (predictions only: the engine runs on the
# wall clock), so a 1 ms TTFT target is out of reach at once on any machine, and a
# 60-second one is reached by a one-step prefill.
ENGINE = {"scheduling_policy": "slo", "slo_late_action": "reject",
          "slo_cost_model": "linear:10,0,0"}


def metric(text: str, name: str) -> float:
    line = next((ln for ln in text.splitlines() if ln.startswith(name)), None)
    assert line is not None, f"{name} not in /metrics:\n{text}"
    return float(line.split()[-1])


def test_an_unattainable_ttft_target_is_a_429_and_is_counted() -> None:
    async def main() -> None:
        async with app_client(ENGINE) as (client, _state):
            lost = await client.post("/v1/completions",
                                     json=completion("ba be bi", slo_ttft_ms=1))
            assert lost.status_code == 429, lost.text
            err = lost.json()["error"]
            assert err["code"] == "slo_unattainable" and "TTFT target" in err["message"]
            ok = await client.post("/v1/completions",
                                   json=completion("ba be bi", slo_ttft_ms=60_000,
                                                   slo_tpot_ms=60_000))
            assert ok.status_code == 200, ok.text
            text = (await client.get("/metrics")).text
            assert metric(text, "conveyor:num_requests_slo_rejected_total") == 1
            assert metric(text, "conveyor:num_requests_rejected_total") == 1
            assert metric(text, 'conveyor:request_slo_total{result="met",target="ttft"}') == 1
            assert metric(text, 'conveyor:request_slo_total{result="missed",target="ttft"}') == 1
            assert metric(text, 'conveyor:step_token_budget_count') >= 1

    asyncio.run(main())
