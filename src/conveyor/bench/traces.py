"""Trace file parsers: the Azure LLM inference CSV and the Mooncake JSONL.

A parser turns a file into ``TraceRow``s (arrival time and token counts, no token
ids yet) so that sampling and scaling happen before any prompt is materialized:
a Mooncake trace expands to tens of millions of tokens if built whole.

A malformed row raises ``WorkloadError`` naming the file, the line and the field.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from datetime import datetime

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake release


class WorkloadError(ValueError):
    """A workload file or option is invalid; the message says where and why."""


@dataclass(frozen=True)
class TraceRow:
    arrival_s: float  # seconds from the trace's first request
    input_len: int
    output_len: int
    # Mooncake: ids of prompt-prefix blocks; equal leading ids mean an equal prompt prefix.
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


def parse_trace(path: str, fmt: str = "auto") -> list[TraceRow]:
    """Parse a trace file; ``fmt`` is azure, mooncake or auto (by extension)."""
    if fmt == "auto":
        lower = path.lower()
        if lower.endswith(".csv"):
            fmt = "azure"
        elif lower.endswith((".jsonl", ".json")):
            fmt = "mooncake"
        else:
            raise WorkloadError(f"{path}: cannot tell the trace format from the extension; "
                                "pass --workload-format azure or mooncake")
    if fmt == "azure":
        return parse_azure_csv(path)
    if fmt == "mooncake":
        return parse_mooncake_jsonl(path)
    raise WorkloadError(f"unknown trace format {fmt!r}; valid formats: azure, mooncake")


# ---- Azure CSV ----------------------------------------------------------------------------
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_azure_csv(path: str) -> list[TraceRow]:
    """``TIMESTAMP,ContextTokens,GeneratedTokens``; TIMESTAMP is a datetime or seconds."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise WorkloadError(f"{path}: empty file, expected a header "
                                f"{','.join(AZURE_COLUMNS)}")
        header = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise WorkloadError(f"{path}:1: header lacks column(s) {', '.join(missing)}; "
                                f"expected {','.join(AZURE_COLUMNS)}")
        cols = [header.index(c) for c in AZURE_COLUMNS]
        stamps: list[tuple[float, int, int]] = []
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise WorkloadError(f"{path}:{line}: expected {len(header)} fields, "
                                    f"got {len(row)}: {','.join(row)!r}")
            ts = _parse_timestamp(row[cols[0]], path, line)
            ctx = _parse_count(row[cols[1]], "ContextTokens", path, line)
            gen = _parse_count(row[cols[2]], "GeneratedTokens", path, line)
            stamps.append((ts, ctx, gen))
    if not stamps:
        raise WorkloadError(f"{path}: no requests after the header")
    start = min(s[0] for s in stamps)
    rows = [TraceRow(ts - start, ctx, gen) for ts, ctx, gen in stamps]
    rows.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return rows


def _parse_timestamp(text: str, path: str, line: int) -> float:
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise WorkloadError(f"{path}:{line}: TIMESTAMP must be finite, got {text!r}")
        return value
    try:
        return _parse_datetime(text).timestamp()
    except ValueError:
        raise WorkloadError(f"{path}:{line}: TIMESTAMP {text!r} is neither seconds nor a "
                            "date-time like 2023-11-16 18:15:46.68") from None


def _parse_datetime(text: str) -> datetime:
    # The Azure release has 7 fractional digits; fromisoformat takes at most 6 before 3.11.
    head, dot, frac = text.partition(".")
    if dot and frac.isdigit():
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text)


def _parse_count(text: str, field: str, path: str, line: int, minimum: int = 1) -> int:
    try:
        value = int(text.strip())
    except (ValueError, AttributeError):
        raise WorkloadError(f"{path}:{line}: {field} must be an integer, "
                            f"got {text!r}") from None
    if value < minimum:
        raise WorkloadError(f"{path}:{line}: {field} must be >= {minimum}, got {value}")
    return value


# ---- Mooncake JSONL -----------------------------------------------------------------------
def parse_mooncake_jsonl(path: str) -> list[TraceRow]:
    """One JSON object a line: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids`` (prefix blocks of 512 tokens)."""
    rows: list[TraceRow] = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{path}:{line}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise WorkloadError(f"{path}:{line}: expected a JSON object, "
                                    f"got {type(obj).__name__}")
            rows.append(_mooncake_row(obj, path, line))
    if not rows:
        raise WorkloadError(f"{path}: no requests in file")
    start = min(r.arrival_s for r in rows)
    rows = [TraceRow(r.arrival_s - start, r.input_len, r.output_len, r.hash_ids)
            for r in rows]
    rows.sort(key=lambda r: r.arrival_s)
    return rows


def _mooncake_row(obj: dict, path: str, line: int) -> TraceRow:
    for key in ("timestamp", "input_length", "output_length"):
        if key not in obj:
            raise WorkloadError(f"{path}:{line}: missing field {key!r}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) \
            or ts < 0:
        raise WorkloadError(f"{path}:{line}: timestamp must be a non-negative number of "
                            f"milliseconds, got {ts!r}")
    input_len = _json_count(obj["input_length"], "input_length", path, line)
    output_len = _json_count(obj["output_length"], "output_length", path, line)
    hash_ids = obj.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
        raise WorkloadError(f"{path}:{line}: hash_ids must be a list of non-negative "
                            "integers")
    if hash_ids and len(hash_ids) * MOONCAKE_BLOCK_TOKENS < input_len - MOONCAKE_BLOCK_TOKENS:
        # No hash_ids: a prompt that shares nothing. Some: one missing trailing block is
        # tolerated (padded); more means a broken row.
        raise WorkloadError(f"{path}:{line}: {len(hash_ids)} hash_ids cover "
                            f"{len(hash_ids) * MOONCAKE_BLOCK_TOKENS} tokens, far fewer than "
                            f"input_length {input_len}")
    return TraceRow(ts / 1000.0, input_len, output_len, tuple(hash_ids))


def _json_count(value: object, field: str, path: str, line: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkloadError(f"{path}:{line}: {field} must be an integer >= 1, got {value!r}")
    return value
