"""The native kernel library as other x86 CPUs build it, compiled here and inspected
(not run): an Intel Xeon with AMX (``-march=sapphirerapids``, its own build and the one
capped below AMX), AVX-512 without BF16 (``skylake-avx512``), AVX2 (``haswell``) and the
x86-64 baseline (the portable build's CPU). A session lands on one CPU kind; a change
that breaks another kind's build (an AMX body that no longer compiles, an AVX
instruction leaking into the portable build) would otherwise disable the native kernels
there, silently, at the first start. Each build must compile and link, and its
disassembly must hold the instructions its CPU has and none it lacks."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from conveyor.kernels import cpu as kernels

# (march, ISA cap): what the disassembly must contain, and must not (mnemonics, and
# registers: %ymm AVX, %zmm AVX-512, %tmm AMX tiles)
TARGETS = {
    ("sapphirerapids", "native"): ({"tdpbf16ps", "vdpbf16ps", "%zmm"}, set()),
    ("sapphirerapids", "avx512bf16"): ({"vdpbf16ps", "%zmm"}, {"tdpbf16ps", "%tmm"}),
    ("skylake-avx512", "native"): ({"%zmm"}, {"vdpbf16ps", "%tmm"}),
    ("haswell", "native"): ({"%ymm", "vfmadd231ps"}, {"%zmm"}),
    ("x86-64", "native"): ({"mulps"}, {"%ymm", "%zmm", "vfmadd231ps"}),
}
# libmvec's AVX2 (_ZGVd) and AVX-512 (_ZGVe) variants, which a build must not call where
# its CPU lacks them
MVEC = {"haswell": ("_ZGVe",), "x86-64": ("_ZGVd", "_ZGVe")}

COMPILER = kernels.find_compiler()
pytestmark = [
    pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                       reason="x86-64 Linux builds only"),
    pytest.mark.skipif(COMPILER is None, reason="no C compiler"),
    pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("nm") is None,
                       reason="no binutils to inspect the builds"),
]


def _knows(march: str) -> bool:
    return subprocess.run([COMPILER, f"-march={march}", "-x", "c", "-c", "-o", os.devnull,
                           os.devnull], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[tuple[str, str], tuple[str | None, str]]:
    """Each target's shared object, or None and why not (the compiler's errors, or ""
    where it does not know the -march), built two at a time."""
    root = tmp_path_factory.mktemp("cross")

    def build(target: tuple[str, str]) -> tuple[str | None, str]:
        march, isa = target
        if not _knows(march):
            return None, ""
        path = str(root / f"{march}-{isa}" / "lib.so")
        try:
            kernels.build_for(march, isa, path)
        except subprocess.CalledProcessError as e:
            return None, e.stderr or str(e)
        return path, ""

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(TARGETS, pool.map(build, TARGETS), strict=True))


@pytest.mark.parametrize("target", list(TARGETS), ids=lambda t: "-".join(t))
def test_the_build_of_another_cpu_compiles_with_its_instructions_only(
        builds: dict, target: tuple[str, str]) -> None:
    path, errors = builds[target]
    if path is None and not errors:
        pytest.skip(f"this compiler does not know -march={target[0]}")
    assert path is not None, f"the {target} build does not compile:\n{errors[-3000:]}"
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], check=True,
                          capture_output=True, text=True).stdout
    words = set(re.findall(r"%?[a-z][a-z0-9]*[a-z]", text))  # %zmm0 -> %zmm
    need, forbid = TARGETS[target]
    assert need <= words, f"missing from the {target} build: {sorted(need - words)}"
    assert not (forbid & words), f"in the {target} build: {sorted(forbid & words)}"
    undefined = subprocess.run(["nm", "-D", "--undefined-only", path], check=True,
                               capture_output=True, text=True).stdout
    calls = [s for s in undefined.split() if s.startswith(MVEC.get(target[0], ("-",)))]
    assert not calls, f"the {target} build calls wider libmvec variants: {calls}"
    # every kernel the loader binds is exported
    defined = subprocess.run(["nm", "-D", "--defined-only", path], check=True,
                             capture_output=True, text=True).stdout.split()
    assert set(kernels.SIGNATURES) <= set(defined)
