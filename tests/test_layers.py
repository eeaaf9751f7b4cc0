"""The package's layers: no import cycle, and no module imports a layer above its own.

Layers, bottom to top: helpers (``errors``, ``io``, ``layout``, ``params``, ``progress``,
``distributed``, ``aliases``, ``rng``) -> ``symmetry`` -> ``geometry`` -> ``measures`` ->
``models`` and ``fsdp`` -> ``loading`` (checkpoints and data) -> ``training`` (SAM, the
monitor, the Trainer callbacks) -> ``cli`` (the command line, its options, the demo
and plots) -> the research studies, a package of their own (``studies/``, tested in
``studies/tests/test_study_layers.py``), which the
core never imports. Imports inside functions count too: a lazy import is still a
dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import geosharp

ROOT = Path(geosharp.__file__).parent
LAYERS = {"symmetry": 1, "geometry": 2, "measures": 3, "models": 4, "fsdp": 4}
LAYERS |= {"loading": 5, "training": 6, "cli": 7}
HELPERS = {"errors", "io", "layout", "params", "progress", "distributed", "aliases", "rng"}


def module_name(path: Path) -> str:
    parts = ["geosharp", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the geosharp modules it imports (``from .x import y`` counts ``.x``,
    and ``.x.y`` when that is a module)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{a.name}" for a in node.names]
                # `from . import x` imports submodule x, not the package again
                targets = names if node.module is None else [base, *names]
            else:
                continue
            out |= {t for t in targets if t in modules and t != name}
        graph[name] = out
    return graph


def layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 8  # the package's own __init__: the public face, on top
    if parts[1] in HELPERS:
        return 0
    return LAYERS[parts[1]]


def test_no_import_cycle():
    graph = imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_imports_a_layer_above_it():
    graph = imports()
    upward = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if layer(b) > layer(a) and a != "geosharp"
    ]
    assert not upward, "\n".join(upward)


def test_the_core_never_imports_the_studies():
    """Not even lazily, nor by a module name in a string: the core installs and runs
    without them (their commands join the CLI through an entry point)."""
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            found += [f"{path.name}: {n}" for n in names if n.startswith("geosharp_studies")]
    assert not found, found


def test_every_exported_name_is_in_the_api_page():
    """docs/api.md is the public API in one place: every name the package and its public
    modules export is on it."""
    import importlib
    import re

    page = (ROOT.parents[1] / "docs" / "api.md").read_text()
    modules = ["geosharp", "geosharp.measures", "geosharp.optim", "geosharp.callbacks"]
    modules += ["geosharp.monitor", "geosharp.fsdp", "geosharp.plots", "geosharp.symmetry"]
    missing = [
        f"{m}.{name}"
        for m in modules
        for name in importlib.import_module(m).__all__
        if not re.search(rf"\b{name}\b", page)
    ]
    assert not missing, missing
