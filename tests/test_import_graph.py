"""The seams hold in the import graph: the engine core, the front end and the API server
import no torch (only the executor that runs the model does), and a real ``conveyor
serve`` process never loads torch's libraries while its engine-core process does."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from helpers import child_pids, make_checkpoint
from server_helpers import serve

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
BANNED = ("torch", "transformers")


def _imports(code: str) -> list[str]:
    script = textwrap.dedent(code) + textwrap.dedent(f"""
        import sys
        print("BANNED", sorted(m for m in sys.modules if m.split(".")[0] in {BANNED!r}
                               or m in ("conveyor.executor.local",
                                        "conveyor.runner.model_runner")))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("BANNED"))
    return ast.literal_eval(line[len("BANNED "):])


def test_the_engine_core_and_its_messages_import_no_torch() -> None:
    assert _imports("""
        import conveyor.engine.core, conveyor.engine.messages, conveyor.engine.engine_loop
        import conveyor.executor
        from conveyor.engine.core import EngineCore
    """) == []


def test_the_api_server_and_front_end_import_no_torch() -> None:
    ckpt = make_checkpoint("llama")
    assert _imports(f"""
        import conveyor.entrypoints.openai.api_server
        import conveyor.engine.async_engine, conveyor.engine.core_process
        from conveyor.engine.detokenizer import load_tokenizer
        tok = load_tokenizer({ckpt!r})
        assert tok.decode(tok.encode("ba be", add_special_tokens=False))
    """) == []


def test_the_kv_connector_scheduler_half_and_the_proxy_import_no_torch() -> None:
    assert _imports("""
        import conveyor.kv_transfer.connector, conveyor.kv_transfer.state
        import conveyor.kv_transfer.messages, conveyor.kv_transfer.transport
        import conveyor.router.disagg, conveyor.sim.disagg
    """) == []
    assert "torch" in _imports("import conveyor.kv_transfer.worker")


def test_the_check_can_fail() -> None:
    assert "torch" in _imports("import conveyor.executor.local")


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_a_served_model_runs_torch_only_in_the_engine_core_process() -> None:
    with serve(make_checkpoint("llama"), "--served-model-name", "m") as server:
        r = httpx.post(server.url + "/v1/completions",
                       json={"model": "m", "prompt": "ba be", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        assert not _maps_torch(server.proc.pid), "the API server process loaded torch"
        assert any(_maps_torch(c) for c in child_pids(server.proc.pid)), \
            "no child of the server runs the model (the check would be vacuous)"
