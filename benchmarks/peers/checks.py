"""Checks that every system saw the same work: prompt lengths, forced output lengths.

The client takes each request's prompt and output token counts from the server's own
``usage`` report, so comparing them with the workload file shows whether a server
tokenized a text prompt differently, added a BOS token, or stopped early.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from conveyor.bench.traces import TraceRow


@dataclass
class Mismatches:
    prompt: int = 0  # requests whose prompt length the server counted differently
    output: int = 0  # completed requests with another output length than asked
    example: str = ""

    def __bool__(self) -> bool:
        return bool(self.prompt or self.output)

    def describe(self) -> str:
        parts = []
        if self.prompt:
            parts.append(f"{self.prompt} prompt length(s) differ")
        if self.output:
            parts.append(f"{self.output} output length(s) differ")
        return ", ".join(parts) + (f" (e.g. {self.example})" if self.example else "")


def record_mismatches(records_path: str, rows: list[TraceRow]) -> Mismatches:
    """Compare a run's per-request records (bench's .records.jsonl) with the workload rows
    (request id i is row i); failed requests count for neither."""
    found = Mismatches()
    with open(records_path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("error"):
                continue
            row = rows[int(rec["request_id"])]
            if rec["prompt_tokens"] != row.input_len:
                found.prompt += 1
                found.example = found.example or (f"request {rec['request_id']}: prompt "
                                                  f"{rec['prompt_tokens']} != {row.input_len}")
            if rec["output_tokens"] != row.output_len:
                found.output += 1
                found.example = found.example or (f"request {rec['request_id']}: output "
                                                  f"{rec['output_tokens']} != {row.output_len}")
    return found


def text_prompt_failures(checkpoint: str, prompts: list[list[int]]) -> list[int]:
    """Indices of prompts whose text (as `conveyor bench --prompt-format text` sends it)
    would not tokenize back to the same ids."""
    from benchmarks.peers.checkpoint import round_trip_failures
    from conveyor.engine.detokenizer import load_tokenizer

    return round_trip_failures(load_tokenizer(checkpoint), prompts)
