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

from .errors import MissingInputError, PrecisionWarning, SymmetryWarning, UsageError
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

BUILTIN_IMAGES = ("digits", "fashion-mnist")
BUILTIN_DATA = (*BUILTIN_IMAGES, "rotten-tomatoes")
DEFAULT_MEASURES = "adaptive,geodesic-inv,geodesic-mix"


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
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
        metavar="PNG",
        help="with --per: a bar per block, one colour per measure, written to PNG",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the --json file of a run that was stopped: the measures it holds "
        "are kept, the rest measured (its settings must be these)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard the model over the processes with FSDP2 "
        "(geosharp.fsdp.shard) instead of splitting the batches, for a model too large "
        "for one device; every process runs every batch, the values are one process's",
    )
    p.add_argument("--quiet", action="store_true", help="no progress reports")
    p.add_argument(
        "--strict",
        action="store_true",
        help="stop (exit 2) when attention modules would be measured element-wise because "
        "their symmetry is not understood, instead of marking the geodesic values",
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
    from .measures import HESSIAN_TRACES, MEASURES

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

    from .measures import DEFAULT_RHO

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


def data_kind(source: str) -> str:
    """What ``--data`` names: ``builtin``, ``table``, ``datasets``, ``images`` or ``pt``."""
    from .data import TABLE_SUFFIXES, is_datasets_dir, is_image_folder

    if source in BUILTIN_DATA:
        return "builtin"
    path = Path(source)
    if not path.exists():
        raise MissingInputError(
            f"--data {source}: no such file or directory (built-in: {', '.join(BUILTIN_DATA)})"
        )
    if path.is_dir():
        if is_datasets_dir(path):
            return "datasets"
        if is_image_folder(path):
            return "images"
        raise UsageError(
            f"--data {source}: a directory must be a datasets save_to_disk directory or an "
            "image folder root/<class>/<image>"
        )
    if path.suffix.lower() in TABLE_SUFFIXES:
        return "table"
    if path.suffix.lower() == ".pt":
        return "pt"
    raise UsageError(
        f"--data {source}: unknown format {path.suffix or '(no suffix)'}; use .csv, .tsv, "
        ".jsonl, .pt, a datasets directory or an image folder"
    )


def resolve_task(option: str, config) -> str:
    """The task of ``--task`` (``auto``: a causal LM when config.json's architectures
    say so, else the classifier's task of :func:`geosharp.hfdata.task_of`)."""
    from .hfdata import CAUSAL_LM, is_causal_lm, task_of

    archs = getattr(config, "architectures", None) or []
    if option == "causal-lm" and archs and not is_causal_lm(config):
        raise UsageError(
            f"--task causal-lm: the checkpoint is a {archs[0]}, not a causal language model "
            "(its config.json names no ...ForCausalLM or ...LMHeadModel): its next-token loss "
            "would be a random head's; drop --task, or give a causal LM checkpoint"
        )
    if option == "causal-lm" or (option == "auto" and is_causal_lm(config)):
        return CAUSAL_LM
    return task_of(config)


def load_batches(args, path: Path, config) -> tuple[list[dict], list[str]]:
    """The measurement batches of ``--data`` for the model in ``path``, loaded as the
    checkpoint's owner made them (:mod:`geosharp.hfdata`), and the lines that say how
    (label mapping, pixels, texts cut)."""
    from . import data as datasets
    from . import hfdata
    from .hf import check_label_range, is_vision, label_ids, load_tokenizer

    source, n = args.data, args.n_points
    kind = data_kind(source)
    vision = is_vision(config)
    classes = int(getattr(config, "num_labels", 0) or 0)
    task = resolve_task(args.task, config)
    is_image_source = source in BUILTIN_IMAGES or kind == "images"
    is_text_source = source == "rotten-tomatoes" or kind in ("table", "datasets")
    if vision and is_text_source:
        raise UsageError(f"--data {source} is text data but {args.model} is a vision model")
    if not vision and is_image_source:
        raise UsageError(f"--data {source} is image data but {args.model} is a text model")

    if task == hfdata.CAUSAL_LM:
        return _lm_batches(args, path, config)
    if kind == "pt":
        return _tensor_batches(source, n, args.batch_size, classes, task), []
    if task != hfdata.TASKS[0] and (is_image_source or source == "rotten-tomatoes"):
        raise UsageError(
            f"{args.model} is a {task.replace('_', '-')} head (config.json problem_type / "
            f"num_labels) and --data {source} holds class labels: give data with its targets"
        )
    if task == hfdata.TASKS[2]:
        raise UsageError(
            f"{args.model} is a multi-label head: give --data as a .pt file whose 'labels' "
            f"tensor holds one row of {classes} 0/1 targets per data point"
        )
    if is_image_source:
        return _image_batches(args, path, config, classes)

    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else path)
    notes = []
    if source == "rotten-tomatoes":
        text = datasets.load_rotten_tomatoes()
        order = torch.randperm(len(text.labels), generator=torch.Generator().manual_seed(args.seed))
        texts = [text.texts[i] for i in order[:n]]
        labels = text.labels[order[:n]]
        check_label_range(labels, classes)
        notes.append("labels: 0 = rotten, 1 = fresh (the data's class indices)")
    else:
        rows = datasets.read_texts(
            source, args.text_column, args.label_column, split=args.split, limit=n
        )
        texts = rows.texts
        if task == hfdata.TASKS[1]:
            labels = hfdata.regression_targets(rows.labels)
            notes.append("targets: numbers (regression head, mean squared error)")
        else:
            labels = label_ids(rows.labels, config, classes)
            notes.append(_label_note(rows.labels, labels))
    batches, more = hfdata.tokenized_batches(
        tokenizer, config, texts, labels, args.batch_size, args.max_length
    )
    return batches, [*notes, *more]


