"""Prefill/decode disaggregation with adapters: real ``--kv-role prefill`` and ``--kv-role
decode`` servers with the same ``--lora-modules``; a request naming an adapter is
prefilled with it on one engine, its prompt K/V moved, and decoded with it on the other.
Outputs equal one engine's (``--kv-role both``, whose adapter outputs equal PEFT's:
tests/test_lora.py) token for token, through the transfer, not the recompute fallback."""

from __future__ import annotations

import contextlib
import uuid

import pytest
from lora_helpers import make_adapter
from test_disagg import BLOCK, COMMON, _completion, _metric, _prefill_handle, _tokens

from helpers import make_checkpoint, random_prompts
from server_helpers import free_port, serve

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def cluster():
    base = make_checkpoint("llama")
    lora = ("--enable-lora", "--max-lora-rank", "16", "--lora-modules",
            f"a1={make_adapter(base, 1, r=8)}", f"a2={make_adapter(base, 2, r=16)}")
    with contextlib.ExitStack() as stack:
        ref = stack.enter_context(serve(base, *COMMON, *lora, wait=False))
        pre = stack.enter_context(serve(base, *COMMON, *lora, "--kv-role", "prefill",
                                        "--kv-port", str(free_port()), wait=False))
        dec = stack.enter_context(serve(base, *COMMON, *lora, "--kv-role", "decode",
                                        wait=False))
        for s in (ref, pre, dec):
            s.wait_ready(180.0)
        yield dict(ref=ref, pre=pre, dec=dec)


def test_adapters_across_prefill_and_decode(cluster):
    ref, pre, dec = cluster["ref"], cluster["pre"], cluster["dec"]
    loads = _metric(dec, "kv_transfer_loads_total")
    recomputed = _metric(dec, "kv_transfer_requests_recomputed_total")
    prompts = random_prompts(2, lo=BLOCK + 1, hi=40, seed=11)
    outputs = set()
    for model in ("tiny-llama", "a1", "a2"):
        for prompt in prompts:
            want = _tokens(_completion(ref.url, prompt, model=model))
            handle = _prefill_handle(pre, prompt, uuid.uuid4().hex, model=model)
            got = _tokens(_completion(dec.url, prompt, model=model,
                                      kv_transfer_params=handle))
            assert got == want, model
            outputs.add((want[0], tuple(want[1])))
    assert len(outputs) == 6  # the adapters change the continuations
    assert _metric(dec, "kv_transfer_loads_total") == loads + 6
    assert _metric(dec, "kv_transfer_requests_recomputed_total") == recomputed


def test_a_handle_of_another_model_is_refused(cluster):
    """The handle names the model the K/V was computed with: a decode request naming
    another adapter, or the base model, is a 400 (its K/V would be another model's)."""
    pre, dec = cluster["pre"], cluster["dec"]
    prompt = random_prompts(1, lo=BLOCK + 1, hi=30, seed=12)[0]
    handle = _prefill_handle(pre, prompt, uuid.uuid4().hex, model="a1")
    assert handle["model"] == "a1"
    for other in ("a2", "tiny-llama"):
        r = _completion(dec.url, prompt, model=other, kv_transfer_params=handle)
        assert r.status_code == 400, r.text
        assert "computed with model 'a1'" in r.json()["error"]["message"]
    assert _tokens(_completion(dec.url, prompt, model="a1", kv_transfer_params=handle))
