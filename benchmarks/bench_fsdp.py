"""Sharpness of an FSDP2-sharded model: memory per process and time per step, at 1, 2
and 4 processes (``torchrun``, gloo on the CPU, one thread each).

    python benchmarks/bench_fsdp.py                  # BERT, 6 layers, hidden 384 (14M)
    python benchmarks/bench_fsdp.py --quick          # a smaller model
    python benchmarks/bench_fsdp.py --out results.json
    python benchmarks/bench_fsdp.py --mmap-threshold # count held memory, not the heap's
    python benchmarks/bench_fsdp.py --model bert-384-h6 --nproc 4 --plan default
                                 # FSDP2's default plan, which cuts every other head

For every number of processes and every measure (adaptive, ``geodesic-inv``,
``geodesic-mix``; geosharp's Auto-PGD and the reference's restart, which keeps the best
point's gradient: ``--modes default,kept-gradient``) one fresh ``torchrun`` launch
shards the model with :func:`geosharp.fsdp.shard` (``--plan rows``: every pair row on
one process) or with FSDP2's default plan, ``Shard(0)`` of each layer and then the root
(``--plan default``: with more processes than heads divide into, rows are cut and move
through the exchange buffer of :mod:`geosharp.geometry.sharded`; the pairs found before
sharding are passed), and, on every process:

* times the sharded model's forward+backward (median of 3 after a warm-up): the
  reference step;
* returns free heap memory to the system (``malloc_trim``), resets the peak resident
  size (``/proc/self/clear_refs``) and records the rise of the peak over the resident
  size, for one training forward+backward (``train``) or one ``sharpness`` call;
* times each Auto-PGD step through ``sharpness(..., callback=...)`` (from one
  evaluation to the next).

Memory is reported in parameter-sized buffers *of this process's shard*:
``(peak_measure - peak_train) / local parameter bytes``, the largest over processes;
time per step as the median step over the reference forward+backward of the same
launch. With more processes than cores (4 on this 2-core machine) every process runs
slower, alike for the step and its reference.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import statistics
import time
from pathlib import Path

from bench_targets import _rss_status  # the peak and resident sizes, as there
from launching import MMAP_THRESHOLD, run_json

MEASURES = {"adaptive": 0.05, "geodesic-inv": 0.05, "geodesic-mix": 0.01}
MODELS = {  # hidden, layers, heads, intermediate, vocab, batch, tokens
    "bert-384": (384, 6, 12, 1536, 8192, 8, 64),
    "quick": (128, 2, 4, 512, 2048, 4, 32),
    "bert-384-h6": (384, 6, 6, 1536, 8192, 8, 64),  # heads of 64 rows: cut on 4 processes
    "bert-384-l12": (384, 12, 12, 1536, 8192, 8, 64),  # twice as deep: a layer half the share
    "bert-384-v1k": (384, 6, 12, 1536, 1024, 8, 64),  # an eighth of the vocabulary
    "bert-base": (768, 12, 12, 3072, 30522, 8, 128),  # for pair_state_bytes.py
}


def bert(name: str, batch: int | None = None):
    """The BERT ``name`` of :data:`MODELS` (seeded, eager attention) and a batch of
    random tokens and labels (``batch`` sequences, the table's by default)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    hidden, layers, heads, inter, vocab, rows, tokens = MODELS[name]
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        max_position_embeddings=tokens,
        attn_implementation="eager",
    )
    g = torch.Generator().manual_seed(1)
    data = {
        "input_ids": torch.randint(0, vocab, (batch or rows, tokens), generator=g),
        "labels": torch.randint(0, 2, (batch or rows,), generator=g),
    }
    return BertForSequenceClassification(config), data


def _reset_peak() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_status()["VmRSS"]


def loss_fn(model, batch):
    return model(**batch).loss


def sharded(name: str, plan: str = "rows"):
    """The BERT ``name`` sharded over the process group (``plan``: ``"rows"``,
    :func:`geosharp.fsdp.shard`'s; ``"default"``, FSDP2's ``Shard(0)`` of each layer and
    then the root), in eval mode: ``(model, batch, symmetries, local parameter bytes)``,
    the pairs found before sharding."""
    import geosharp
    from geosharp import fsdp

    model, data = bert(name)
    symmetries = geosharp.find_symmetries(model, data, loss_fn=loss_fn)
    if plan == "rows":
        fsdp.shard(model, symmetries)
    else:  # FSDP2's default: Shard(0) everywhere
        from torch.distributed.fsdp import fully_shard

        for layer in model.bert.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
    model.eval()
    return model, data, symmetries, sum(p.to_local().numel() * 4 for p in model.parameters())