def _lm_batches(args, path: Path, config) -> tuple[list[dict], list[str]]:
    """Batches of texts for a causal LM (no labels: the next-token loss)."""
    from . import data as datasets
    from . import hfdata
    from .hf import load_tokenizer

    source, n = args.data, args.n_points
    if source != "rotten-tomatoes" and data_kind(source) not in ("table", "datasets"):
        raise UsageError(
            f"{args.model} is a causal LM: give --data as texts (.txt, .csv, .tsv, .jsonl, "
            "a datasets directory, or rotten-tomatoes)"
        )
    if "," in args.text_column:
        raise UsageError("a causal LM reads one text column: give --text-column NAME")
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else path)
    if source == "rotten-tomatoes":
        text = datasets.load_rotten_tomatoes()
        order = torch.randperm(len(text.labels), generator=torch.Generator().manual_seed(args.seed))
        texts = [text.texts[i] for i in order[:n]]
    else:
        rows = datasets.read_texts(source, args.text_column, None, split=args.split, limit=n)
        texts = rows.texts
    batches, notes = hfdata.tokenized_batches(
        tokenizer, config, texts, None, args.batch_size, args.max_length
    )
    return batches, ["texts: next-token loss, mean over the tokens (padding masked)", *notes]


def _label_note(raw: list, ids: torch.Tensor) -> str:
    """How the labels of a text file became class ids."""
    from .hf import class_index

    named = {}
    for label, i in zip(raw, ids.tolist(), strict=True):
        if not (isinstance(label, int) or class_index(label) is not None):
            named.setdefault(str(label).strip(), i)
    if not named:
        return "labels: class indices as given"
    shown = ", ".join(f"{k}={v}" for k, v in sorted(named.items(), key=lambda kv: kv[1])[:8])
    return f"labels: {shown} (names matched to the checkpoint label2id)"


