"""Every command on an install without an extra names the extra in one line, exit
status 2, before anything slow; never a traceback (the optional packages are hidden
from a fresh interpreter here, as a core install lacks them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HIDE = """
import sys
for name in {hidden!r}:
    sys.modules[name] = None  # import fails, as on an install without it
from geosharp.cli import main
raise SystemExit(main({argv!r}))
"""


def _run(argv, hidden):
    code = HIDE.format(hidden=hidden, argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "argv, hidden, extra",
    [
        (["demo"], ["transformers"], "geosharp[hf"),
        (["demo"], ["sklearn"], "geosharp[data]"),
        (["demo"], ["transformers", "sklearn"], "geosharp[hf,data]"),
        (["symmetries", "minilm"], ["transformers"], "geosharp[hf]"),
        (["measure", "minilm", "--data", "rotten-tomatoes"], ["transformers"], "geosharp[hf]"),
    ],
)
def test_a_command_without_its_extra_names_it(argv, hidden, extra):
    proc = _run(argv, hidden)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and extra in lines[0], proc.stderr
