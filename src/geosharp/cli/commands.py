"""``geosharp measure`` and ``geosharp symmetries`` on Hugging Face checkpoints.

Every argument, path and data file is checked before the model's weights are loaded;
a problem is reported as a :class:`~geosharp.errors.UsageError` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import MissingInputError, PrecisionWarning, SymmetryWarning, UsageError
from ..io import dumps
from ..loading.batches import BUILTIN_DATA
from .options import (
    add_autocast,
    add_device,
    add_json,
    add_seed,
    at_least_one,
    autocast_dtype,
    check_device,
    check_output_path,
    note,
    positive_int,
)

__all__ = [
    "BUILTIN_DATA",
    "add_measure_arguments",
    "add_symmetries_arguments",
    "run_measure",
    "run_symmetries",
]

DEFAULT_MEASURES = "adaptive,geodesic-inv,geodesic-mix"


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    """The measure command's arguments: what is measured, how, what is written, and how
    the model runs."""
    _add_inputs(p)
    _add_estimates(p)
    _add_outputs(p)
    _add_running(p)


def _add_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (save_pretrained layout) or 'minilm'")
    p.add_argument(
        "--data",
        required=True,
        help="built-in data (" + ", ".join(BUILTIN_DATA) + "); a .csv, .tsv or .jsonl file "
        "or a datasets save_to_disk directory (text); an image folder root/<class>/<image>; "
        "or a .pt file holding a dict of input tensors with 'labels'",
    )
    p.add_argument(
        "--task",
        choices=("auto", "classification", "causal-lm"),
        default="auto",
        help="what the checkpoint is: a classifier (or regression head), or a causal LM "
        "measured with the next-token loss on texts; auto: from config.json's "
        "architectures (default)",
    )
    p.add_argument("--text-column", default="text", help="text column(s), 'a' or 'a,b' (text)")
    p.add_argument("--label-column", default="label", help="label column (default: label)")
    p.add_argument("--split", default="train", help="split of a datasets directory (train)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's own)")


def _add_estimates(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--measures",
        default=DEFAULT_MEASURES,
        help="comma-separated measure names (default: %(default)s)",
    )
    p.add_argument(
        "--rho",
        default="",
        help="radius for all measures (a number) or per measure, e.g. "
        "'adaptive=0.05,geodesic-mix=0.005' (default: each measure's default radius)",
    )
    p.add_argument("--kind", choices=("worst", "average"), default="worst")
    p.add_argument("--n-points", type=positive_int, default=256, help="data points (256)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="batch size (64)")
    p.add_argument("--n-iters", type=positive_int, default=20, help="Auto-PGD steps (20)")
    p.add_argument(
        "--n-samples", type=positive_int, default=10, help="random directions, --kind average"
    )
    p.add_argument(
        "--n-probes",
        type=positive_int,
        default=100,
        help="Hutchinson probes of the hessian-trace-* measures (100)",
    )
    p.add_argument("--max-length", type=positive_int, default=64, help="token limit (64)")


def _add_outputs(p: argparse.ArgumentParser) -> None:
    add_seed(p, "new classifier head, random starts and data subset")
    add_device(p)
    add_autocast(p)
    add_json(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="let --json write over the --data file or into the checkpoint directory",
    )
    p.add_argument(
        "--nonfinite",
        choices=("error", "inf"),
        default="error",
        help="when a perturbed loss is NaN or infinite (rho reaches where the model breaks "
        "down): stop with an error (default), or report the value as inf with the reason "
        "(null in JSON)",
    )
    p.add_argument(
        "--per",
        choices=("layer", "module", "head"),
        help="the sharpness of each layer, module or attention head with all other "
        "parameters fixed, in the same geometry and radius: one measure per block",
    )
    p.add_argument(
        "--plot",
        metavar="FILE",
        help="with --per: a bar per block, one colour per measure, in the format FILE's "
        "suffix names (.png, .svg, .pdf, ...)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the --json file of a run that was stopped: the measures it holds "
        "are kept, the rest measured (its settings must be these)",
    )


def _add_running(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the model over the processes with FSDP2 "
        "(geosharp.fsdp.shard) instead of splitting the batches, for a model too large "
        "for one device (process 0 reads the checkpoint into CPU memory, each process "
        "receives its shards); every process runs every batch, the values are one "
        "process's",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "auto"),
        default="float32",
        help="load the weights in this dtype (auto: the checkpoint's own); a half-precision "
        "model is measured in float32 in the modules that own perturbed parameters and in "
        "its own precision elsewhere (default: float32)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in backward (transformers' gradient_checkpointing_enable, "
        "non-reentrant): less memory, one more forward per step",
    )
    p.add_argument("--low-memory", action="store_true", help=argparse.SUPPRESS)  # removed
    p.add_argument("--quiet", action="store_true", help="no progress reports")
    p.add_argument(
        "--strict",
        action="store_true",
        help="stop (exit 2) instead of warning: before measuring, where attention modules "
        "would be measured element-wise (their symmetry not understood) or pairs used "
        "without a numerical check; after a measure (or block), where its value is within "
        "10x of the loss's round-off floor",
    )


def add_symmetries_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (save_pretrained layout) or 'minilm'")
    p.add_argument("--no-check", action="store_true", help="skip the self-check")
    p.add_argument(
        "--no-weights",
        action="store_true",
        help="build the model from its config.json on the meta device, without loading "
        "weights (any size, in seconds): the pairs are found but not checked",
    )
    p.add_argument(
        "--cond",
        type=at_least_one,
        default=10.0,
        help="condition number of the self-check's random transforms (10)",
    )


def measure_names(spec: str) -> list[str]:
    """The measures named by ``--measures`` (sharpness measures and Hessian traces), or
    an error listing the known names."""
    from ..measures import HESSIAN_TRACES, MEASURES

    known = [*MEASURES, *HESSIAN_TRACES]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--measures is empty: name one or more of {', '.join(known)}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(
            f"unknown measure {unknown[0]!r} in --measures; choose from {', '.join(known)}"
        )
    return names


def rho_table(spec: str, names: list[str]) -> dict[str, float]:
    """Radius per measure from ``--rho`` (one number, or ``name=value,...``); the rest
    take ``DEFAULT_RHO``."""

    from ..measures import DEFAULT_RHO

    table = {n: DEFAULT_RHO[n] for n in names if n in DEFAULT_RHO}  # traces have no radius
    if not spec.strip():
        return table
    if "=" not in spec:
        items = [("*", spec)]
    else:
        items = [item.split("=", 1) for item in spec.split(",") if item.strip()]
        if any(len(item) != 2 for item in items):
            raise UsageError(f"could not read --rho {spec!r}: use 0.05 or name=0.05,...")
    for key, text in items:
        key = key.strip()
        if key != "*" and key not in table:
            if key in names:
                raise UsageError(f"--rho names {key!r}, a Hessian trace, which has no radius")
            raise UsageError(f"--rho names {key!r}, which is not in --measures")
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"could not read --rho {spec!r}: use 0.05 or name=0.05,...") from None
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--rho must be positive and finite, got {text.strip()}")
        for name in table if key == "*" else [key]:
            table[name] = value
    return table


def run_measure(args) -> int:
    """``geosharp measure``: every cheap check, the job loaded and checked, each measure
    written as it is done (resumable), the table."""
    from ..distributed import close
    from ..loading.job import load_job

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    plan = _plan(args)
    job = load_job(args, plan.path, plan.device)
    say = note if job.rank == 0 else (lambda _message: None)
    _announce(args, plan, job, say)
    fit = job.fit
    header = {
        "model": str(plan.path),
        "data": args.data,
        "seed": args.seed,
        "settings": plan.settings,
        "new_parameters": job.new_parameters,
        "loading": job.loading,
        "fit": {"loss": fit.loss, "accuracy": fit.accuracy, fit.unit.replace(" ", "_"): fit.n},
        "symmetries": symmetry_payload(job.symmetries),
    }
    results = _measure_each(args, plan, job, header, say)
    if args.fsdp:  # release the sharded model before the process group ends
        job.model = None
        close()
    if job.rank != 0:
        return 0
    table = sys.stderr if args.json == "-" else sys.stdout
    if args.per:
        _block_table(results, job.symmetries, table)
        if args.plot:
            title = f"{Path(str(args.model)).name} on {Path(args.data).name}"
            plot_blocks(results, args.plot, title)
            say(f"wrote {args.plot}")
    else:
        _table(results, job.symmetries, table)
    if args.json == "-":
        print(dumps({**header, "complete": True, "results": results}))
    else:
        _save(args, header, results, complete=True)
    return 0


@dataclass
class _Plan:
    """What the checks of a ``measure`` run decided: the measures and radii, the device,
    the checkpoint, the settings a resume must match and the results it keeps."""

    names: list[str]
    rhos: dict[str, float]
    device: torch.device
    path: Path
    settings: dict
    previous: dict


def _plan(args) -> _Plan:
    """Every check that needs no model (arguments, paths, devices, a results file to
    resume), before anything slow."""
    from ..io import fingerprint
    from ..loading.batches import data_kind
    from ..loading.hf import resolve_checkpoint
    from ..measures import HESSIAN_TRACES

    if args.low_memory:
        raise UsageError(
            "--low-memory was removed: its memory (no copy of the best point's gradient) is "
            "the default now; drop the flag"
        )
    names = measure_names(args.measures)
    rhos = rho_table(args.rho, names)
    device = check_device(args.device)
    data_kind(args.data)
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise MissingInputError(f"--tokenizer {args.tokenizer}: no such directory")
    path = resolve_checkpoint(args.model)
    inputs = {"the checkpoint": path}
    if args.data not in BUILTIN_DATA:
        inputs["--data"] = args.data
    if args.tokenizer is not None:
        inputs["--tokenizer"] = args.tokenizer
    check_output_path(args.json, protected=inputs, force=args.force)
    traces = [n for n in names if n in HESSIAN_TRACES]
    if args.plot and not args.per:
        raise UsageError("--plot draws per-block values: add --per layer (or --per module)")
    if args.per and traces:
        raise UsageError(f"--per measures sharpness per block; drop {traces[0]} from --measures")
    if args.fsdp:
        if "WORLD_SIZE" not in os.environ:
            raise UsageError(
                "--fsdp shards the model over torchrun's processes: launch with torchrun "
                "--nproc_per_node=N -m geosharp.cli measure ... (or drop --fsdp)"
            )
        if args.per or traces:
            what = "--per" if args.per else traces[0]
            raise UsageError(f"{what} is not available with --fsdp: drop one of them")
    if args.plot:
        from .plots import check_figure_path, require_matplotlib

        check_output_path(args.plot, "--plot", protected=inputs, force=args.force)
        if args.json not in (None, "-") and Path(args.json).resolve() == Path(args.plot).resolve():
            raise UsageError(
                f"--json and --plot both name {args.plot}: the results and the figure would "
                "overwrite each other; give them different files"
            )
        require_matplotlib()
        check_figure_path(args.plot)
    settings = run_settings(args, rhos)
    if args.json and args.json != "-":  # a resume refuses data or weights changed since
        data = None if args.data in BUILTIN_DATA else fingerprint(args.data, exclude=args.json)
        checkpoint = fingerprint(path, exclude=args.json)
        settings["fingerprints"] = {"checkpoint": checkpoint, "data": data}
    return _Plan(names, rhos, device, path, settings, resumable(args, settings))


def _announce(args, plan: _Plan, job, say) -> None:
    """The lines that say how the job was loaded and what was found, before measuring
    (with ``--strict``, an error where a geodesic value would not be symmetry-correct)."""
    from ..loading.hfdata import CAUSAL_LM

    sym = job.symmetries
    geodesic = [n for n in plan.names if measure_uses_pairs(n)]
    if args.strict and geodesic and (sym.ignored or sym.unverified):
        _say_symmetry_status(sym, geodesic, True, say)  # raises, before anything
    if job.new_parameters:
        head = "LM" if job.task == CAUSAL_LM else "classification"
        say(
            f"note: {args.model} has no trained {head} head: "
            f"{', '.join(job.new_parameters)} initialised at random (--seed {args.seed}); "
            "the values describe that random head"
        )
    for line in [*job.loading, str(job.fit)]:
        say(line)
    n_pairs = sum(p.shape[0] for p in sym.pairs)
    checked = sum(1 for p in sym.pairs if p.name in sym.verified)
    unknown = [u for u in sym.unrecognized if u not in sym.attention]
    points = sum(len(next(iter(b.values()))) for b in job.batches)
    say(
        f"{plan.path}: {job.n_parameters:,} parameters, {n_pairs} pairs "
        f"in {len(sym.attention)} attention modules"
        + (f" ({len(unknown)} more not understood)" if unknown else "")
        + f", {checked} of {len(sym.pairs)} pair blocks verified; "
        f"{points} points in {len(job.batches)} batches on {plan.device}"
        + (f", {job.world} processes" if job.world > 1 else "")
        + (" (the model sharded with FSDP2)" if args.fsdp else "")
    )
    _say_symmetry_status(sym, geodesic, args.strict, say)


def _measure_each(args, plan: _Plan, job, header: dict, say) -> list[dict]:
    """Each measure in turn (those a resumed file holds are kept), the results file
    rewritten after each: a kill loses at most one."""
    from ..measures import HESSIAN_TRACES

    done = {r["measure"]: r for r in plan.previous.get("results", [])}
    if done:
        say(f"resuming {args.json}: {', '.join(done)} already measured")
    results = []
    # the lines above said what is not symmetry-correct: no Python warning repeats it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SymmetryWarning)
        warnings.simplefilter("ignore", PrecisionWarning)
        for name in plan.names:
            if name in done:
                results.append(done[name])
                continue
            start = time.perf_counter()
            measure = _trace_row if name in HESSIAN_TRACES else _sharpness_row
            row = measure(args, plan, job, name, say)
            row.update(measure=name, seconds=time.perf_counter() - start)
            results.append(row)
            _save(args, header, results, complete=False, rank=job.rank)
    return results + [r for n, r in done.items() if n not in plan.names]  # kept


def _trace_row(args, plan: _Plan, job, name: str, say) -> dict:
    """A Hessian trace: no radius, no autocast; every process computes it."""
    from ..measures import HESSIAN_TRACES, hessian_trace

    trace = hessian_trace(
        job.model, job.batches, job.loss_fn, HESSIAN_TRACES[name], n_probes=args.n_probes,
        seed=args.seed, symmetries=job.symmetries, progress=not args.quiet and job.rank == 0,
    )  # fmt: skip
    return {**trace.to_dict(), "rho": None}


def _sharpness_row(args, plan: _Plan, job, name: str, say) -> dict:
    """One sharpness measure (or, ``--per``, one per block), with what the command line
    says of its round-off floor and of non-finite losses."""
    from ..measures import AverageCase, WorstCase, block_sharpness, sharpness
    from ..measures.problem import FloorError, NonFiniteError, floor_message

    estimator = AverageCase(args.n_samples) if args.kind == "average" else WorstCase(args.n_iters)
    options = dict(
        seed=args.seed, symmetries=job.symmetries, progress=not args.quiet and job.rank == 0,
        autocast_dtype=autocast_dtype(args.autocast), strict=args.strict,
        distributed=job.world > 1 and not args.fsdp, nonfinite=args.nonfinite,
    )  # fmt: skip
    rho, on = plan.rhos[name], (job.model, job.batches, job.loss_fn)
    try:
        if args.per:
            result = block_sharpness(*on, name, rho, estimator, per=args.per, **options)
        else:
            result = sharpness(*on, name, rho, estimator, **options)
    except NonFiniteError as err:  # the user's radius or model, not our bug
        raise UsageError(err.message(f"--rho (now {rho:g})", "--nonfinite inf")) from None
    except FloorError as err:  # --strict: in the command line's words
        raise UsageError(err.message(cli=True)) from None
    row = result.to_dict()
    parts = [(f"{name} [{b}]", r) for b, r in result.blocks.items()] if args.per else []
    parts = parts or [(name, result)]  # the floor is checked on the measure or each block
    near = [
        m
        for label, r in parts
        if (m := floor_message(label, r.rho, r.value, r.floor, r.settings["precision"], True))
    ]
    if near:
        more = f" (and {len(near) - 1} more blocks)" if len(near) > 1 else ""
        say("warning: " + near[0] + more)
    broken = [w for _, r in parts for w in r.nonfinite]
    if args.per:  # the whole row of a block measure: its blocks
        first = parts[0][1]
        row.update(rho=first.rho, loss=first.loss, geometry=first.geometry)
    if broken:
        say(
            f"note: {name} is inf: a perturbed loss is not finite in {len(broken)} place(s), "
            f"first {broken[0]}; lower --rho for a finite value"
        )
    return row


def _save(args, header: dict, results: list, complete: bool, rank: int = 0) -> None:
    """The results file, written atomically (on the first process)."""
    from ..io import write_json_atomic

    if rank == 0 and args.json and args.json != "-":
        payload = {**header, "complete": complete, "results": results}
        write_json_atomic(args.json, payload, strict=True)


def _table(results: list[dict], symmetries, table) -> None:
    print(f"{'measure':<28} {'rho':>8} {'value':>12} {'loss':>9} {'time':>7}", file=table)
    for r in results:
        rho = "-" if r["rho"] is None else f"{r['rho']:g}"
        value = _number(r["value"], r) + (f" +- {r['stderr']:.2g}" if "stderr" in r else "")
        label = r["measure"] + symmetry_mark(r["measure"], symmetries)
        print(
            f"{label:<28} {rho:>8} {value:>12} {r['loss']:>9.4g} {r['seconds']:>6.1f}s",
            file=table,
        )


def _block_table(results: list[dict], symmetries, table) -> None:
    """One line per (measure, block) of a ``--per`` run."""
    width = max((len(b) for r in results for b in r.get("values", {})), default=5)
    print(f"{'measure':<28} {'block':<{width}} {'rho':>8} {'value':>12}", file=table)
    for r in results:
        label = r["measure"] + symmetry_mark(r["measure"], symmetries)
        for block, value in r.get("values", {}).items():
            shown = _number(value, r["blocks"][block])
            print(f"{label:<28} {block:<{width}} {r['rho']:>8g} {shown:>12}", file=table)


def plot_blocks(results: list[dict], path: str, title: str) -> None:
    """A bar per block, one colour per measure (log scale when every value is
    positive and finite)."""

    from .plots import require_matplotlib, save_figure

    require_matplotlib()
    import matplotlib.pyplot as plt

    blocks = list(results[0]["values"])
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(blocks) * len(results) + 2), 4))
    values = []
    for i, r in enumerate(results):
        ys = [r["values"][b] if r["values"][b] is not None else math.nan for b in blocks]
        values += ys
        xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(blocks))]
        ax.bar(xs, ys, width, label=f"{r['measure']} (rho={r['rho']:g})")
    if all(math.isfinite(v) and v > 0 for v in values):
        ax.set_yscale("log")
    ax.set_xticks(range(len(blocks)), blocks, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("sharpness, other blocks fixed")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _number(value, row: dict) -> str:
    """A value for the table; ``None`` is how a JSON file being resumed stores ``inf``."""
    if value is None:
        return "inf" if row.get("nonfinite") else "nan"
    return f"{value:.5g}"


def run_settings(args, rhos: dict[str, float]) -> dict:
    """Everything of a ``geosharp measure`` run that changes a value: a results file is
    resumed only by a run with the same settings."""
    from .. import __version__
    from ..measures.apgd import RESTART

    keys = ("data", "text_column", "label_column", "split", "tokenizer", "n_points",
            "batch_size", "max_length", "kind", "n_iters", "n_samples", "n_probes", "seed",
            "autocast", "nonfinite", "per", "task", "dtype")  # fmt: skip
    settings = {k: getattr(args, k) for k in keys}
    settings.update(model=str(args.model), rho=rhos, version=__version__, restart=RESTART)
    return settings


def resumable(args, settings: dict) -> dict:
    """The results file that ``--resume`` continues (``{}`` if there is none yet); an
    error when it was made with other settings, or there is no file to resume."""
    from ..io import read_json_file

    if not args.resume:
        return {}
    if not args.json or args.json == "-":
        raise UsageError("--resume needs --json FILE: the results file to continue")
    if not Path(args.json).exists():
        note(f"--resume: {args.json} does not exist yet, nothing to resume: a new run starts")
        return {}
    previous = read_json_file(args.json, "--json")
    was = previous.get("settings")
    if not isinstance(was, dict) or not isinstance(previous.get("results"), list):
        raise UsageError(f"--json {args.json} is not a geosharp measure results file")
    changed = [
        k for k in sorted(set(settings) | set(was)) if k != "rho" and was.get(k) != settings.get(k)
    ]
    changed += [
        f"rho of {n}"
        for n, r in settings["rho"].items()
        if n in was.get("rho", {}) and was["rho"][n] != r
    ]
    if "fingerprints" in changed:
        moved = [
            k
            for k in ("checkpoint", "data")
            if (was.get("fingerprints") or {}).get(k) != settings["fingerprints"][k]
        ]
        raise UsageError(
            f"--json {args.json} was measured on another {' and '.join(moved)}: "
            f"{' and '.join(moved)} changed since (rewritten or retrained); use another "
            "--json, or drop --resume to start again"
        )
    if changed:
        k = changed[0]
        now, then = (settings.get(k), was.get(k)) if not k.startswith("rho") else ("", "")
        detail = f" ({then!r} there, {now!r} now)" if now != then else ""
        raise UsageError(
            f"--json {args.json} was made with other settings: {', '.join(changed)}{detail}; "
            "use another --json, or drop --resume to start again"
        )
    return previous


def measure_uses_pairs(name: str) -> bool:
    """Whether the named measure (or Hessian trace) has a pair factor."""
    from ..measures import HESSIAN_TRACES, measure_kwargs

    return measure_kwargs(HESSIAN_TRACES.get(name, name))["geometry"].startswith("geodesic")


def symmetry_mark(measure: str, symmetries) -> str:
    """What the results table adds to a geodesic measure's name when it is not fully
    symmetry-correct: ``" (no pairs)"`` or ``" (partial)"``."""
    if not measure_uses_pairs(measure) or not symmetries.ignored:
        return ""
    return " (no pairs)" if not symmetries.pairs else " (partial)"


def symmetry_payload(symmetries) -> dict:
    """The JSON record of what discovery found."""
    return {
        "discovery": symmetries.discovery,
        "pair_blocks": len(symmetries.pairs),
        "pairs": sum(p.shape[0] for p in symmetries.pairs),
        "attention_modules": symmetries.attention,
        "verified": {n: v.change for n, v in symmetries.verified.items()},
        "dropped": [
            {"module": d.module, "kind": d.kind, "reason": d.reason, "exact": d.exact}
            for d in symmetries.dropped
        ],
        "ignored": list(symmetries.ignored),
    }


def _say_symmetry_status(symmetries, geodesic: list[str], strict: bool, say) -> None:
    """One line for the pairs that do not exist (exact), one for the symmetries that are
    ignored and the pair blocks used without a numerical check (or, with --strict and a
    geodesic measure, an error)."""
    absent = [d for d in symmetries.dropped if d.exact]
    if absent:
        modules = len({d.module for d in absent})
        kinds = sorted({d.kind for d in absent})
        say(
            f"note: {', '.join(kinds)} pairs of {modules} attention module"
            f"{'s' * (modules != 1)} are not symmetries ({absent[0].reason}) and are measured "
            "element-wise, as they should be"
        )
    parts = symmetries.gaps()
    if not parts or not geodesic:
        return
    if symmetries.ignored:
        marked = "without --strict the values would be" if strict else "the values are"
        parts.append(f"{marked} marked '(partial)' or '(no pairs)'")
    message = "geodesic measures: " + "; ".join(parts) + "; see geosharp symmetries MODEL"
    if strict:
        raise UsageError(message)
    say("warning: " + message)


def run_symmetries(args) -> int:
    from ..loading.hf import example_inputs, load_model, meta_model
    from ..symmetry import check_symmetries, find_symmetries

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.no_weights:
        model = meta_model(args.model)
        print(find_symmetries(model, warn=False).summary())
        return 0
    model = load_model(args.model)
    symmetries = find_symmetries(model, warn=False)
    print(symmetries.summary())
    if args.no_check:
        return 0
    check = check_symmetries(model, example_inputs(model), symmetries, cond=args.cond)
    print(check)
    return 1 if check.status == "failed" else 0
