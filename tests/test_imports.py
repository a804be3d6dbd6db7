"""The package's layering, read from the source with ``ast`` (nothing is imported).

``ir/`` is a leaf; ``passes/`` (planning, analyses and rewrites) and ``runtime/`` (kernels, host
pool, streams) both import it and never each other, not even inside a function; the pure
timeline simulator imports no other pass; the passes have no import cycle.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "offload_compiler"
PACKAGE = ROOT.name


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(target: str) -> str:
    """The module ``target`` names: itself, or the package holding it where ``target`` is a name
    imported from a module (``from .x import y``)."""
    path = ROOT.parent / target.replace(".", "/")
    if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
        return target
    return target.rsplit(".", 1)[0]


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """``module -> the package modules it imports`` over every ``import`` / ``from ... import``
    statement in its source, at any depth (function-level imports included)."""
    graph = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                if module == PACKAGE or module.startswith(PACKAGE + "."):
                    out |= {_resolve(f"{module}.{alias.name}") for alias in node.names}
            elif isinstance(node, ast.Import):
                out |= {_resolve(a.name) for a in node.names if a.name.startswith(PACKAGE + ".")}
        graph[name] = frozenset(out - {name})
    return graph


def _in(module: str, package: str) -> bool:
    return module == f"{PACKAGE}.{package}" or module.startswith(f"{PACKAGE}.{package}.")


def _reachable(start: str, skip: frozenset[str] = frozenset()) -> set[str]:
    """The modules ``start`` imports, directly or through others (not through those in ``skip``)."""
    graph = import_graph()
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen and m not in skip:
                seen.add(m)
                todo.append(m)
    return seen


def _modules(package: str) -> list[str]:
    return [m for m in import_graph() if _in(m, package)]


def test_the_graph_is_read():
    graph = import_graph()
    # Known edges, so that a parser that reads nothing cannot pass the tests below.
    assert f"{PACKAGE}.ir.ops" in graph[f"{PACKAGE}.runtime.ops"]
    assert f"{PACKAGE}.ir.alias" in graph[f"{PACKAGE}.passes.liveness"]
    assert f"{PACKAGE}.passes.liveness" in graph[f"{PACKAGE}.passes.cost_model"]
    assert len(_modules("passes")) >= 15 and len(_modules("runtime")) >= 8 and len(_modules("ir")) >= 4


# The calibration (options -> calibrate) times the runtime's CPU optimizer to fill in device
# figures: the one way from the planner to the runtime, at the top level, lazily.
ALLOWED_BRIDGES = {"passes": frozenset({f"{PACKAGE}.calibrate"}), "runtime": frozenset()}


@pytest.mark.parametrize(("importer", "forbidden"), [("passes", "runtime"), ("runtime", "passes")])
def test_passes_and_runtime_do_not_import_each_other(importer, forbidden):
    direct = sorted(f"{m} -> {t}" for m in _modules(importer) for t in import_graph()[m] if _in(t, forbidden))
    assert direct == [], f"{importer}/ imports {forbidden}/: {direct}"
    # Nor through another module of the package (the runtime through the pipeline, say).
    skip = ALLOWED_BRIDGES[importer]
    through = sorted(
        f"{m} reaches {t}" for m in _modules(importer) for t in _reachable(m, skip) if _in(t, forbidden)
    )  # fmt: skip
    assert through == [], f"{importer}/ reaches {forbidden}/: {through}"


def test_ir_is_a_leaf():
    bad = sorted(f"{m} -> {t}" for m in _modules("ir") for t in import_graph()[m] if not _in(t, "ir"))
    assert bad == [], f"ir/ imports the rest of the package: {bad}"


def test_the_simulator_is_pure():
    assert import_graph()[f"{PACKAGE}.passes.simulate"] == frozenset()


def test_no_import_cycle_among_the_passes():
    outside = frozenset(m for m in import_graph() if not _in(m, "passes"))
    cycles = sorted(m for m in _modules("passes") if m in _reachable(m, outside))
    assert cycles == [], f"passes on an import cycle: {cycles}"
