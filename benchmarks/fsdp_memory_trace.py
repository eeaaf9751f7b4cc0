"""Where a sharded measure's peak memory lies: the resident size of each of 2 FSDP2
processes sampled every 2 ms through a training step or a measure, with marks at the
measure's evaluations and at the attention projections of two layers, and the size
left when it has returned, before and after ``malloc_trim`` (and the tensors it left
alive).

    python benchmarks/fsdp_memory_trace.py [--layers 11] [--json out.json]

The model is ``bench_llama_bf16.py``'s (TinyLlama-1.1B's width, ``--layers`` deep,
bfloat16 shards, FSDP2's default plan, 128 tokens, one thread per process, glibc
returning every freed block above 128 KiB). Per process and run (``step``: two training
steps with gradients of the attention only; ``geodesic-inv-attn``: 3 Auto-PGD steps):
the peak over its size after a warm-up step (MiB), the marks around the peak, the
resident size at each mark of the measure (between its steps: what it holds), and the
largest size between consecutive marks. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llama_bf16 import _reset_peak, _sharded_model, _status, loss, warm_up
from launching import MMAP_THRESHOLD, torchrun

MODES = ("step", "geodesic-inv-attn")


def _live_storages() -> dict[int, int]:
    """``{address: bytes}`` of the storages of the tensors Python holds."""
    import gc

    import torch

    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            out[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return out


def traced(mode: str, layers: int) -> dict | None:
    """One process's trace of ``mode`` (under ``torchrun``); the rows of rank 0 and 1."""
    import warnings

    import torch
    import torch.distributed as dist

    import geosharp
    from geosharp import distributed as gd

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rank, world = gd.init()
    model, ids, attention = _sharded_model(128, "default", layers)
    sizes = dict(model.named_parameters())
    vector = 4 * sum(sizes[n].to_local().numel() for n in attention) / 2**20
    warm_up(model, ids, attention)
    before = _live_storages()
    base = _reset_peak()
    samples: list[tuple[float, float]] = []
    marks: list[tuple[float, str, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append((time.perf_counter(), _status("VmRSS")))
            time.sleep(0.002)

    def mark(name: str) -> None:
        marks.append((time.perf_counter(), name, _status("VmRSS")))

    for layer in (0, len(model.model.layers) // 2):
        attn = model.model.layers[layer].self_attn
        for proj in ("q_proj", "o_proj"):
            where = f"layer {layer} {proj}"
            module = getattr(attn, proj)
            module.register_forward_pre_hook(lambda m, i, w=where: mark(f"forward {w}"))
            module.register_full_backward_pre_hook(lambda m, g, w=where: mark(f"backward {w}"))
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    if mode == "step":
        for i in range(2):
            mark(f"step {i} starts")
            loss(model, ids).backward()
            model.zero_grad(set_to_none=True)
            mark(f"step {i} ends")
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        mark("measure starts")
        geosharp.sharpness(
            model, [ids], loss, mode, None, geosharp.WorstCase(n_iters=3),
            callback=lambda event, i, it: mark(f"{event} {i}"),
        )  # fmt: skip
        mark("measure ends")
    done.set()
    thread.join()
    left = _live_storages()
    kept = sum(n for k, n in left.items() if k not in before)
    # _reset_peak: garbage collected, the heap handed back, the size then
    marks.append((time.perf_counter(), "after malloc_trim", _reset_peak()))
    at, peak = max(samples, key=lambda s: s[1])
    phases = []
    for (t0, a, _), (t1, b, _) in itertools.pairwise(marks):
        inside = [r for t, r in samples if t0 <= t < t1]
        if inside:
            phases.append((a, b, round(max(inside) - base, 1)))
    row = {
        "mode": mode,
        "rank": rank,
        "layers": layers,
        "vector_mib": vector,
        "peak_mib": round(peak - base, 1),
        "peak_between": [
            next((n for t, n, _ in reversed(marks) if t <= at), None),
            next((n for t, n, _ in marks if t > at), None),
        ],
        "at_marks": [
            (n, round(r - base, 1)) for _, n, r in marks if not n.startswith(("forward", "back"))
        ],
        "largest_phases": sorted(phases, key=lambda x: -x[2])[:6],
        "new_tensors_left_mib": kept / 2**20,
    }
    rows = [None] * world
    dist.all_gather_object(rows, row)
    model = None
    gd.close()
    return {"rows": rows} if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        out = traced(args.one, args.layers)
        if out is not None:
            print(json.dumps(out))
        return
    launcher, distributed = torchrun(29652)
    env = dict(os.environ, **distributed, **MMAP_THRESHOLD)
    rows = []
    for mode in MODES:
        done = subprocess.run(
            [*launcher, __file__, "--one", mode, "--layers", str(args.layers)],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        if done.returncode != 0:
            sys.exit(f"{mode} failed:\n{done.stderr}")
        found = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
        rows.extend(found)
        for r in found:
            print(
                f"{r['mode']:<18} rank {r['rank']}: peak {r['peak_mib']:.0f} MiB "
                f"({r['peak_mib'] / r['vector_mib']:.2f} vectors of {r['vector_mib']:.0f} MiB) "
                f"between {r['peak_between'][0]!r} and {r['peak_between'][1]!r}",
                flush=True,
            )
            for name, mib in r["at_marks"]:
                print(f"    at {name:<17} {mib:7.1f} MiB ({mib / r['vector_mib']:.2f} vectors)")
            print(f"    tensors made since the warm-up, alive: {r['new_tensors_left_mib']:.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
