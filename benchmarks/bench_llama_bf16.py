"""A LLaMA-shaped model of about 1B parameters in bfloat16, measured attention-only on
the CPU: memory in float32 buffers of the perturbed parameters, and time per Auto-PGD
step against one forward+backward.

    python benchmarks/bench_llama_bf16.py [--json out.json] [--tokens 128] [--kept-gradient]
    python benchmarks/bench_llama_bf16.py --fsdp [--plan rows] --json fsdp.json
    python benchmarks/bench_llama_bf16.py --report a.json [b.json ...] --sharded-report fsdp.json

The shape is TinyLlama-1.1B's (22 layers, width 2048, 32 query and 4 key/value heads,
MLP 5632, vocabulary 32,000), random weights in bfloat16, one batch of ``--tokens``
tokens. Each row runs in a process of its own (2 threads): ``step`` is the training
step the measure is compared with (forward and backward, gradients of the attention
parameters only); ``adaptive-attn`` and ``geodesic-inv-attn`` measure 3 Auto-PGD steps.
Reported: the growth of the peak resident size over the loaded model, the measure's
growth beyond the step's in float32 vectors of the perturbed parameters, and the median
time between two evaluations of the measure over the step's time. Run on a quiet
machine.

``--layers N``: the same width, ``N`` layers deep.

``--fsdp``: the same on 2 processes (``torchrun``, gloo, one thread each), the model
built on the meta device and sharded there (FSDP2's default plan, or with ``--plan
rows`` :func:`geosharp.fsdp.shard`'s), bfloat16 shards; its pairs found on its
structure (``symmetries=`` not passed). Memory is each process's rise of its peak
resident size over its size after a warm-up step, in float32 vectors of its slices of
the perturbed parameters; the largest over the processes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from launching import MMAP_THRESHOLD, torchrun

SHAPES = {
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4),  # TinyLlama-1.1B
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32),  # LLaMA-2-7B
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),  # a dry run
}  # fmt: skip
"""The LLaMA shapes benchmarked here and in ``bench_llama_gpu.py`` (vocabulary 32,000)."""


def config(shape: str, layers: int | None = None):
    """The ``LlamaConfig`` of ``shape``; ``layers`` overrides its depth."""
    import transformers as tf

    made = dict(SHAPES[shape], **({} if layers is None else {"num_hidden_layers": layers}))
    return tf.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **made)


def _random_(model, config) -> None:
    """Random bfloat16-scale weights (normal, std 0.02) on this process's slices, and the
    rotary frequencies, which ``to_empty`` leaves unset, made again."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            getattr(p, "to_local", lambda p=p: p)().normal_(0, 0.02)
        rotary = model.model.rotary_emb
        for name, buffer in type(rotary)(config).named_buffers():
            rotary.get_buffer(name).copy_(buffer)
    model.eval()


def attention_of(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".self_attn." in n]


def build(shape: str, device: str, layers: int | None = None):
    """The model of ``shape`` (``layers`` deep, if given) in bfloat16 on ``device`` (built
    on the meta device, random weights), and the names of its attention parameters."""
    import torch
    import transformers as tf

    made = config(shape, layers)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(made).to(torch.bfloat16)
    model.to_empty(device=device)
    torch.manual_seed(0)
    _random_(model, made)
    return model, attention_of(model)


def _ids(tokens: int):
    import torch

    return torch.randint(0, 32000, (1, tokens), generator=torch.Generator().manual_seed(1))


def _model(tokens: int, layers: int | None = None):
    model, attention = build("1.1b", "cpu", layers)
    return model, _ids(tokens), attention


def check_perturbed(result, perturbed: int) -> None:
    """Refuse a row whose measure perturbed other entries than the attention's (a pair
    found but not verified leaves an attention-only measure's parameters out): its
    vectors would be counted in the wrong unit."""
    if result.settings["n_perturbed"] != perturbed:
        raise SystemExit(
            f"the measure perturbed {result.settings['n_perturbed']:,} entries, the attention "
            f"has {perturbed:,}: {result.settings['n_pairs']} pairs were used"
        )


def loss(m, batch):
    """The causal LM's loss on ``batch`` (its inputs are its labels), in float32."""
    return m(input_ids=batch, labels=batch).loss.float()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _sharded_model(tokens: int, plan: str, layers: int | None = None):
    """The same shape built on the meta device and sharded there, each layer and then
    the root, with FSDP2's default plan (``plan="default"``: ``Shard(0)``, whole heads
    on each of 2 processes) or :func:`geosharp.fsdp.shard`'s (``"rows"``: the query,
    key and value weights along their input features, every head's rows split), then
    given this process's slices only (random, bfloat16)."""
    import torch
    import transformers as tf
    from torch.distributed.fsdp import fully_shard

    import geosharp
    from geosharp import fsdp

    made = config("1.1b", layers)
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(made).to(torch.bfloat16)
    if plan == "rows":  # the pairs found on the structure (no values on the meta device)
        fsdp.shard(model, geosharp.find_symmetries(model, warn=False))
    else:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(int(os.environ.get("RANK", "0")))
    _random_(model, made)
    return model, _ids(tokens), attention_of(model)


