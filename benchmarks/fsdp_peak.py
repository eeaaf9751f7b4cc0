"""What is alive at the peak of a sharded measure: torch's CPU allocations of one process
(rank 0) through a training step and through a measure, at the moment their total is
largest, grouped by where they were made.

    python benchmarks/fsdp_peak.py [--nproc 4] [--measure adaptive] [--json out.json]
    python benchmarks/fsdp_peak.py --model bert-384-h6 --plan default  # heads cut

The model is ``bench_fsdp.py``'s BERT (``--model``; ``--plan rows``,
:func:`geosharp.fsdp.shard`'s, or FSDP2's ``default``), one thread per process,
glibc mapping every block above 128 KiB. Each launch warms up (a step and a one-step
measure), then records with ``torch.profiler`` (``profile_memory``, Python stacks) one
training forward+backward and one ``sharpness`` call of 2 Auto-PGD steps, twice: as
geosharp runs it, and with FSDP2 gathering every layer for forward and backward as it
would for a training step (the code before geosharp stopped those gathers for the
layers whose parameters are all perturbed). Reported per run: the peak of the live
allocations over the run's start, in buffers of this process's shard, when it came
(the module whose forward or backward ran), and the allocations alive then, by the last
frame of geosharp, FSDP or ``transformers`` that made them. Allocation counts only:
what glibc keeps is not here (``bench_fsdp.py`` counts the resident size), nor what
is freed on a thread the profiler does not follow (left out, its total reported).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fsdp import MEASURES, MODELS, loss_fn, sharded
from bench_llama_gpu import live_at_peak
from launching import MMAP_THRESHOLD, run_json

RUNS = ("step", "measure", "measure, FSDP gathers every layer")


def _allocations(prof) -> list[tuple[int, int, int, tuple[str, ...]]]:
    """``(time ns, address, bytes, stack)`` of every allocation (bytes > 0) and free
    (bytes < 0) the profile recorded, in time order."""
    out = []

    def walk(node, stack):
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation":
            out.append((node.start_time_ns, fields.ptr, fields.alloc_size, stack))
        for child in node.children:
            walk(child, (*stack, node.name))

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, ())
    return sorted(out, key=lambda r: r[0])


def _site(stack: tuple[str, ...]) -> str:
    """The innermost frame of FSDP, geosharp or ``transformers`` (else the op)."""
    for frame in reversed(stack):
        if frame.startswith("FSDP::") or "torch/distributed/fsdp/" in frame:
            return "FSDP: " + frame.split("): ")[-1].removeprefix("FSDP::")
        for mark in ("geosharp/", "transformers/"):
            if mark in frame:
                return frame.split(mark, 1)[1]
    return stack[-1] if stack else "?"


def _module(stack: tuple[str, ...]) -> str:
    """The innermost module whose forward, or FSDP hook, the stack is in."""
    for frame in reversed(stack):
        if frame.startswith("nn.Module: ") or frame.startswith("FSDP::"):
            return frame.removeprefix("nn.Module: ")
        if "autograd::engine::evaluate_function" in frame:
            return "backward: " + frame.split(": ", 1)[1]
    return "?"


def peak(prof, local: int) -> dict:
    """The peak of live allocations and what was alive then. An allocation whose free
    the profile did not see (its address allocated again, or the run ended first) was
    freed on a thread the profiler does not follow (gloo's worker releases a
    collective's tensors): it is left out, and its bytes reported."""
    events = _allocations(prof)
    freed, last = set(), {}
    for i, (_, ptr, size, _) in enumerate(events):
        if size < 0 and ptr in last:
            freed.add(last.pop(ptr))
        elif size > 0:
            last[ptr] = i
    top, at, when = live_at_peak(
        (ptr, size, stack)
        for i, (_, ptr, size, stack) in enumerate(events)
        if size < 0 or i in freed
    )
    unseen = sum(e[2] for i, e in enumerate(events) if e[2] > 0 and i not in freed)
    sites = collections.Counter()
    for size, stack in at.values():
        sites[_site(stack)] += size
    return {
        "peak": round(top / local, 3),
        "at": _module(when or ()),
        "alive": [
            (site, round(b / local, 3)) for site, b in sites.most_common() if b > 0.02 * local
        ],
        "free_unseen": round(unseen / local, 3),
    }


def child(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import geosharp
    from geosharp import distributed as gd
    from geosharp.measures import fsdp as measures_fsdp

    torch.set_num_threads(1)
    rank, _ = gd.init()
    model, data, symmetries, local = sharded(args.model, args.plan)

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model, data).backward()
        model.zero_grad(set_to_none=True)

    def measure(n_iters: int) -> None:
        geosharp.sharpness(
            model, [data], loss_fn, args.measure, rho=MEASURES[args.measure],
            symmetries=symmetries, estimator=geosharp.WorstCase(n_iters=n_iters),
        )  # fmt: skip

    step()
    measure(1)
    found = measures_fsdp._groups_within
    out = {}
    for run in RUNS:
        if run == RUNS[2]:  # FSDP left to gather every layer, as for training
            measures_fsdp._groups_within = lambda model, ids: []
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as p:
            step() if run == "step" else measure(2)
        out[run] = peak(p, local)
        measures_fsdp._groups_within = found
    if rank == 0:
        print(json.dumps({"local_bytes": local, "runs": out}), flush=True)
    model = None
    gd.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--measure", default="adaptive", choices=sorted(MEASURES))
    parser.add_argument("--model", default="bert-384", choices=sorted(MODELS))
    parser.add_argument("--plan", default="rows", choices=("rows", "default"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cmd = [__file__, "--child", "--measure", args.measure, "--model", args.model,
           "--plan", args.plan]  # fmt: skip
    result = {"model": args.model, "measure": args.measure, "processes": args.nproc,
              "plan": args.plan,
              **run_json(cmd, args.nproc, 29650, MMAP_THRESHOLD)}  # fmt: skip
    print(
        f"model {args.model}, {args.measure}, {args.nproc} processes (rank 0), "
        f"{args.plan} plan, "
        "torch's CPU allocations, in buffers of the process's shard"
    )
    for run, row in result["runs"].items():
        print(
            f"{run}: peak {row['peak']:.2f}, in {row['at']} (left out, freed off the "
            f"profiled threads: {row['free_unseen']:.2f})"
        )
        for site, share in row["alive"]:
            print(f"    {share:6.3f}  {site}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
