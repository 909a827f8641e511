"""No conveyor process that runs no Triton kernel imports triton (or torch._dynamo, which
pulls it in): with triton 3.9 beside the CPU torch, its nanobind bindings print some thirty
"leaked function" warnings at exit of any process that imported it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import make_checkpoint

_SCRIPT = """
import sys
from conveyor import LLM, SamplingParams
llm = LLM(model=sys.argv[1], load_format=sys.argv[2], dtype="float32")
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0.0))
assert len(out[0].outputs[0].token_ids) == 3
print("IMPORTED", sorted(m for m in sys.modules
                         if m.split(".")[0] == "triton" or m.startswith("torch._dynamo")))
"""


def _run(model: str, load_format: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", _SCRIPT, model, load_format], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("which", ["tiny", "llama3-rope"])
def test_generate_imports_no_triton_and_prints_no_leak_warnings(which) -> None:
    model, fmt = ("tiny", "dummy") if which == "tiny" else (make_checkpoint("llama"), "auto")
    proc = _run(model, fmt)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout, proc.stdout
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]


def test_asking_every_backend_whether_it_applies_imports_no_triton() -> None:
    """``auto`` asks every registered backend, the triton and flashinfer ones included,
    on any device: the asking imports neither."""
    script = """
import sys, torch
from conveyor.model.attention.registry import attention_backend_names_for
for device in ("cpu", "cuda"):
    for dtype in (torch.float32, torch.float16):
        attention_backend_names_for(device, dtype, 8, 2, 64)
print("IMPORTED", sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "flashinfer")))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout, proc.stdout
