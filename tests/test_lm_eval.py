"""lm-evaluation-harness's ``local-completions`` backend, unmodified, against a live server:
a multiple-choice task (loglikelihoods from echo + logprobs, checked against
transformers) and a generate-until task. Skipped where lm-eval is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from helpers import hf_model, make_checkpoint
from server_helpers import ServerProcess, serve

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="lm-eval is not installed")

MODEL = "m"
DATA = Path(__file__).parent / "data" / "lm_eval"
ATOL = 1e-5  # a sum of a few float32 logprobs (see test_prompt_logprobs.py)


@pytest.fixture(scope="module")
def path() -> str:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def server(path: str):
    with serve(path, "--served-model-name", MODEL) as s:
        yield s


def run_lm_eval(server: ServerProcess, path: str, task: str, out: Path) -> list[dict]:
    """The task's logged samples."""
    model_args = (f"model={MODEL},base_url={server.url}/v1/completions,tokenizer={path},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
           model_args, "--tasks", task, "--include_path", str(DATA), "--output_path",
           str(out), "--log_samples"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(out / "datasets"), TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, cwd=DATA, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def test_multiple_choice_loglikelihoods_equal_transformers(server, path, tmp_path) -> None:
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    model = hf_model(path)
    samples = run_lm_eval(server, path, "conveyor_mc", tmp_path)
    checked = 0
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
            whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float()
            lps = torch.log_softmax(logits, dim=-1)
            cont = range(len(ctx), len(whole))
            expected = sum(lps[i - 1, whole[i]].item() for i in cont)
            greedy = all(lps[i - 1].argmax().item() == whole[i] for i in cont)
            loglikelihood, is_greedy = resp[0]
            assert float(loglikelihood) == pytest.approx(expected, abs=ATOL * len(cont))
            assert str(is_greedy) == str(greedy)
            checked += 1
    assert checked == 12  # four questions, three choices each


def test_generate_until_runs(server, path, tmp_path) -> None:
    samples = run_lm_eval(server, path, "conveyor_gen", tmp_path)
    assert len(samples) == 2
    for sample in samples:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        ours = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stop": ["."]}).json()["choices"][0]["text"]
        assert sample["resps"][0][0] == ours