def _image_batches(args, path: Path, config, classes: int) -> tuple[list[dict], list[str]]:
    """Batches of an image folder or built-in image set, through the checkpoint's image
    processor where it has one."""
    from . import data as datasets
    from . import hfdata
    from .hf import check_label_range, image_batches_for

    source, n = args.data, args.n_points
    processor = hfdata.load_image_processor(path)
    notes = []
    if args.data in BUILTIN_IMAGES:
        images = (
            datasets.load_digits() if source == "digits" else datasets.load_fashion_mnist("train")
        )
        x, y = images.images[:n], images.labels[:n]
        check_label_range(y, classes)
        notes.append(f"labels: the data's class indices 0 to {images.classes - 1}")
        if processor is None:
            notes.append(
                f"pixels: resized to {config.image_size}x{config.image_size}, (x - 0.5) / 0.5 "
                "(the checkpoint has no preprocessor_config.json)"
            )
            return list(image_batches_for(config, x, y, args.batch_size)), notes
        pil = _as_pil(x, datasets.image_mode(config.num_channels))
    else:
        items, folders = datasets.image_folder_items(source, n, args.seed)
        if not items:
            raise UsageError(
                f"{source} has no images in class sub-directories (root/<class>/<image>)"
            )
        ids, how = hfdata.folder_label_ids(folders, config)
        notes.append(how)
        y = torch.tensor([ids[c] for _, c in items], dtype=torch.long)
        pil = datasets.read_images([f for f, _ in items], datasets.image_mode(config.num_channels))
    pixels, how = hfdata.pixel_values(pil, config, processor)
    notes.append(how)
    batches = [
        {"pixel_values": pixels[s : s + args.batch_size], "labels": y[s : s + args.batch_size]}
        for s in range(0, len(y), args.batch_size)
    ]
    return batches, notes


def _as_pil(images: torch.Tensor, mode: str) -> list:
    """``(N, C, H, W)`` images in [0, 1] as 8-bit PIL images in ``mode`` (what an image
    processor reads, rescaling included)."""
    from PIL import Image

    array = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    out = []
    for a in array:
        image = Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a)
        out.append(image.convert(mode))
    return out


def _tensor_batches(source: str, n: int, batch_size: int, classes: int, task: str) -> list[dict]:
    """Batches of a ``.pt`` dict of tensors, one row per data point in each; ``labels``
    fit the task: class indices, regression targets, or rows of 0/1 targets."""
    from .hf import check_label_range

    try:
        tensors = torch.load(source, weights_only=True)
    except Exception as err:  # any unreadable file is the user's to fix
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"--data {source}: torch.load cannot read it ({first})") from None
    if not isinstance(tensors, dict) or not isinstance(tensors.get("labels"), torch.Tensor):
        raise UsageError(
            f"--data {source} must hold a dict of input tensors with a 'labels' entry "
            f"(found {type(tensors).__name__}); save e.g. {{'pixel_values': x, 'labels': y}}"
        )
    labels = tensors["labels"]
    other = {k: v for k, v in tensors.items() if not isinstance(v, torch.Tensor)}
    if other:
        key = next(iter(other))
        raise UsageError(
            f"--data {source}: {key!r} is a {type(other[key]).__name__}, not a tensor; "
            "save only tensors, one row per data point"
        )
    lengths = {k: len(v) if v.dim() else 0 for k, v in tensors.items()}
    if len(set(lengths.values())) > 1:
        raise UsageError(
            f"--data {source}: the tensors hold different numbers of data points "
            f"({', '.join(f'{k} {m}' for k, m in lengths.items())}); give each one row per point"
        )
    got = f"got {str(labels.dtype).removeprefix('torch.')} of shape {tuple(labels.shape)}"
    if labels.is_complex() or (labels.dtype == torch.bool and task != "multi_label_classification"):
        raise UsageError(f"--data {source}: 'labels' are not numbers ({got})")
    if task == "regression":
        if labels.dim() not in (1, 2) or (labels.dim() == 2 and labels.shape[1] != classes):
            raise UsageError(
                f"--data {source}: 'labels' of a regression head with {classes} output(s) must "
                f"be (N,) or (N, {classes}) numbers, {got}"
            )
        bad = (~torch.isfinite(labels.double())).nonzero()
        if len(bad):
            where = tuple(int(i) for i in bad[0])
            raise UsageError(
                f"--data {source}: 'labels' row {where[0]} holds {float(labels[where]):g}; "
                "a regression target must be a finite number"
            )
    elif task == "multi_label_classification":
        if labels.dim() != 2 or labels.shape[1] != classes:
            raise UsageError(
                f"--data {source}: 'labels' of a multi-label head must be (N, {classes}) "
                f"0/1 targets, {got}"
            )
        outside = ((labels != 0) & (labels != 1)).nonzero()
        if len(outside):
            row, col = (int(i) for i in outside[0])
            raise UsageError(
                f"--data {source}: 'labels' row {row} holds {float(labels[row, col]):g} for "
                f"label {col}; a multi-label head's targets are 0 or 1 (binary cross-entropy)"
            )
    else:
        if labels.is_floating_point() or labels.dim() != 1:
            raise UsageError(
                f"--data {source}: 'labels' must be a 1-d tensor of class indices (integers), {got}"
            )
        check_label_range(labels, classes)
    n = min(n, len(labels))
    return [
        {k: v[s : min(s + batch_size, n)] for k, v in tensors.items()}
        for s in range(0, n, batch_size)
    ]


