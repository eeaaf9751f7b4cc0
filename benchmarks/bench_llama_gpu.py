"""LLaMA-shaped models in bfloat16 measured attention-only on one GPU: peak memory in
float32 vectors of the perturbed parameters beyond a training step, and time per
evaluation against one forward+backward, with the loop's own work (between two
evaluations) apart.

    python benchmarks/bench_llama_gpu.py --shape 1.1b --shape 7b --json out.json

Shapes: ``1.1b`` is TinyLlama-1.1B's (the CPU benchmark's, ``bench_llama_bf16.py``),
``7b`` LLaMA-2-7B's (32 layers, width 4096, 32 heads, MLP 11008, vocabulary 32,000),
the largest that fits one 80 GB GPU by the projection in docs/performance.md. Random
weights in bfloat16, built on the meta device and then given the GPU's memory; one
batch of ``--batch`` sequences of ``--tokens`` tokens. Rows, in one process per shape:
``step`` (forward and backward, gradients of the attention parameters only, the
training step the measure is compared with), ``step-float32-attention`` (the same with
the attention layers in float32, as a measure computes its perturbed layers: time
only), ``adaptive-attn`` and
``geodesic-inv-attn`` (3 Auto-PGD steps each; each also with its perturbed layers'
products in float32, ``(float32 products)``, as before they were split), and
``geodesic-inv-attn`` again with Hugging Face's activation checkpointing on
(``--checkpointed``). Memory: the peak of ``torch.cuda.max_memory_allocated`` over
the loaded model (the allocator's reserved peak beside it). Time: the median gap
between two evaluations of the measure (each timestamp after
``torch.cuda.synchronize``). Results are written after every row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llama_bf16 import FLOAT32, SHAPES, _products, build, check_perturbed, loss


def rows(
    shape: str, batch: int, tokens: int, checkpointed: bool, out: list, path: str | None,
    device: str = "cuda", peaks: bool = False,
):  # fmt: skip
    import torch

    import geosharp

    gpu = device == "cuda"
    memory = torch.cuda if gpu else None
    model, attention = build(shape, device)
    sizes = dict(model.named_parameters())
    perturbed = sum(sizes[n].numel() for n in attention)
    ids = torch.randint(0, 32000, (batch, tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    def stamp() -> float:
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    common = {
        "shape": shape,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "perturbed": perturbed,
        "batch": batch,
        "tokens": tokens,
    }
    modes = ["step", "step-float32-attention"] + [
        m + s for m in ("adaptive-attn", "geodesic-inv-attn") for s in ("", FLOAT32)
    ]
    if peaks:  # what is allocated at each measure's peak (recording slows it: no times)
        modes = ["step", "adaptive-attn", "geodesic-inv-attn"]
    if checkpointed:
        modes.append("geodesic-inv-attn+checkpointing")
    step_peak = None
    step_seconds = None
    for mode in modes:
        loaded = 0
        if gpu:
            memory.empty_cache()
            memory.synchronize()
            loaded = memory.memory_allocated()
            memory.reset_peak_memory_stats()
        row = {**common, "mode": mode, "loaded_gib": loaded / 2**30}
        if mode.startswith("step"):
            row["seconds"] = _step_seconds(model, attention, ids, loss, stamp, mode != "step")
        else:
            measure = _products(mode.split("+")[0])
            if mode.endswith("+checkpointing"):
                model.gradient_checkpointing_enable()
            stamps, starts = [], []

            def callback(event, i, iterate, stamps=stamps, starts=starts):
                if event == "evaluate":
                    starts.append(stamp())
                elif event == "evaluated":
                    stamps.append(stamp())

            if peaks and gpu:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            start = stamp()
            result = geosharp.sharpness(
                model, [ids], loss, measure, None, geosharp.WorstCase(n_iters=3),
                callback=callback,
            )  # fmt: skip
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            own = [b - a for a, b in zip(stamps, starts[1:])]
            row.update(
                seconds=statistics.median(gaps),
                seconds_evaluation=statistics.median(b - a for a, b in zip(starts, stamps)),
                seconds_own_work=statistics.median(own),
                evaluations=len(stamps),
                seconds_total=stamp() - start,
                seconds_before_first_evaluation=stamps[0] - start,
                value=result.value,
                precision=result.settings["precision"],
                pairs=result.settings["n_pairs"],
                checkpointing=result.settings.get("checkpointing"),
            )
            check_perturbed(result, perturbed)
            if peaks and gpu:
                trace = torch.cuda.memory._snapshot()["device_traces"][memory.current_device()]
                torch.cuda.memory._record_memory_history(enabled=None)
                row["peak_breakdown"] = peak_breakdown(trace, 4 * perturbed)
                for where, vectors in row["peak_breakdown"]:
                    print(f"  {vectors:6.2f} vectors  {where}", flush=True)
            if mode.endswith("+checkpointing"):
                model.gradient_checkpointing_disable()
        peak = memory.max_memory_allocated() - loaded if gpu else 0
        row.update(
            peak_growth_gib=peak / 2**30,
            peak_reserved_gib=memory.max_memory_reserved() / 2**30 if gpu else 0,
        )
        if mode == "step":
            step_peak, step_seconds = peak, row["seconds"]
        vector = 4 * perturbed
        row["buffers_beyond_step"] = (peak - step_peak) / vector
        row["step_over_forward_backward"] = row["seconds"] / step_seconds
        print(json.dumps(row), flush=True)
        out.append(row)
        if path:
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    del model
    if gpu:
        memory.empty_cache()


def live_at_peak(events) -> tuple[int, dict, object]:
    """``(highest, live, last)`` over ``events``, ``(address, bytes, what)`` in time
    order (``bytes > 0`` an allocation, ``< 0`` a free, its size taken from the
    allocation): the highest total of the allocations live at once, ``{address:
    (bytes, what)}`` of those live then, and the ``what`` of the allocation that
    reached it."""
    live: dict[int, tuple[int, object]] = {}
    total, highest, at_peak, last = 0, -1, {}, None
    for address, size, what in events:
        if size > 0:
            live[address] = (size, what)
            total += size
            if total > highest:
                highest, at_peak, last = total, dict(live), what
        elif address in live:
            total -= live.pop(address)[0]
    return highest, at_peak, last


def peak_breakdown(trace: list[dict], vector: int, top: int = 14) -> list:
    """The allocations live at the highest point of a CUDA allocator trace (allocated
    while it recorded), grouped by the innermost geosharp (else transformers, else
    torch) frame that made them, in ``vector``-sized units, largest first."""
    highest, at_peak, _ = live_at_peak(
        (e["addr"], e["size"] if e["action"] == "alloc" else -1, e)
        for e in trace
        if e["action"] in ("alloc", "free_completed")
    )
    groups: dict[str, int] = {}
    for _, event in at_peak.values():
        frames = event.get("frames", [])
        frame = next(
            (f for key in ("geosharp", "transformers", "torch") for f in frames
             if f"/{key}/" in f["filename"]), None,
        )  # fmt: skip
        where = "?" if frame is None else (
            f"{frame['filename'].rsplit('/', 2)[-2]}/{frame['filename'].rsplit('/', 1)[-1]}"
            f":{frame['line']} {frame['name']}"
        )  # fmt: skip
        groups[where] = groups.get(where, 0) + event["size"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return [[w, b / vector] for w, b in ranked[:top]] + [["total", highest / vector]]


def _step_seconds(model, attention, ids, loss, stamp, float32: bool) -> float:
    """The median time of a training forward+backward (gradients of the attention
    parameters only); ``float32``: with the attention layers' weights in float32, each
    computing in float32 as a measure's perturbed layers do (what the measure's
    evaluations cost at best)."""
    import torch

    from geosharp.params import computing_in_float32, owning_modules

    names = set(attention)
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    named = [(n, p) for n, p in model.named_parameters() if n in names]
    owners = [m for m, _ in owning_modules(model, named).values()] if float32 else []
    for module in owners:
        module.float()
    times = []
    with computing_in_float32(owners, torch.bfloat16 if float32 else None):
        for _ in range(4):
            start = stamp()
            loss(model, ids).backward()
            times.append(stamp() - start)
            model.zero_grad(set_to_none=True)
    for module in owners:
        module.to(torch.bfloat16)
    for p in model.parameters():
        p.requires_grad_(True)
    return statistics.median(times[1:])  # the first warms up


def report(results: list[dict]) -> str:
    """The rows as a table (``step-float32-attention`` is timed only: its float32 weights
    and gradients are not a measure's vectors)."""
    lines = [
        "| shape | run | loaded (GiB) | peak growth (GiB) | peak allocated (GiB) | float32 "
        "vectors of the perturbed beyond the step | time per evaluation | loop's own work | "
        "x forward+backward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        vectors = "" if r["mode"] == "step-float32-attention" else f"{r['buffers_beyond_step']:.2f}"
        own = f"{r['seconds_own_work'] * 1e3:.0f} ms" if "seconds_own_work" in r else ""
        lines.append(
            f"| {r['shape'].upper()} | {r['mode']} | {r['loaded_gib']:.1f} | "
            f"{r['peak_growth_gib']:.1f} | {r['loaded_gib'] + r['peak_growth_gib']:.1f} | "
            f"{vectors} | {r['seconds'] * 1e3:.0f} ms | {own} | "
            f"{r['step_over_forward_backward']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--checkpointed", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--peaks", action="store_true",
        help="instead of timing: what is allocated at each measure's peak, by source line",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a dry run
    parser.add_argument(
        "--report", nargs="+", default=None, help="print the table of results files"
    )
    args = parser.parse_args()
    if args.report:
        results = []
        for path in args.report:
            with open(path) as f:
                results += json.load(f)
        print(report(results))
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_llama_gpu.py: no GPU (torch.cuda.is_available() is False)")
    warnings.simplefilter("ignore")
    out: list[dict] = []
    for shape in args.shape or ["1.1b"]:
        rows(
            shape, args.batch, args.tokens, args.checkpointed, out, args.json, args.device,
            args.peaks,
        )  # fmt: skip
    print(report(out))


if __name__ == "__main__":
    main()