def child(args) -> None:
    """One process of a launch: prints its JSON record (rank 0 gathers them)."""
    import torch
    import torch.distributed as dist

    import geosharp
    from geosharp import distributed as gd

    torch.set_num_threads(1)
    rank, world = gd.init()
    model, data, symmetries, local_bytes = sharded(args.model, args.plan)

    def train_step():
        model.zero_grad(set_to_none=True)
        loss_fn(model, data).backward()

    train_step()
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    from reference import restart_rule

    def measure(n_iters: int, callback=None) -> None:
        with restart_rule(args.kept_gradient):
            geosharp.sharpness(
                model,
                [data],
                loss_fn,
                args.mode,
                rho=MEASURES[args.mode],
                symmetries=symmetries,
                callback=callback,
                estimator=geosharp.WorstCase(n_iters=n_iters),
            )

    if args.warm and args.mode != "train":
        measure(1)  # what a first call pays once is paid before the peak is reset
    base = _reset_peak()
    record = {"rank": rank, "local_bytes": local_bytes, "fb": statistics.median(times)}
    if args.mode == "train":
        train_step()
        model.zero_grad(set_to_none=True)
    else:
        starts = []

        def callback(event, i, x):
            if event == "evaluate":
                starts.append(time.perf_counter())

        measure(args.n_iters, callback)
        steps = [b - a for a, b in itertools.pairwise(starts)]
        record["step"] = statistics.median(steps)
    record["rise"] = _rss_status()["VmHWM"] - base
    parts = [None] * world
    dist.all_gather_object(parts, record)
    if rank == 0:
        print(json.dumps(parts), flush=True)
    model = None  # the sharded model released before the process group ends
    gd.close()


def launch(nproc: int, mode: str, args) -> list[dict]:
    cmd = [
        __file__, "--child", mode, "--model", args.model, "--n-iters", str(args.n_iters),
        "--plan", args.plan, *(["--kept-gradient"] if args.kept_gradient else []),
        *(["--warm"] if args.warm else []),
    ]  # fmt: skip
    env = MMAP_THRESHOLD if args.mmap_threshold else {}
    return run_json(cmd, nproc, 29600 + nproc, env, marker="[{", tries=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model")
    parser.add_argument("--model", default=None, choices=sorted(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--nproc", default="1,2,4", help="numbers of processes")
    parser.add_argument("--n-iters", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--mmap-threshold",
        action="store_true",
        help="map every allocation above 128 KiB (MALLOC_MMAP_THRESHOLD_=131072), so that "
        "freed memory leaves the process and the peak counts what is held, not what the "
        "allocator keeps",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="run each measure once (one step) before the peak is reset, so that what a "
        "process's first call pays once (code and libraries loaded, the allocator's "
        "pools) is not counted as the measure's buffers",
    )
    parser.add_argument(
        "--plan",
        default="rows",
        choices=("rows", "default"),
        help="geosharp.fsdp.shard's plan (rows whole) or FSDP2's default Shard(0)",
    )
    parser.add_argument("--measures", default=",".join(MEASURES), help="measures to run")
    parser.add_argument(
        "--modes",
        default="default,kept-gradient",
        help="default (geosharp's Auto-PGD), kept-gradient (the reference's restart) or both",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kept-gradient", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from reference import rule_name

    args.model = args.model or ("quick" if args.quick else "bert-384")
    if args.child:
        args.mode = args.child
        child(args)
        return
    rows = []
    print(
        f"model {args.model}, plan {args.plan}, {args.n_iters} Auto-PGD steps, gloo, one "
        "thread per process"
        + (", MALLOC_MMAP_THRESHOLD_=131072" if args.mmap_threshold else "")
        + (", each measure run once before its peak is reset" if args.warm else "")
    )
    print("processes  measure          mode           buffers/process  step/fwd+bwd")
    for nproc in [int(n) for n in args.nproc.split(",")]:
        train = launch(nproc, "train", args)
        for measure in args.measures.split(","):
            for mode in args.modes.split(","):
                args.kept_gradient = mode == "kept-gradient"
                parts = launch(nproc, measure, args)
                buffers = max(
                    (p["rise"] - t["rise"]) / p["local_bytes"] for p, t in zip(parts, train)
                )
                ratio = statistics.median(p["step"] / p["fb"] for p in parts)
                row = {
                    "processes": nproc,
                    "measure": measure,
                    "restart": rule_name(args.kept_gradient),
                    "buffers_per_process": round(buffers, 2),
                    "step_over_forward_backward": round(ratio, 3),
                    "local_parameter_bytes": max(p["local_bytes"] for p in parts),
                    "raw": parts,
                    "train": train,
                }
                rows.append(row)
                print(f"{nproc:9d}  {measure:15s}  {mode:13s}  {buffers:15.2f}  {ratio:12.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "n_iters": args.n_iters,
                                        "plan": args.plan,
                                        "mmap_threshold": args.mmap_threshold,
                                        "warm": args.warm,
                                        "rows": rows}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