def _reset_peak() -> float:
    """Free heap memory to the system and restart the peak resident size here (MiB)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key))
    return int(line.split()[1]) / 1024


def warm_up(model, ids, attention: list[str]) -> None:
    """One training step with gradients of ``attention`` only: FSDP's first step
    allocates what it keeps."""
    for n, p in model.named_parameters():
        p.requires_grad_(n in attention)
    loss(model, ids).backward()
    model.zero_grad(set_to_none=True)


def sharded_one(
    mode: str, tokens: int, kept_gradient: bool, plan: str, layers: int | None = None
) -> dict | None:
    """One process of a 2-process FSDP2 run (``torchrun``, gloo, one thread each): the
    row of rank 0, with the largest growth over the processes."""
    import warnings

    import torch
    import torch.distributed as dist

    import geosharp
    from geosharp import distributed as gd
    from reference import restart_rule, rule_name

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    rank, world = gd.init()
    model, ids, attention = _sharded_model(tokens, plan, layers)
    sizes = dict(model.named_parameters())
    perturbed = sum(sizes[n].numel() for n in attention)
    local = sum(sizes[n].to_local().numel() for n in attention)
    warm_up(model, ids, attention)
    loaded = _reset_peak()
    row = {"mode": mode, "parameters": sum(p.numel() for p in model.parameters())}
    row.update(perturbed=perturbed, local_perturbed=local, tokens=tokens, processes=world)
    row.update(layers=model.config.num_hidden_layers)
    row.update(restart=rule_name(kept_gradient), plan=plan)
    if mode == "step":
        times = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            loss(model, ids).backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        row.update(seconds=statistics.median(times))
    else:
        for p in model.parameters():
            p.requires_grad_(True)
        stamps = []

        def callback(event, i, iterate):
            if event == "evaluated":
                stamps.append(time.perf_counter())

        n_iters = 3
        with restart_rule(kept_gradient):
            result = geosharp.sharpness(
                model, [ids], loss, mode, None, geosharp.WorstCase(n_iters=n_iters),
                callback=callback,
            )  # fmt: skip
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        row.update(
            seconds=statistics.median(gaps),
            evaluations=len(stamps),
            seconds_per_step=(stamps[-1] - stamps[0]) / n_iters,
            value=result.value,
            losses=result.traces[0].losses,
            precision=result.settings["precision"],
            pairs=result.settings["n_pairs"],
        )
        check_perturbed(result, perturbed)
    growth = _status("VmHWM") - loaded
    parts = [None] * world
    dist.all_gather_object(parts, growth)
    row.update(peak_growth_mib=max(parts), peak_growth_per_process_mib=parts)
    model = None  # released before the process group ends
    gd.close()
    return row if rank == 0 else None


FLOAT32 = " (float32 products)"
"""A row's suffix: the perturbed layers' products in float32, as before they were split."""
SPLIT = " (split products)"
"""A row's suffix: the perturbed layers' products split into bfloat16 parts, also where
the device returns half-precision products (this CPU)."""


def _products(mode: str) -> str:
    """``mode`` without its suffix (:data:`FLOAT32`, :data:`SPLIT`), the products set
    as it says (by the device where it has none)."""
    from geosharp.measures.backends import split

    split.ENABLED = True if mode.endswith(SPLIT) else False if mode.endswith(FLOAT32) else None
    return mode.removesuffix(FLOAT32).removesuffix(SPLIT)


def one(mode: str, tokens: int, kept_gradient: bool = False, layers: int | None = None) -> dict:
    import warnings

    import torch

    import geosharp
    from reference import restart_rule, rule_name

    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    named, mode = mode, _products(mode)
    model, ids, attention = _model(tokens, layers)
    sizes = dict(model.named_parameters())
    perturbed = sum(sizes[n].numel() for n in attention)

    loaded = _rss_mib()
    row = {"mode": named, "parameters": sum(p.numel() for p in model.parameters())}
    row.update(perturbed=perturbed, tokens=tokens, loaded_mib=loaded)
    row.update(restart=rule_name(kept_gradient))
    row.update(layers=model.config.num_hidden_layers)
    if mode == "step":
        for n, p in model.named_parameters():
            p.requires_grad_(n in attention)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            loss(model, ids).backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        row.update(seconds=statistics.median(times), peak_growth_mib=_rss_mib() - loaded)
        return row
    stamps = []

    def callback(event, i, iterate):
        if event == "evaluated":
            stamps.append(time.perf_counter())

    n_iters = 3
    estimator = geosharp.WorstCase(n_iters=n_iters)
    with restart_rule(kept_gradient):
        result = geosharp.sharpness(model, [ids], loss, mode, None, estimator, callback=callback)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    row.update(
        seconds=statistics.median(gaps),
        evaluations=len(stamps),
        seconds_per_step=(stamps[-1] - stamps[0]) / n_iters,
        peak_growth_mib=_rss_mib() - loaded,
        value=result.value,
        losses=result.traces[0].losses,  # which steps improved (the best xi's buffer)
        precision=result.settings["precision"],
        pairs=result.settings["n_pairs"],
    )
    check_perturbed(result, perturbed)
    return row


SHAPE = {"layers": SHAPES["1.1b"]["num_hidden_layers"], "hidden": SHAPES["1.1b"]["hidden_size"]}
"""The measured model's depth and width."""
# LLaMA-2's shapes: parameters, attention parameters, layers, width
PROJECTED = {
    "LLaMA-2-7B": (6.74e9, 2.147e9, 32, 4096),
    "LLaMA-2-70B": (68.98e9, 12.08e9, 80, 8192),
}


