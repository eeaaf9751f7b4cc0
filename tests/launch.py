"""Run ``python ARGS`` as one process or as ``nproc`` processes of one gloo group (on
the CPU, one thread each, 127.0.0.1 only), for the scale-out tests.

The processes are forked from a server that has imported torch, transformers and
geosharp once (:mod:`multiprocessing`'s forkserver): each gets torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), the ``sys.argv``,
``sys.path`` and working directory that ``python ARGS`` would have, and runs its script
as ``__main__``; the first to fail ends the others, as torchrun does. That skips an
import of about 3 CPU-seconds per process, and torchrun's own process. ``torchrun=True``
launches under ``torch.distributed.run`` itself, for the tests of what torchrun does."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings

ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "GLOO_SOCKET_IFNAME": "lo",
}
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "geosharp",
    "geosharp.cli.commands",
]
"""What the server imports once: what the launched scripts import (a module missing
from an install is passed over)."""


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


def run_python(
    args: list[str], nproc: int, cwd=None, timeout: float = 600, torchrun: bool = False
) -> str:
    """Run and return stdout; fail with the end of the logs. A failed launch of
    several processes is retried once on a fresh port (runs resume, so a retry is
    harmless)."""
    for attempt in range(2):
        proc = launch(args, nproc, cwd, timeout, torchrun=torchrun)
        if proc.returncode == 0 or nproc == 1 or attempt == 1:
            break
        warnings.warn(f"launch failed, retrying once: {proc.stderr[-2000:]}", stacklevel=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def launch(
    args: list[str],
    nproc: int,
    cwd=None,
    timeout: float = 600,
    env: dict | None = None,
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """One run of ``python ARGS`` (``nproc`` processes of one group for ``nproc > 1``),
    with ``env`` added to the environment; whatever its exit status: the processes'
    outputs in rank order, the first failure's exit status."""
    env = environment(env)
    if torchrun:
        return _torchrun(args, nproc, cwd, timeout, env)
    return _forked(args, nproc, cwd, timeout, env)


def environment(extra: dict | None = None) -> dict:
    """A launch's environment: this process's, with :data:`ENV` and ``extra``, less any
    torchrun variables of its own."""
    env = {**os.environ, **ENV, **(extra or {})}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return env


def _torchrun(args, nproc, cwd, timeout, env) -> subprocess.CompletedProcess:
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


def _ranks(nproc: int) -> list[dict]:
    """torchrun's environment for each process of one node (none for one process)."""
    if nproc == 1:
        return [{}]
    port = str(free_port())
    return [
        {"RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
         "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for r in range(nproc)
    ]  # fmt: skip


def _forked(args, nproc, cwd, timeout, env) -> subprocess.CompletedProcess:
    from multiprocessing.connection import wait

    context = _server()
    cwd = os.path.abspath(cwd or os.getcwd())
    path = _search_path(env.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for rank, extra in enumerate(_ranks(nproc)):
            outs = (os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err"))
            job = (list(args), {**env, **extra}, cwd, path, outs)
            procs.append(context.Process(target=_child, args=job, daemon=False))
            procs[-1].start()
        deadline, failed = time.monotonic() + timeout, None
        while any(p.exitcode is None for p in procs):
            left = deadline - time.monotonic()
            if left <= 0:
                _end(procs)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout)
            wait([p.sentinel for p in procs if p.exitcode is None], timeout=left)
            failed = failed or next((p.exitcode for p in procs if p.exitcode), None)
            if failed:
                _end(procs)  # as torchrun: the others may wait for it in a collective
        out, err = ("".join(_read(os.path.join(logs, f"{r}.{k}")) for r in range(nproc))
                    for k in ("out", "err"))  # fmt: skip
    return subprocess.CompletedProcess(args, failed or 0, out, err)


def _end(procs, grace: float = 5.0) -> None:
    """Terminate the processes still running, then kill what outlives ``grace``."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(grace)
        if p.exitcode is None:
            p.kill()
            p.join()


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


@functools.cache
def _server():
    """The forkserver context, its server started with the launches' environment."""
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.update(ENV)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


@functools.cache
def _search_path(pythonpath: str) -> list[str]:
    """``sys.path`` of a plain ``python`` here with this ``PYTHONPATH``, less its first
    entry (the script's)."""
    code = "import json, sys; print(json.dumps(sys.path[1:]))"
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return json.loads(out.stdout)


def _child(args, env, cwd, path, outs) -> None:
    """In a forked process: ``python ARGS`` with this environment, working directory and
    ``sys.path``, stdout and stderr into the files ``outs``; exits with its status."""
    import atexit
    import gc
    import runpy

    gc.freeze()  # the server's imports: a collection here walks this process's objects only
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, name in zip((1, 2), outs):
        opened = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    code = 0
    try:
        if args[0] == "-m":
            sys.argv, sys.path[:] = ["-m", *args[2:]], [cwd, *path]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[:] = [os.path.dirname(os.path.abspath(args[0])), *path]
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter: before the exit functions
        code = 1
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
