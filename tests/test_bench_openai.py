"""The OpenAI backend against a fake streaming server on a loopback port (no engine)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conveyor.bench.openai_backend import OpenAITarget, run_openai
from conveyor.bench.workload import BenchRequest
from conveyor.entrypoints.cli import main

TOKEN_GAP_S = 0.01


class FakeCompletions(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-token chunks, like vLLM; behaviour set on the server."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_POST(self) -> None:
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.bodies.append({"path": self.path, **body})
        if body["max_tokens"] == 13:
            self._send(400, "application/json", b'{"error": "max_tokens 13 is unlucky"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"] if body.get("ignore_eos") else min(2, body["max_tokens"])
        for i in range(n):
            time.sleep(TOKEN_GAP_S)
            reason = "length" if i == n - 1 and server.finish_in_last_token else None
            self._event({"choices": [{"index": 0, "text": f" w{i}", "finish_reason": reason}]})
        if not server.finish_in_last_token:
            self._event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if server.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            self._event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                  "completion_tokens": n}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def _send(self, code: int, ctype: str, payload: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    server.daemon_threads = True
    server.bodies = []
    server.send_usage = True
    server.finish_in_last_token = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def url_of(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def requests_(*output_lens: int, arrival_gap: float = 0.0) -> list[BenchRequest]:
    return [BenchRequest(str(i), i * arrival_gap, [20 + i, 21, 22], n, tenant=f"t{i % 2}")
            for i, n in enumerate(output_lens)]


@pytest.mark.parametrize("send_usage, finish_in_last_token",
                         [(True, True), (False, False)])
def test_openai_backend_times_and_counts_the_stream(fake_server, send_usage,
                                                    finish_in_last_token):
    fake_server.send_usage = send_usage
    fake_server.finish_in_last_token = finish_in_last_token
    reqs = requests_(5, 1, 8, arrival_gap=0.05)
    target = OpenAITarget(url_of(fake_server), model="my-model")
    result = run_openai(reqs, target, progress=False)
    # Times are bounded below by the server's sleeps (a sleep never ends early), above by
    # the run: no bound here depends on how fast or loaded the machine is.
    duration = result.summary.duration_s
    for req, rec in zip(reqs, result.records):
        assert rec.ok, rec.error
        # counted from usage, or from content chunks (the empty closing chunk is not a token)
        assert rec.output_tokens == req.output_len
        assert len(rec.itls_s) == req.output_len - 1
        assert rec.ttft_s >= TOKEN_GAP_S * 0.9
        assert rec.e2e_s >= rec.ttft_s
        assert rec.e2e_s >= req.output_len * TOKEN_GAP_S * 0.9
        assert rec.queue_s is None  # the server's secret
        assert rec.finish_reason == "length"
        # sent no earlier than its arrival time (how much later is the machine's business),
        # and done within the run
        assert req.arrival_s - 1e-3 <= rec.arrival_s
        assert rec.arrival_s + rec.e2e_s <= duration + 1e-6
    long = result.records[2]  # tpot: the mean gap between its 8 tokens
    assert long.tpot_s == pytest.approx(sum(long.itls_s) / 7)
    s = result.summary
    assert s.total_output_tokens == 14 and s.num_completed == 3
    assert s.num_preemptions is None and s.peak_kv_usage is None
    body = sorted(fake_server.bodies, key=lambda b: b["prompt"])[0]
    assert body["path"] == "/v1/completions"
    assert body["model"] == "my-model" and body["prompt"] == [20, 21, 22]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True


def test_openai_backend_extra_body_text_prompts_and_errors(fake_server):
    reqs = requests_(3, 13)
    target = OpenAITarget(url_of(fake_server) + "/v1", model="m", ignore_eos=False,
                          extra_body={"stream_options": None, "min_tokens": 3},
                          prompt_texts={"0": "hello there", "1": "again"})
    result = run_openai(reqs, target, progress=False)
    ok, failed = result.records
    body = next(b for b in fake_server.bodies if b["max_tokens"] == 3)
    assert "stream_options" not in body and "ignore_eos" not in body
    assert body["min_tokens"] == 3 and body["prompt"] == "hello there"
    # without ignore_eos this server stops early: the record says what really came back
    assert ok.ok and ok.output_tokens == 2 and ok.expected_output_tokens == 3
    assert not failed.ok and failed.error.startswith("HTTP 400")
    assert "unlucky" in failed.error
    assert result.summary.num_failed == 1


def test_openai_backend_unreachable_server_fails_each_request():
    target = OpenAITarget("http://127.0.0.1:9", model="m", timeout_s=2)
    result = run_openai(requests_(2, 2), target, progress=False)
    assert all(not r.ok and "ConnectError" in r.error for r in result.records)


def test_cli_exits_nonzero_when_nothing_completes(capsys):
    argv = ["bench", "--backend", "openai", "--base-url", "http://127.0.0.1:9",
            "--vocab-size", "100", "--num-requests", "2", "--input-scale", "0.01",
            "--output-scale", "0.01", "--request-timeout", "2", "--no-progress"]
    assert main(argv) == 1
    assert "2 requests failed" in capsys.readouterr().out


def test_target_url_forms():
    assert OpenAITarget("http://h:1", "m").url == "http://h:1/v1/completions"
    assert OpenAITarget("http://h:1/v1/", "m").url == "http://h:1/v1/completions"
    assert OpenAITarget("http://h:1/v1/completions", "m").url == "http://h:1/v1/completions"


def test_cli_openai_backend(fake_server, tmp_path, capsys):
    out = tmp_path / "o.json"
    argv = ["bench", "--backend", "openai", "--base-url", url_of(fake_server),
            "--model", "tiny", "--openai-model", "served", "--workload", "conversation",
            "--num-requests", "4", "--input-scale", "0.01", "--output-scale", "0.02",
            "--max-concurrency", "2", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["runs"][0]["summary"]["num_completed"] == 4
    assert doc["runs"][0]["summary"]["extra"]["backend"] == "openai"
    assert {b["model"] for b in fake_server.bodies} == {"served"}
    assert all(all(16 <= t < 2048 for t in b["prompt"]) for b in fake_server.bodies)
