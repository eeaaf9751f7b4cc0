"""The README's examples run as written (with the docs pages that continue them), and its
tables say what the code does."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = README.parent / "docs"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_quick_start_runs_as_written(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Trainer's output directory
    blocks = re.findall(r"```python\n(.*?)```", _section("Quick start (Python)"), re.S)
    # docs/training.md continues the example: measuring while training
    blocks += re.findall(r"```python\n(.*?)```", (DOCS / "training.md").read_text(), re.S)[:1]
    assert len(blocks) == 2
    namespace = {"__name__": "__readme__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md (quick start, block {i + 1})", "exec"), namespace)
    out = capsys.readouterr().out
    for measure in ("adaptive", "geodesic-inv", "geodesic-mix"):
        assert re.search(rf"^{measure}\s+rho=\S+\s+sharpness=\S+$", out, re.M), out
    logged = re.search(r"^\[([0-9., e-]+)\]$", out, re.M)  # one value at steps 2 and 4
    assert logged and len(logged.group(1).split(",")) == 2, out


def test_measure_table_matches_the_catalog():
    import geosharp

    rows = re.findall(r"^\| `([a-z-]+)` \| `[^|]*` \| ([0-9.]+) \|", _section("The measures"), re.M)
    assert {name: float(rho) for name, rho in rows} == geosharp.DEFAULT_RHO
    for name, _ in rows:
        geosharp.measure_kwargs(name)


def test_cli_examples_name_real_options():
    from geosharp.cli import build_parser

    parser = build_parser()
    block = re.search(r"```bash\n(.*?)```", _section("Command line"), re.S).group(1)
    for line in block.splitlines():
        words = line.split("#")[0].split()
        if "geosharp" not in words:
            continue
        argv = words[words.index("geosharp") + 1 :] if words[0] == "geosharp" else []
        if words[0] == "torchrun":
            argv = words[words.index("geosharp.cli") + 1 :]
        argv = [w for w in argv if w != "..."]
        command = parser._subparsers._group_actions[0].choices[argv[0]]
        known = {o for a in command._actions for o in a.option_strings}
        for word in argv:
            if word.startswith("--"):
                assert word in known, (line, word)


def test_hessian_trace_example_runs_as_written(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "measures.md").read_text(), re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md (Hessian trace)", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert re.search(
        r"^Hessian trace \(adaptive\) = \S+ \+- \S+ \(50 probes, 1 batches\)$", out, re.M
    )


def test_the_examples_run_in_the_install_the_readme_gives():
    """Every package the README's Python examples import (and transformers' Trainer's
    own need, accelerate) comes with the extra its install line names."""
    import ast
    import sys
    from importlib.metadata import packages_distributions

    import tomllib

    text = README.read_text()
    (extra,) = re.findall(r'pip install -e "\.\[(\w+)\]"', text)
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements):
        return {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

    def resolve(name, seen=()):
        out = set()
        for r in extras[name]:
            nested = re.fullmatch(r"geosharp\[([\w,]+)\]", r)
            if nested:
                for n in nested.group(1).split(","):
                    out |= resolve(n, (*seen, name))
            else:
                out |= names([r])
        return out

    installed = names(project["dependencies"]) | resolve(extra)
    dists = packages_distributions()
    for code in re.findall(r"```python\n(.*?)```", text, re.S):
        tree = ast.parse(code)
        modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names}  # fmt: skip
        modules |= {n.module.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module}  # fmt: skip
        needed = {d.lower() for m in modules - set(sys.stdlib_module_names) - {"geosharp"}
                  for d in dists.get(m, [m])}  # fmt: skip
        if "Trainer" in code:
            needed.add("accelerate")
        assert needed <= installed, (needed - installed, extra)