def run_measure(args) -> int:
    from . import distributed as gd
    from .data import move_batch
    from .hf import check_weights, load_causal_lm, load_classifier, load_config, resolve_checkpoint
    from .hfdata import CAUSAL_LM, causal_lm_loss, preflight, task_loss
    from .io import dumps, fingerprint, write_json_atomic
    from .measures import (
        HESSIAN_TRACES,
        AverageCase,
        WorstCase,
        block_sharpness,
        hessian_trace,
        sharpness,
    )
    from .measures.problem import floor_message
    from .symmetry import find_symmetries

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # cheap checks first: arguments, paths, devices
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
    if args.plot and not args.per:
        raise UsageError("--plot draws per-block values: add --per layer (or --per module)")
    if args.per and any(n in HESSIAN_TRACES for n in names):
        traces = [n for n in names if n in HESSIAN_TRACES]
        raise UsageError(f"--per measures sharpness per block; drop {traces[0]} from --measures")
    if args.fsdp:
        if "WORLD_SIZE" not in os.environ:
            raise UsageError(
                "--fsdp shards the model over torchrun's processes: launch with torchrun "
                "--nproc_per_node=N -m geosharp.cli measure ... (or drop --fsdp)"
            )
        if args.per or any(n in HESSIAN_TRACES for n in names):
            what = "--per" if args.per else next(n for n in names if n in HESSIAN_TRACES)
            raise UsageError(f"{what} is not available with --fsdp: drop one of them")
    if args.plot:
        from .plots import check_figure_path, require_matplotlib

        check_output_path(args.plot, "--plot", protected=inputs, force=args.force)
        require_matplotlib()
        check_figure_path(args.plot)
    settings = run_settings(args, rhos)
    if args.json and args.json != "-":  # a resume refuses data or weights changed since
        data = None if args.data in BUILTIN_DATA else fingerprint(args.data, exclude=args.json)
        settings["fingerprints"] = {
            "checkpoint": fingerprint(path, exclude=args.json),
            "data": data,
        }
    previous = resumable(args, settings)
    config = load_config(path)
    check_weights(path)
    batches, loading = load_batches(args, path, config)
    if not batches:
        raise UsageError(f"--data {args.data} holds no data points")

    rank, world = gd.init()  # under torchrun the batches are split over the ranks
    say = note if rank == 0 else (lambda _message: None)
    task = resolve_task(args.task, config)
    causal = task == CAUSAL_LM
    loaded = (load_causal_lm if causal else load_classifier)(path, seed=args.seed)
    loss_fn = causal_lm_loss if causal else task_loss
    model = loaded.model.to(device)
    if loaded.new_parameters:
        say(
            f"note: {args.model} has no trained {'LM' if causal else 'classification'} head: "
            f"{', '.join(loaded.new_parameters)} initialised at random (--seed {args.seed}); "
            "the values describe that random head"
        )
    batches = [move_batch(b, device) for b in batches]
    fit = preflight(model, batches, args.data, task)  # every input runs, before anything slow
    symmetries = find_symmetries(model, batches[0], loss_fn=loss_fn, warn=False)
    n_parameters = sum(p.numel() for p in model.parameters())  # before any sharding
    if args.fsdp:
        from .fsdp import shard

        shard(model, symmetries)
    geodesic = [n for n in names if measure_uses_pairs(n)]
    if args.strict and geodesic and symmetries.ignored:
        _say_symmetry_status(symmetries, geodesic, True, say)  # raises, before anything
    for line in [*loading, str(fit)]:
        say(line)
    n_pairs = sum(p.shape[0] for p in symmetries.pairs)
    checked = sum(1 for p in symmetries.pairs if p.name in symmetries.verified)
    unknown = [u for u in symmetries.unrecognized if u not in symmetries.attention]
    say(
        f"{path}: {n_parameters:,} parameters, {n_pairs} pairs "
        f"in {len(symmetries.attention)} attention modules"
        + (f" ({len(unknown)} more not understood)" if unknown else "")
        + f", {checked} of {len(symmetries.pairs)} pair blocks verified; "
        f"{sum(len(next(iter(b.values()))) for b in batches)} points in {len(batches)} batches "
        f"on {device}"
        + (f", {world} processes" if world > 1 else "")
        + (" (the model sharded with FSDP2)" if args.fsdp else "")
    )
    _say_symmetry_status(symmetries, geodesic, args.strict, say)

    header = {
        "model": str(path),
        "data": args.data,
        "seed": args.seed,
        "settings": settings,
        "new_parameters": loaded.new_parameters,
        "loading": loading,
        "fit": {"loss": fit.loss, "accuracy": fit.accuracy, fit.unit.replace(" ", "_"): fit.n},
        "symmetries": symmetry_payload(symmetries),
    }
    done = {r["measure"]: r for r in previous.get("results", [])}
    if done:
        say(f"resuming {args.json}: {', '.join(done)} already measured")
    results = []

    def save(complete: bool) -> None:  # after each measure: a kill loses at most one
        if rank == 0 and args.json and args.json != "-":
            payload = {**header, "complete": complete, "results": results}
            write_json_atomic(args.json, payload, strict=True)

    # the lines above said what is not symmetry-correct: no Python warning repeats it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SymmetryWarning)
        warnings.simplefilter("ignore", PrecisionWarning)
        estimator = (
            AverageCase(args.n_samples) if args.kind == "average" else WorstCase(args.n_iters)
        )
        for name in names:
            if name in done:
                results.append(done[name])
                continue
            start = time.perf_counter()
            if name in HESSIAN_TRACES:  # no radius, no autocast; every process computes it
                trace = hessian_trace(
                    model,
                    batches,
                    loss_fn,
                    HESSIAN_TRACES[name],
                    n_probes=args.n_probes,
                    seed=args.seed,
                    symmetries=symmetries,
                    progress=not args.quiet and rank == 0,
                )
                row = trace.to_dict()
                row.update(measure=name, rho=None, seconds=time.perf_counter() - start)
                results.append(row)
                save(False)
                continue
            try:
                options = dict(
                    seed=args.seed,
                    symmetries=symmetries,
                    progress=not args.quiet and rank == 0,
                    autocast_dtype=autocast_dtype(args.autocast),
                    distributed=world > 1 and not args.fsdp,
                    strict=args.strict,
                    nonfinite=args.nonfinite,
                )
                if args.per:
                    options["per"] = args.per
                measure = block_sharpness if args.per else sharpness
                result = measure(model, batches, loss_fn, name, rhos[name], estimator, **options)
            except FloatingPointError as err:  # the user's radius or model, not our bug
                raise UsageError(
                    str(err)
                    .replace("lower rho", f"lower --rho (now {rhos[name]:g})")
                    .replace("(nonfinite='inf')", "(--nonfinite inf)")
                ) from None
            row = result.to_dict()
            row.update(measure=name, seconds=time.perf_counter() - start)
            parts = (  # what the round-off floor is checked on: the measure or each block
                [(f"{name} [{block}]", r) for block, r in result.blocks.items()]
                if args.per
                else [(name, result)]
            )
            near = [
                m
                for label, r in parts
                if (m := floor_message(label, r.rho, r.value, r.floor, r.settings["precision"]))
            ]
            if args.per:  # the whole row of a block measure: its blocks
                first = next(iter(result.blocks.values()))
                row.update(rho=first.rho, loss=first.loss, geometry=first.geometry)
                result = _Broken([w for b in result.blocks.values() for w in b.nonfinite])
            results.append(row)
            save(False)
            if near:  # in the command line's words
                more = f" (and {len(near) - 1} more blocks)" if len(near) > 1 else ""
                say(
                    "warning: "
                    + near[0]
                    .replace("(no autocast)", "(no --autocast)")
                    .replace(
                        "in float64 or with a larger rho",
                        "with a larger --rho (float64: the Python API)",
                    )
                    .replace("larger rho", "larger --rho")
                    + more
                )
            if result.nonfinite:
                say(
                    f"note: {name} is inf: a perturbed loss is not finite in "
                    f"{len(result.nonfinite)} place(s), first {result.nonfinite[0]}; "
                    "lower --rho for a finite value"
                )
    results += [r for n, r in done.items() if n not in names]  # kept, not measured again
    if args.fsdp:  # release the sharded model before the process group ends
        del model, loaded
        gd.close()
    if rank != 0:
        return 0

    table = sys.stderr if args.json == "-" else sys.stdout
    if args.per:
        _block_table(results, symmetries, table)
        if args.plot:
            plot_blocks(
                results, args.plot, f"{Path(str(args.model)).name} on {Path(args.data).name}"
            )
            say(f"wrote {args.plot}")
    else:
        _table(results, symmetries, table)
    if args.json == "-":
        print(dumps({**header, "complete": True, "results": results}))
    else:
        save(True)
    return 0


