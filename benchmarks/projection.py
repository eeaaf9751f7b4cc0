"""Memory per process for LLaMA-2-7B and -70B sharded over 8 GPUs of 80 GB, computed
from the buffers per process measured by ``bench_fsdp.py`` (its JSON output).

    python benchmarks/projection.py docs/results/fsdp/bench_fsdp_mmap.json

Prints the two Markdown tables of ``docs/performance.md`` ("Sharded models"): the
benchmark's rows, and the projection. Per process,
in GB (1e9 bytes), leaving activations aside (they depend on the batch and on
activation checkpointing):

* the model's float32 shards and one training step's gradients, ``4 P / 8`` each
  (the gradients counted are the whole model's, as a training step makes them: the
  measure itself makes those of the perturbed only);
* the measure: ``b x 4 P_perturbed / 8``, ``b`` the buffers per process measured at the
  largest number of processes of the benchmark (worst over adaptive, ``inv`` and
  ``mix``), but at least what the measure holds by construction (:data:`HELD`: the
  perturbation, its previous and best values; one more with the kept gradient), for
  the whole model and for the attention pairs only. The count measured on the
  benchmark's BERT of 6 layers can be lower: its baseline, a training step, holds
  FSDP's gathers of whole layers, which the measure does not make, and a layer is an
  eighth of that model but an 80th of LLaMA-2-70B;
* random starts and directions are drawn per process, a block of 2^20 numbers (4 MiB)
  at a time (:mod:`geosharp.geometry.draws`): nothing of the parameters' size.

Float32 shards only: bfloat16 shards, measured on a 1.1B LLaMA, are projected by
``bench_llama_bf16.py --report ... --sharded-report ...``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from reference import KEPT  # benchmarks/ is on the path: run as a script, or from the tests

GPUS, GPU_GB = 8, 80
HELD = {False: 3.0, True: 4.0}  # float32 vectors beyond a training step, by construction
MODELS = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "LLaMA-2-7B": (4096, 32, 32, 32, 11008, 32000),
    "LLaMA-2-70B": (8192, 80, 64, 8, 28672, 32000),
}


def counts(hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int):
    """(all parameters, attention pair parameters) of a LLaMA-2 configuration."""
    head = hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv * head  # q, o; k, v
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden, layers * attention


def measured(bench: dict) -> str:
    """The benchmark's rows as a Markdown table: buffers per process (geosharp's
    Auto-PGD; the reference's restart, which keeps the best point's gradient) and step
    over forward+backward, per number of processes."""
    rows = bench["rows"]
    lines = [
        "| processes | measure | buffers per process, default (kept gradient) "
        "| step / forward+backward, default (kept gradient) |",
        "|---|---|---|---|",
    ]
    keys = sorted({(r["processes"], r["measure"]) for r in rows}, key=lambda k: k[0])
    order = list(dict.fromkeys(r["measure"] for r in rows))
    for nproc, measure in sorted(keys, key=lambda k: (k[0], order.index(k[1]))):
        pick = {kept(r): r for r in rows if (r["processes"], r["measure"]) == (nproc, measure)}
        lines.append(
            f"| {nproc} | {measure} | {pick[False]['buffers_per_process']:.2f} "
            f"({pick[True]['buffers_per_process']:.2f}) "
            f"| {pick[False]['step_over_forward_backward']:.2f} "
            f"({pick[True]['step_over_forward_backward']:.2f}) |"
        )
    return "\n".join(lines)


def table(bench: dict) -> str:
    rows = bench["rows"]
    top = max(r["processes"] for r in rows)
    worst = {
        k: max(r["buffers_per_process"] for r in rows if r["processes"] == top and kept(r) == k)
        for k in (False, True)
    }
    lines = [
        "| model | perturbed | parameters | model + gradients | measure, default (kept gradient) "
        "| total, default (kept gradient) |",
        "|---|---|---|---|---|---|",
    ]
    used = {k: max(worst[k], HELD[k]) for k in worst}
    for name, config in MODELS.items():
        total, attention = counts(*config)
        base = 2 * 4 * total / GPUS / 1e9
        for what, p in (("all", total), ("attention", attention)):
            per = 4 * p / GPUS / 1e9
            a, b = used[False] * per, used[True] * per
            lines.append(
                f"| {name} | {what} | {p / 1e9:.2f}B | {base:.1f} | {a:.1f} ({b:.1f}) "
                f"| {base + a:.1f} ({base + b:.1f}) |"
            )
    lines.append("")
    lines.append(
        f"GB per process of {GPU_GB} GB, {GPUS} processes; buffers per process measured at "
        f"{top} processes: {worst[False]:.2f} (default), {worst[True]:.2f} (kept gradient); "
        f"counted: {used[False]:.2f} and {used[True]:.2f}."
    )
    return "\n".join(lines)


def kept(row: dict) -> bool:
    """Whether ``row`` was measured with the reference's restart (the best point's
    gradient kept: ``bench_fsdp.py --modes kept-gradient``)."""
    return row["restart"] == KEPT


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/fsdp/bench_fsdp_mmap.json")
    bench = json.loads(path.read_text())
    print(measured(bench))
    print()
    print(table(bench))
