"""The package graph is a tree of layers, and no package's modules import in a circle.

Read from the source (ast), every import counted: module level, inside functions
(deferred) and under `TYPE_CHECKING`, since each of the cycles this test was written
against hid behind one of those. `from pkg import name` counts as importing the
submodule `pkg.name` when there is one, else `pkg` itself.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a package may import only packages before it in this list.
LAYERS = ("spec_decode", "scheduler", "runner", "engine", "training", "specbudget")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in its file."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(node, name, path.name == "__init__.py")
                if source is None:
                    continue
                subs = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
                targets |= subs
                if len(subs) < len(node.names):
                    targets.add(source)
        graph[name] = {_known(t, modules) for t in targets if _known(t, modules)} - {name}
    return graph


def _known(target: str, modules: dict[str, Path]) -> str:
    """The longest project module `target` names ("" for none: a third-party import)."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return ""


def layer_violations(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    rank = {package: i for i, package in enumerate(layers)}
    return sorted(f"{source} -> {target}" for source, targets in graph.items()
                  for target in targets
                  if rank[target.split(".")[0]] > rank[source.split(".")[0]])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_files(ROOT, LAYERS))


def test_every_package_imports_only_the_layers_below_it(graph: dict[str, set[str]]) -> None:
    assert layer_violations(graph, LAYERS) == []


def test_no_module_cycle_in_any_package(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_checks_catch_hidden_cycles_and_upward_imports(tmp_path: Path) -> None:
    """Broken on purpose: a cycle through a deferred and a TYPE_CHECKING import, a
    relative import, and a lower package importing a higher one."""
    low, high = tmp_path / "low", tmp_path / "high"
    low.mkdir()
    high.mkdir()
    (low / "__init__.py").write_text("")
    (low / "a.py").write_text("def f():\n    from low import b\n")
    (low / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from low.c import C\n")
    (low / "c.py").write_text("from . import a\nimport high.d\n")
    (high / "__init__.py").write_text("")
    (high / "d.py").write_text("import json\n")
    (high / "e.py").write_text("from low.a import f\n")
    toy = import_graph(module_files(tmp_path, ("low", "high")))
    assert toy["low.c"] == {"low.a", "high.d"} and toy["high.d"] == set()
    assert cycles(toy) == [["low.a", "low.b", "low.c"]]
    assert layer_violations(toy, ("low", "high")) == ["low.c -> high.d"]
    assert layer_violations(toy, ("high", "low")) == ["high.e -> low.a"]


# ---- what importing a layer loads (run in a fresh interpreter) ----------------------


def test_scheduler_and_spec_config_load_no_torch() -> None:
    code = ("import sys, scheduler, spec_decode, runner; "
            "from scheduler import Scheduler, SchedulerConfig, CacheConfig, Request, "
            "SamplingParams, SchedulerOutput, ModelRunnerOutput; "
            "from spec_decode import SpeculativeConfig; from runner import BudgetInvariantError; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_spec_decode_never_imports_the_runner() -> None:
    """Layering: spec_decode sits below runner (the rejection sampler shares its
    sampling maths through spec_decode.sampling, not by importing runner.sampler)."""
    code = ("import sys, spec_decode.rejection_sampler, spec_decode.sampling, "
            "spec_decode.ngram, spec_decode.suffix; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('runner', 'engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