@dataclass
class _Broken:
    nonfinite: list[str]


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

    from .plots import require_matplotlib, save_png

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
    save_png(fig, Path(path))
    plt.close(fig)


def _number(value, row: dict) -> str:
    """A value for the table; ``None`` is how a JSON file being resumed stores ``inf``."""
    if value is None:
        return "inf" if row.get("nonfinite") else "nan"
    return f"{value:.5g}"


def run_settings(args, rhos: dict[str, float]) -> dict:
    """Everything of a ``geosharp measure`` run that changes a value: a results file is
    resumed only by a run with the same settings."""
    from . import __version__

    keys = ("data", "text_column", "label_column", "split", "tokenizer", "n_points",
            "batch_size", "max_length", "kind", "n_iters", "n_samples", "n_probes", "seed",
            "autocast", "nonfinite", "per", "task")  # fmt: skip
    settings = {k: getattr(args, k) for k in keys}
    settings.update(model=str(args.model), rho=rhos, version=__version__)
    return settings


def resumable(args, settings: dict) -> dict:
    """The results file that ``--resume`` continues (``{}`` if there is none yet); an
    error when it was made with other settings, or there is no file to resume."""
    from .io import read_json_file

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
    from .measures import HESSIAN_TRACES, measure_kwargs

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
    ignored (or, with --strict and a geodesic measure, an error)."""
    absent = [d for d in symmetries.dropped if d.exact]
    if absent:
        modules = len({d.module for d in absent})
        kinds = sorted({d.kind for d in absent})
        say(
            f"note: {', '.join(kinds)} pairs of {modules} attention module"
            f"{'s' * (modules != 1)} are not symmetries ({absent[0].reason}) and are measured "
            "element-wise, as they should be"
        )
    ignored = symmetries.ignored
    if not ignored or not geodesic:
        return
    first, drops = next(iter(ignored.items()))
    message = (
        f"{len(ignored)} attention module{'s' * (len(ignored) != 1)} would be measured "
        f"element-wise because their symmetry is not understood ({first}: {drops[0].kind}: "
        f"{drops[0].reason}); the geodesic values are marked '(partial)' or '(no pairs)'; "
        "see geosharp symmetries MODEL"
    )
    if strict:
        raise UsageError(
            message.replace(
                "the geodesic values are marked",
                "without --strict the geodesic values would be marked",
            )
        )
    say("warning: " + message)


def run_symmetries(args) -> int:
    from .hf import example_inputs, load_model, meta_model
    from .symmetry import check_symmetries, find_symmetries

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
