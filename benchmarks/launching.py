"""A benchmark's child processes: one plain ``python`` process or ``torchrun`` on the
CPU (gloo, one thread each, 127.0.0.1), and the JSON line a child prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc returns every freed block above 128 KiB: memory held, not the heap's."""


def torchrun(port: int, nproc: int = 2) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a run on ``nproc`` CPU processes
    (``torchrun``, gloo, one thread each)."""
    prefix = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
              "--master_addr=127.0.0.1", f"--master_port={port}"]  # fmt: skip
    return prefix, {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def run_json(
    args: list[str],
    nproc: int | None,
    port: int,
    env: dict[str, str] | None = None,
    marker: str = "{",
    tries: int = 1,
) -> Any:
    """``python ARGS`` (under ``torchrun`` on ``nproc`` processes; one plain process,
    one thread, for ``None``), ``env`` added to the environment: the last line of its
    output that starts with ``marker``, read as JSON. Tried ``tries`` times (gloo
    sometimes aborts a process at exit, after the results), then an error with the end
    of its log."""
    if nproc is None:
        prefix, extra = [sys.executable], {"OMP_NUM_THREADS": "1"}
    else:
        prefix, extra = torchrun(port, nproc)
    environment = {**os.environ, **extra, **(env or {})}
    for _ in range(tries):
        proc = subprocess.run([*prefix, *args], env=environment, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith(marker)]
        if lines:
            return json.loads(lines[-1])
    raise RuntimeError(proc.stderr[-3000:])