MEDIAN_OF = ("peak_growth_mib", "buffers_beyond_step", "seconds", "step_over_forward_backward")
"""The columns that :func:`median_rows` takes the median of."""


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Runs of the same rows (``step``, ``adaptive-attn``, ...) as one: each of
    :data:`MEDIAN_OF`, per row, the median over the runs (columns taken separately);
    the rest from the first run."""
    out = []
    for rows in zip(*runs, strict=True):
        assert len({r["mode"] for r in rows}) == 1, "the runs' rows differ"
        out.append(rows[0] | {k: statistics.median(r[k] for r in rows) for k in MEDIAN_OF})
    return out


def report(rows: list[dict], tokens: int = 2048, sharded: list[dict] | None = None) -> str:
    """The measured rows as a table (one process, then ``sharded``, the rows of a run on
    2 FSDP2 processes, whose vectors are of each process's slices), and what they
    project for LLaMA-2 on GPUs of 80 GB: per process, the bfloat16 model (sharded over
    the processes), one training step's bfloat16 gradients of the perturbed parameters,
    the measure's float32 vectors beyond that step (as measured, per perturbed
    parameter: one process's for 7B on one GPU, a sharded process's for 70B on 8 when
    given) and activations at one sequence of ``tokens`` tokens (per token, layer and
    width as measured here), in GB; without activation checkpointing, and with it (each
    layer's bfloat16 input kept, one layer's activations at a time)."""
    step = next(r for r in rows if r["mode"] == "step")
    measured = [
        "| run | parameters | perturbed | tokens | peak growth (MiB) | float32 vectors of the "
        "perturbed beyond the step | time per evaluation | x forward+backward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in [*rows, *(sharded or [])]:
        run = r["mode"] + (f", {r['processes']} processes" if "processes" in r else "")
        run += (
            f", {r['layers']} layers" if r.get("layers", SHAPE["layers"]) != SHAPE["layers"] else ""
        )
        measured.append(
            f"| {run} | {r['parameters'] / 1e9:.2f}B | {r['perturbed'] / 1e6:.0f}M | "
            f"{r['tokens']} | {r['peak_growth_mib']:.0f} | {r['buffers_beyond_step']:.2f} | "
            f"{r['seconds']:.2f} s | {r['step_over_forward_backward']:.2f} |"
        )
    act_bytes = step["peak_growth_mib"] * 2**20 - 2 * step["perturbed"]
    per_unit = act_bytes / (step["tokens"] * step.get("layers", SHAPE["layers"]) * SHAPE["hidden"])
    projected = [
        "| model | GPUs | perturbed | measure | model | step gradients | measure's vectors "
        f"| activations ({tokens} tokens) | total per GPU | activations, checkpointed "
        "| total, checkpointed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, (params, attention, layers, width) in PROJECTED.items():
        gpus = 1 if name.endswith("7B") else 8
        per_process = sharded if sharded is not None and gpus > 1 else rows
        for what, perturbed in (("attention", attention), ("all", params)):
            for r in per_process[1:]:
                model = 2 * params / gpus / 1e9
                grads = 2 * perturbed / gpus / 1e9
                vectors = 4 * r["buffers_beyond_step"] * perturbed / gpus / 1e9
                acts = per_unit * tokens * layers * width / 1e9
                # checkpointed: each layer's bfloat16 input, and one layer's activations
                # while backward recomputes it
                kept = (2 * tokens * layers * width + per_unit * tokens * width) / 1e9
                total = model + grads + vectors + acts
                measure = r["mode"].removesuffix("-attn")
                projected.append(
                    f"| {name} | {gpus} | {what} | {measure} | {model:.1f} | {grads:.1f} | "
                    f"{vectors:.1f} | {acts:.1f} | {total:.1f} | {kept:.1f} | "
                    f"{total - acts + kept:.1f} |"
                )
    return "\n".join(measured) + "\n\n" + "\n".join(projected)


def _max_stack(entries: int) -> None:
    """Stack parts of ``entries`` block entries, one process or sharded."""
    from geosharp.geometry import sharded, stacked

    sharded.max_stack = stacked.max_stack = lambda device, sharded=False: entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--report",
        nargs="+",
        default=None,
        help="print the tables of a results file (of several: their medians, row by row)",
    )
    parser.add_argument(
        "--sharded-report", default=None, help="with --report: the results of an --fsdp run"
    )
    parser.add_argument(
        "--kept-gradient",
        action="store_true",
        help="restart as the reference Auto-PGD does (best gradient kept, one vector more)",
    )
    parser.add_argument(
        "--mmap-threshold",
        action="store_true",
        help="run each row with MALLOC_MMAP_THRESHOLD_=131072: memory held, not the heap's",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model over 2 processes with FSDP2 (torchrun, gloo, one thread each)",
    )
    parser.add_argument(
        "--plan",
        choices=("default", "rows"),
        default="default",
        help="with --fsdp: FSDP2's default Shard(0), or geosharp.fsdp.shard's plan",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help=f"the 1.1B shape this deep ({SHAPE['layers']})"
    )
    parser.add_argument(
        "--max-stack",
        type=int,
        default=None,
        help="block entries per stack part instead of geosharp.geometry.stacked.max_stack's",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_stack:
        _max_stack(args.max_stack)
    if args.one and args.fsdp:
        row = sharded_one(args.one, args.tokens, args.kept_gradient, args.plan, args.layers)
        if row is not None:
            print(json.dumps(row))
        return
    if args.one:
        print(json.dumps(one(args.one, args.tokens, args.kept_gradient, args.layers)))
        return
    if args.report:
        runs = []
        for path in args.report:
            with open(path) as f:
                runs.append(json.load(f))
        rows = median_rows(runs)
        sharded = None
        if args.sharded_report:
            with open(args.sharded_report) as f:
                sharded = json.load(f)
        print(report(rows, sharded=sharded))
        return
    rows = []
    env = dict(os.environ, **(MMAP_THRESHOLD if args.mmap_threshold else {}))
    launcher = [sys.executable]
    if args.fsdp:
        launcher, distributed = torchrun(29650)
        env.update(distributed)
    modes = ["step", "adaptive-attn", "geodesic-inv-attn"]
    if not args.fsdp:  # side by side: as the CPU runs them (float32), and split
        modes[1:] = [m + s for m in modes[1:] for s in ("", SPLIT)]
    for mode in modes:
        done = subprocess.run(
            [*launcher, __file__, "--one", mode, "--tokens", str(args.tokens),
             *(["--kept-gradient"] if args.kept_gradient else []),
             *(["--layers", str(args.layers)] if args.layers else []),
             *(["--max-stack", str(args.max_stack)] if args.max_stack else []),
             *(["--fsdp", "--plan", args.plan] if args.fsdp else [])],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        if done.returncode != 0:
            sys.exit(f"{mode} failed:\n{done.stderr}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append({**row, "mmap_threshold": args.mmap_threshold})
        if args.max_stack:
            rows[-1]["max_stack"] = args.max_stack
    step = rows[0]
    for r in rows:
        # one float32 vector of the perturbed (of this process's slices, when sharded)
        vector_mib = 4 * r.get("local_perturbed", r["perturbed"]) / 2**20
        r["buffers_beyond_step"] = (r["peak_growth_mib"] - step["peak_growth_mib"]) / vector_mib
        r["step_over_forward_backward"] = r["seconds"] / step["seconds"]
        print(
            f"{r['mode']:<37} {r['parameters'] / 1e9:.2f}B parameters, "
            f"{r['perturbed'] / 1e6:.0f}M perturbed, {r['tokens']} tokens: peak grew "
            f"{r['peak_growth_mib']:.0f} MiB over the loaded model "
            f"({r['buffers_beyond_step']:.2f} float32 vectors of the perturbed beyond the step), "
            f"{r['seconds']:.2f} s per evaluation ({r['step_over_forward_backward']:.2f}x)"
            + (
                f", {r['evaluations']} evaluations, {r['seconds_per_step']:.2f} s per step"
                if "evaluations" in r
                else ""
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
