"""The HF transformers ``generate`` peer: the whole workload as one static padded batch.

transformers has no server of its own for this mode, so this in-process adapter runs
inside the transformers venv (it imports nothing from conveyor) and writes what a
client would have measured:

    python hf_generate.py --model CKPT --dtype bf16 --requests REQS.json --out OUT.json

The prompts (token ids, left-padded) all go in one ``generate`` call that runs for
the longest requested output; EOS is masked until then (``min_new_tokens``), as
``ignore_eos`` does on the servers. A logits processor stamps the clock at every
step, so request i's tokens count as delivered at the first ``output_len_i`` stamps
(as if streamed): TTFT is the padded batch's prefill, and tokens/s is the requested
output tokens over the whole call, which pays for the padding and for the slots
that idle after their request's end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True, choices=sorted(DTYPES))
    p.add_argument("--requests", required=True,
                   help='JSON: [{"request_id", "prompt_token_ids", "output_len"}, ...]')
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one short generate before the measured runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.requests) as f:
        requests = json.load(f)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, DTYPES[args.dtype])).eval()
    pad_id = AutoTokenizer.from_pretrained(args.model).pad_token_id or 0
    load_s = time.perf_counter() - t
    print(f"hf-generate: loaded in {load_s:.1f}s, {torch.get_num_threads()} threads", flush=True)
    if args.warmup:
        one_batch(model, [{**r, "output_len": 4} for r in requests[:4]], pad_id)
    runs = []
    for i in range(args.runs):
        run = one_batch(model, requests, pad_id)
        tokens = sum(r["output_tokens"] for r in run["records"])
        print(f"hf-generate run {i + 1}/{args.runs}: {tokens / run['duration_s']:.1f} "
              f"tokens/s", flush=True)
        runs.append(run)
    with open(args.out, "w") as f:
        json.dump({"load_s": load_s, "threads": torch.get_num_threads(), "runs": runs}, f)


def one_batch(model, requests: list[dict], pad_id: int) -> dict:
    """One static batch of all ``requests``; records in conveyor bench's record format."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class StepClock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    width = max(len(r["prompt_token_ids"]) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, r in enumerate(requests):  # left padding: every prompt ends at the last column
        n = len(r["prompt_token_ids"])
        ids[row, width - n:] = torch.tensor(r["prompt_token_ids"])
        mask[row, width - n:] = 1
    steps = max(r["output_len"] for r in requests)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=steps, min_new_tokens=steps, pad_token_id=pad_id,
                             logits_processor=LogitsProcessorList([StepClock()]))
    duration = time.perf_counter() - t0
    if out.shape[1] - width != steps or len(stamps) != steps:
        raise RuntimeError(f"generate made {out.shape[1] - width} tokens in {len(stamps)} "
                           f"steps, expected {steps}")
    records = []
    for r in requests:
        n = r["output_len"]
        times = stamps[:n]
        records.append({
            "request_id": r["request_id"], "arrival_s": 0.0, "tenant": "default",
            "priority": 0, "prompt_tokens": len(r["prompt_token_ids"]), "output_tokens": n,
            "expected_output_tokens": n, "ttft_s": times[0] - t0,
            "tpot_s": (times[-1] - times[0]) / (n - 1) if n > 1 else None,
            "e2e_s": times[-1] - t0,
            "itls_s": [b - a for a, b in itertools.pairwise(times)],
            "finish_reason": "length"})
    return {"duration_s": duration, "records": records}


if __name__ == "__main__":
    main()
