"""Spread sharpness measurements over processes, GPUs and machines.

geosharp uses ``torch.distributed`` as it is: launch one process per GPU (or per CPU
worker) with ``torchrun``, call :func:`init` in each, and every process takes its share
of the work; the results are gathered so that every process (and every file written)
holds exactly what a single process would have produced.

* **Many batches of one model**: ``sharpness(..., distributed=True)``. Every process
  iterates over the same ``batches`` and measures batches ``rank, rank + world_size,
  ...``; the per-batch values, losses and traces are all-gathered in batch order.
  Each batch draws its random start (or directions) from its own generator, so the
  result does not depend on the split.
* **A population of models** (or of measures, radii, checkpoints, ...):
  :func:`map_population` calls ``fn(item)`` for items ``rank, rank + world_size, ...``,
  gathers the results in item order and lets rank 0 write them to one JSON file,
  atomically, the same file a single process writes. Studies that write one file per
  model can instead loop over ``shard(len(models))`` and call :func:`barrier` before
  reading the files back.

Launch, one machine with 4 GPUs (NCCL) or 4 CPU processes (gloo, one thread each)::

    torchrun --nproc_per_node=4 my_study.py
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 my_study.py

and on two machines, 8 GPUs each (run on both, ``--node_rank`` 0 and 1)::

    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 \\
        --master_addr=HOST0 --master_port=29500 my_study.py

where ``my_study.py`` does::

    import geosharp
    from geosharp import distributed as gd

    gd.init()                                   # gloo on CPU, nccl on GPU
    model = load_model().to(gd.device())
    result = geosharp.sharpness(model, batches, loss_fn, distributed=True)

Without an initialised process group (a plain ``python`` run) the helpers behave as a
single process, so one script serves both cases.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .io import write_json_atomic

__all__ = [
    "all_reduce_max",
    "all_reduce_sum",
    "barrier",
    "close",
    "device",
    "failed",
    "gather_in_order",
    "init",
    "is_distributed",
    "map_population",
    "rank_and_world",
    "shard",
    "write_json_atomic",
]


def is_distributed() -> bool:
    """Whether a default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world(require: bool = False) -> tuple[int, int]:
    """``(rank, world_size)`` of the default group, ``(0, 1)`` without one (an error if
    ``require``)."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    if require:
        raise RuntimeError(
            "distributed=True needs an initialised torch.distributed process group: launch "
            "with torchrun and call geosharp.distributed.init() first"
        )
    return 0, 1


def init(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from ``torchrun``'s environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ...) and return ``(rank, world_size)``.

    The backend defaults to ``nccl`` when CUDA is available (each process then uses GPU
    ``LOCAL_RANK``) and ``gloo`` otherwise. Without ``WORLD_SIZE`` in the environment
    (a plain ``python`` run) nothing is initialised and ``(0, 1)`` is returned; calling
    it again is harmless. An error that ends the process uncaught marks it
    :func:`failed`, so that at exit it does not wait for the others.
    """
    if is_distributed():
        return rank_and_world()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    atexit.register(_destroy)
    hook = sys.excepthook

    def failing(*exc_info) -> None:  # an uncaught error: leave without waiting
        failed()
        hook(*exc_info)

    sys.excepthook = failing
    return rank_and_world()


_FAILED: list[bool] = []


def failed() -> None:
    """Mark this process as failing: at exit it leaves the process group without
    waiting for the others (which may wait in a collective for it and would hold it
    forever); they then fail on the closed connection, and ``torchrun`` ends the job."""
    if is_distributed():
        _FAILED.append(True)


def close() -> None:
    """End the process group: collect garbage, wait for every process, destroy it. Call
    it after the last collective with a sharded (FSDP2) model released (``del model``):
    a process that exits while the model's communication objects still live can abort
    (``terminate called without an active exception``) after its work is done."""
    _end(bounded=False)


def _destroy() -> None:
    """At exit (registered by :func:`init`): :func:`close`, except that a gloo process
    waits at most a minute for the others and destroys the group anyway, and a process
    that failed (:func:`failed`) waits for none, so that it does not hold the rest."""
    _end(bounded=True)


def _end(bounded: bool) -> None:
    import gc
    from datetime import timedelta

    gc.collect()
    if not is_distributed():
        return
    if _FAILED and bounded:  # the others may be waiting for this process in a collective
        dist.destroy_process_group()
        return
    if not bounded:
        dist.barrier()
    elif dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):  # a process that failed: destroy anyway
            dist.monitored_barrier(timeout=timedelta(seconds=60))
    dist.destroy_process_group()


def device(spec: str | torch.device | None = "auto") -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` when CUDA is available, else CPU;
    any ``spec`` other than ``"auto"`` (``"cpu"``, ``"cuda:1"``, ...) is taken as is."""
    if spec is not None and spec != "auto":
        return torch.device(spec)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def shard(n: int) -> range:
    """Indices ``rank, rank + world_size, ...`` below ``n``: this process's share."""
    rank, world = rank_and_world()
    return range(rank, n, world)


def barrier() -> None:
    """Wait for every process (no-op without a process group): e.g. after each rank has
    written its share of per-model files, before rank 0 reads them all."""
    if is_distributed():
        dist.barrier()


def all_reduce_sum(group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce(t)``: the sum of ``t`` over the processes of ``group`` (the default
    group), for pair states built on row shards (:class:`geosharp.geometry.PairMetric`);
    the identity without a process group.

    Every call is one all-reduce of an ``h x h`` (or smaller) tensor."""
    return _all_reduce(dist.ReduceOp.SUM, group)


def all_reduce_max(group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce(t)``: the element-wise maximum of ``t`` over the processes of ``group``
    (the identity without a process group)."""
    return _all_reduce(dist.ReduceOp.MAX, group)


def _all_reduce(op, group) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(t: torch.Tensor) -> torch.Tensor:
        if not is_distributed():
            return t
        t = t.contiguous().clone()
        dist.all_reduce(t, op=op, group=group)
        return t

    return reduce


def gather_in_order(records: Sequence, key: Callable[[Any], int] = lambda r: r[0]) -> list:
    """All-gather records from every process, sorted by their index ``key(record)``
    (default: the first field of ``(index, ...)``).

    Objects travel pickled (``all_gather_object``), so floats arrive bit for bit. Every
    process receives the full list; an index reported twice is an error.
    """
    if not is_distributed():
        return sorted(records, key=key)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(records))
    merged = sorted((r for part in parts for r in part), key=key)
    indices = [key(r) for r in merged]
    if len(set(indices)) != len(indices):
        raise RuntimeError("two processes measured the same item: are the ranks consistent?")
    return merged


def map_population(
    items: Iterable[Any],
    fn: Callable[[Any], Any],
    out: str | os.PathLike | None = None,
) -> list[Any]:
    """``[fn(item) for item in items]`` split over the processes of the default group.

    Process ``rank`` calls ``fn`` on items ``rank, rank + world_size, ...`` (the items
    themselves, e.g. checkpoint paths or seeds, are cheap to list on every process); the
    results are gathered in item order and returned on every process. With ``out``,
    rank 0 writes them as one JSON list (``fn`` must return JSON-serialisable values,
    e.g. ``SharpnessResult.to_dict()``), atomically; all processes wait for the file.
    A single process (no process group) does the same work alone and writes the same
    file.
    """
    items = list(items)
    rank, world = rank_and_world()
    local = [(i, fn(items[i])) for i in range(rank, len(items), world)]
    results = [value for _, value in gather_in_order(local)]
    if out is not None:
        if rank == 0:
            write_json_atomic(out, results)
        if is_distributed():
            dist.barrier()
    return results
