"""benchmarks/cpu_report.py runs what the CPU performance issue measures on a new CPU
kind: every script and test file it names exists (a rename would otherwise break the
report on the one session that has that CPU), and its CPU line names the model and the
flags that pick kernels."""

from __future__ import annotations

import importlib.util
import itertools
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report():
    spec = importlib.util.spec_from_file_location(
        "cpu_report", os.path.join(ROOT, "benchmarks", "cpu_report.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_step_names_files_that_exist() -> None:
    report = _report()
    steps = report.steps(peers=True)
    assert [name for name, _ in steps][-1] == "peers"
    assert "peers" not in [name for name, _ in report.steps(peers=False)]
    for _, cmd in steps:
        args = cmd[1:]
        # A file named outright (a test) or a benchmark run as a module (``-m benchmarks.x``).
        paths = [a for a in args if a.endswith(".py")]
        paths += [module.replace(".", "/") + ".py" for flag, module in itertools.pairwise(args)
                  if flag == "-m" and module.startswith("benchmarks.")]
        assert paths, cmd
        for path in paths:
            assert os.path.isfile(os.path.join(ROOT, path)), path


def test_the_cpu_line_names_the_model_and_kernel_flags() -> None:
    line = _report().describe_cpu()
    assert line.startswith("CPU: ")
    if os.path.isfile("/proc/cpuinfo") and "x86" in os.uname().machine:
        assert "kernel flags:" in line and "family" in line
