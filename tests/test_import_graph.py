"""The seams hold in the import graph.

- No import cycle among conveyor's modules, and every module imports only from its own
  layer or lower ones (``LAYERS``), read from the source with ``ast``: imports at module
  level and inside functions alike, and lazy imports by name (a module that uses
  ``importlib`` and names a conveyor module in a string constant). Imports under
  ``if TYPE_CHECKING:`` count for the layer order (a type from a higher layer is a
  dependency on it) but not for cycles (they never run, so they cannot close one).
- The engine core, the front end and the API server import no torch (only the executor
  that runs the model does), and a real ``conveyor serve`` process never loads torch's
  libraries while its engine-core process does.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx
import pytest

from helpers import child_pids, make_checkpoint
from server_helpers import serve

SRC = os.path.join(os.path.dirname(__file__), "..", "src")
BANNED = ("torch", "transformers")

# Lowest first: a module may import its own layer and lower ones. Each entry names a
# top-level module or package of conveyor ("" is the package itself, whose lazy exports
# reach the user-facing API).
# - plain data every layer shares: the config, the environment, a request and its
#   sampling parameters, the outputs and their metrics, the step timings;
# - kernels and distributed sit with the model: compiled ops and process groups are
#   torch, and nothing below the model (core, spec, kv_transfer) may load torch;
# - the front ends (the command line, the servers, the router, the bench, the
#   simulator, integrations) last.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config", "envs", "sampling_params", "structured_outputs", "request", "outputs", "metrics",
     "timings"),
    ("costs",),  # the step-cost models: the core's budget controller prices steps with them
    ("core",),
    ("spec", "kv_transfer"),
    ("model", "runner", "executor", "kernels", "distributed"),
    ("engine",),
    ("entrypoints", "router", "bench", "sim", "integrations", "serve", ""),
)


@dataclass(frozen=True)
class Import:
    target: str  # a conveyor module (or package) name
    line: int
    type_checking: bool  # under ``if TYPE_CHECKING:``


def conveyor_modules(src: str) -> dict[str, str]:
    """Module name -> file, for every module under ``src``/conveyor."""
    out = {}
    for folder, _, files in os.walk(os.path.join(src, "conveyor")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, src)[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, module: str, is_package: bool, known: Iterable[str]
               ) -> list[Import]:
    """Every conveyor import in ``source`` (the code of ``module``), wherever it is."""
    known = set(known)
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def resolve(name: str) -> str:
        # ``from a.b import c``: the submodule a.b.c if there is one, else a.b itself.
        return name if name in known else name.rpartition(".")[0]

    def visit(node: ast.AST, type_checking: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_checking)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, type_checking) for a in node.names
                         if a.name.split(".")[0] == "conveyor")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] == "conveyor":
                found.extend(Import(resolve(f"{base}.{a.name}"), node.lineno, type_checking)
                             for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, type_checking)

    tree = ast.parse(source)
    visit(tree, False)
    if any(i.target == "importlib" for i in _plain_imports(tree)):
        found.extend(Import(node.value, node.lineno, False) for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and node.value in known)
    return [i for i in found if i.target != module]


def _plain_imports(tree: ast.Module) -> list[Import]:
    return [Import(a.name, node.lineno, False) for node in ast.walk(tree)
            if isinstance(node, ast.Import) for a in node.names]


def import_graph(src: str = SRC, *, with_type_checking: bool = True
                 ) -> dict[str, set[str]]:
    modules = conveyor_modules(src)
    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            found = imports_of(f.read(), module, path.endswith("__init__.py"), modules)
        graph[module] = {i.target for i in found if with_type_checking or not i.type_checking}
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(cycles)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return next((i for i, names in enumerate(layers) if top in names), None)


def layer_violations(graph: Mapping[str, Iterable[str]],
                     layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """``a -> b`` for every import of a higher layer, and every module with no layer."""
    out = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        if mine is None:
            out.append(f"{module}: no layer (place it in LAYERS)")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs > mine:
                out.append(f"{module} -> {target} (layer {mine} imports layer {theirs})")
    return out


# ---- the layer order ----------------------------------------------------------------------
def test_the_checker_sees_imports_inside_functions_type_checking_and_by_name() -> None:
    source = textwrap.dedent("""
        import importlib
        from typing import TYPE_CHECKING
        from conveyor.config import EngineArgs
        if TYPE_CHECKING:
            from conveyor.engine.core import EngineCore
        def build():
            from conveyor.executor import factory
            return importlib.import_module("conveyor.sim.cli")
    """)
    known = {"conveyor.config", "conveyor.engine.core", "conveyor.executor",
             "conveyor.executor.factory", "conveyor.sim.cli"}
    found = imports_of(source, "conveyor.bench.x", False, known)
    assert {(i.target, i.type_checking) for i in found} == {
        ("conveyor.config", False), ("conveyor.engine.core", True),
        ("conveyor.executor.factory", False), ("conveyor.sim.cli", False)}


def test_the_checker_reports_a_cycle_and_an_upward_import() -> None:
    graph = {"conveyor.core.a": {"conveyor.core.b", "conveyor.config"},
             "conveyor.core.b": {"conveyor.core.c"},
             "conveyor.core.c": {"conveyor.core.a"},
             "conveyor.config": set(),
             "conveyor.executor.x": {"conveyor.engine.y"},
             "conveyor.engine.y": {"conveyor.executor.x"},
             "conveyor.nowhere": set()}
    assert find_cycles(graph) == [["conveyor.core.a", "conveyor.core.b", "conveyor.core.c"],
                                  ["conveyor.engine.y", "conveyor.executor.x"]]
    assert layer_violations(graph) == [
        "conveyor.executor.x -> conveyor.engine.y (layer 4 imports layer 5)",
        "conveyor.nowhere: no layer (place it in LAYERS)"]
    acyclic = {k: v - {"conveyor.core.a", "conveyor.executor.x"} for k, v in graph.items()}
    assert find_cycles(acyclic) == []


def test_conveyor_has_no_import_cycle() -> None:
    assert find_cycles(import_graph(with_type_checking=False)) == []


def test_every_module_imports_only_its_own_layer_or_lower_ones() -> None:
    assert layer_violations(import_graph()) == []


def test_the_config_imports_nothing_above_it() -> None:
    graph = import_graph()
    assert sorted(f"{m} -> {t}" for m in graph if m.startswith("conveyor.config")
                  for t in graph[m] if layer_of(t) != 0) == []


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
