"""Where a sharded Auto-PGD step's time goes beyond a forward+backward: the same BERT and
batch (``bench_fsdp.py``'s) measured unsharded in one process and sharded with
:func:`geosharp.fsdp.shard` over 1 and 2 processes, and the operators that a step
spends more on than a training forward+backward of the sharded model.

    python benchmarks/fsdp_step_cost.py [--nproc 1,2] [--json out.json]

Each launch (one thread per process) times 5 forward+backwards (median) and the steps
of an 8-step measure after a 1-step warm-up (median, from one evaluation to the next).
On process 0 of the 1-process launch, ``torch.profiler`` then records 3 training
forward+backwards and measures of 1 and 5 steps: the per-step self time of each
operator is the difference of the two measures over 4, set beside the per-call time of
a forward+backward (the profiler's own cost inflates small operators alike in both).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

from bench_fsdp import MEASURES, bert, loss_fn, sharded
from launching import run_json

MODEL = "bert-384"


def _times(model, data, measure, symmetries):
    """Median forward+backward and median Auto-PGD step (seconds), and the functions
    that run a measure and a training forward+backward."""
    import geosharp

    def train():
        model.zero_grad(set_to_none=True)
        loss_fn(model, data).backward()

    for _ in range(2):
        train()
    fb = []
    for _ in range(5):
        t = time.perf_counter()
        train()
        fb.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    starts = []

    def callback(event, i, x):
        if event == "evaluate":
            starts.append(time.perf_counter())

    def run(n, cb=None):
        geosharp.sharpness(
            model, [data], loss_fn, measure, rho=MEASURES[measure], symmetries=symmetries,
            callback=cb, estimator=geosharp.WorstCase(n_iters=n),
        )  # fmt: skip

    run(1)
    run(8, callback)
    steps = [b - a for a, b in itertools.pairwise(starts)]
    return statistics.median(fb), statistics.median(steps), run, train


def _profile(run, train) -> list[list]:
    """``[operator, step ms, calls per step, forward+backward ms, calls]``, largest
    difference first."""
    from torch.profiler import ProfilerActivity, profile

    def table(fn) -> dict:
        with profile(activities=[ProfilerActivity.CPU]) as p:
            fn()
        return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in p.key_averages()}

    fb = table(lambda: [train() for _ in range(3)])
    one, five = table(lambda: run(1)), table(lambda: run(5))
    rows = []
    for key, (ms, n) in five.items():
        a_ms, a_n = one.get(key, (0.0, 0))
        t_ms, t_n = fb.get(key, (0.0, 0))
        rows.append([key, (ms - a_ms) / 4, (n - a_n) / 4, t_ms / 3, t_n / 3])
    rows.sort(key=lambda r: -abs(r[1] - r[3]))
    return rows


def child(measure: str, plain: bool) -> None:
    import torch

    torch.set_num_threads(1)
    if plain:
        import geosharp

        model, data = bert(MODEL)
        model.eval()
        symmetries = geosharp.find_symmetries(model, data, loss_fn=loss_fn)
        fb, step, _, _ = _times(model, data, measure, symmetries)
        print(json.dumps({"fb": fb, "step": step}), flush=True)
        return
    import torch.distributed as dist

    from geosharp import distributed as gd

    rank, world = gd.init()
    model, data, symmetries, _ = sharded(MODEL)
    fb, step, run, train = _times(model, data, measure, symmetries)
    record = {"fb": fb, "step": step}
    if world == 1:
        record["profile"] = _profile(run, train)
    parts = [None] * world
    dist.all_gather_object(parts, record)
    if rank == 0:
        print(json.dumps(parts[0] | {"steps": [p["step"] for p in parts]}), flush=True)
    model = None
    gd.close()


def launch(nproc: int | None, measure: str) -> dict:
    """One launch: ``nproc`` processes, or the unsharded model in one (``None``)."""
    cmd = [__file__, "--child", measure, *(["--plain"] if nproc is None else [])]
    return run_json(cmd, nproc, 29700 + (nproc or 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--measures", default="adaptive,geodesic-inv")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.plain)
        return
    out = {}
    print(f"{MODEL}, batch 8 x 64 tokens, one thread per process; step / forward+backward")
    for measure in args.measures.split(","):
        runs = {"unsharded": launch(None, measure)}
        for n in [int(x) for x in args.nproc.split(",")]:
            runs[f"sharded x{n}"] = launch(n, measure)
        for name, r in runs.items():
            print(
                f"{measure:14s} {name:12s} forward+backward {r['fb'] * 1e3:6.1f} ms  "
                f"step {r['step'] * 1e3:6.1f} ms  {r['step'] / r['fb']:.3f}x"
                f"  (of the unsharded forward+backward: "
                f"{r['step'] / runs['unsharded']['fb']:.3f}x)"
            )
        profile = runs["sharded x1"].get("profile", []) if "sharded x1" in runs else []
        if profile:
            extra = sum(r[1] for r in profile) - sum(r[3] for r in profile)
            print(f"  1 process, profiled self time: step minus forward+backward {extra:.1f} ms")
            print(f"  {'operator':52s} {'step ms':>8s} {'calls':>6s} {'f+b ms':>8s} {'calls':>6s}")
            for key, ms, n, t_ms, t_n in profile[:16]:
                print(f"  {key[:52]:52s} {ms:8.2f} {n:6.0f} {t_ms:8.2f} {t_n:6.0f}")
        out[measure] = runs
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
