"""Run ``python ARGS`` as one plain process or as ``nproc`` processes under ``torchrun``
(gloo on the CPU, one thread each, 127.0.0.1 only), for the scale-out tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import warnings


@contextlib.contextmanager
def one_thread():
    """Torch in this process on one thread, as the launched processes run (restored on
    exit): a single-process reference computed here sums in their order."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(args: list[str], nproc: int, cwd=None, timeout: float = 600) -> str:
    """Run and return stdout; fail with the end of the logs. A failed ``torchrun``
    launch is retried once on a fresh port (runs resume, so a retry is harmless)."""
    for attempt in range(2):
        proc = launch(args, nproc, cwd, timeout)
        if proc.returncode == 0 or nproc == 1 or attempt == 1:
            break
        warnings.warn(f"torchrun failed, retrying once: {proc.stderr[-2000:]}", stacklevel=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def launch(
    args: list[str], nproc: int, cwd=None, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """One run of ``python ARGS`` (under ``torchrun`` for ``nproc > 1``), with
    ``env`` added to the environment; whatever its exit status."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        **(env or {}),
    }
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    cmd = [sys.executable, *args]
    if nproc > 1:
        cmd[1:1] = [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
        ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
