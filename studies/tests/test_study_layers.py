"""The studies are a layer above the core, built on its public API only: no name or
module of geosharp that starts with an underscore."""

import ast
from pathlib import Path

import geosharp_studies

ROOT = Path(geosharp_studies.__file__).parent


def test_the_studies_use_only_public_names_of_the_core():
    private = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                module = node.module or ""
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                module, names = "", [a.name for a in node.names]
            else:
                continue
            dotted = [f"{module}.{n}" if module else n for n in names]
            for name in dotted:
                parts = name.split(".")
                if parts[0] == "geosharp" and any(p.startswith("_") for p in parts[1:]):
                    private.append(f"{path.relative_to(ROOT)}: {name}")
    assert not private, private


def test_the_studies_commands_join_the_command_line():
    from geosharp.cli import build_parser

    assert {"study", "zoo"} <= build_parser().commands
