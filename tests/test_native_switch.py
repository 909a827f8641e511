"""CONVEYOR_NATIVE_KERNELS=0 turns the native CPU kernels off: every backend then falls
back to torch ops, and forcing a native one says why it is unavailable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_the_switch_turns_the_native_kernels_off_and_the_engine_falls_back() -> None:
    code = """
        from conveyor import LLM, SamplingParams
        from conveyor.kernels import cpu as kernels
        assert kernels.load() is None
        llm = LLM("tiny", load_format="dummy", dtype="float32")
        runner = llm.engine.runner
        print(runner.linear_backend, type(runner.decode_kernel).__name__, runner.decode_kernel)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        try:
            LLM("tiny", load_format="dummy", dtype="float32", attention_backend="native")
        except RuntimeError as e:
            print("refused:", e)
    """
    done = _run(code, CONVEYOR_NATIVE_KERNELS="0")
    assert done.returncode == 0, done.stderr[-3000:]
    first, refused = done.stdout.strip().splitlines()[-2:]
    assert first.split()[0] in ("onednn", "torch") and "native" not in first.lower()
    assert "CONVEYOR_NATIVE_KERNELS=0" in refused


def test_other_values_leave_them_on() -> None:
    from conveyor.kernels import cpu as kernels

    for value in ("1", "yes", ""):
        os.environ["CONVEYOR_NATIVE_KERNELS"] = value
        try:
            assert kernels.native_kernels_enabled()
        finally:
            del os.environ["CONVEYOR_NATIVE_KERNELS"]
    for value in ("0", "false", "OFF", "no"):
        os.environ["CONVEYOR_NATIVE_KERNELS"] = value
        try:
            assert not kernels.native_kernels_enabled()
        finally:
            del os.environ["CONVEYOR_NATIVE_KERNELS"]
