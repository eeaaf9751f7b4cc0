"""``geosharp measure`` and ``geosharp symmetries`` on Hugging Face checkpoints."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

__all__ = ["add_measure_arguments", "add_symmetries_arguments", "run_measure", "run_symmetries"]

BUILTIN_DATA = ("digits", "fashion-mnist", "rotten-tomatoes")


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (save_pretrained layout) or 'minilm'")
    p.add_argument(
        "--data",
        required=True,
        help="built-in data (" + ", ".join(BUILTIN_DATA) + "), a CSV file with 'text' and "
        "'label' columns, or a .pt file holding a dict of input tensors and 'labels'",
    )
    p.add_argument(
        "--measures",
        default="adaptive,geodesic-inv,geodesic-mix",
        help="comma-separated measure names (default: %(default)s)",
    )
    p.add_argument(
        "--rho",
        default="",
        help="radius for all measures (a number) or per measure, "
        "e.g. 'adaptive=0.05,geodesic-mix=0.005' (default: per-measure defaults)",
    )
    p.add_argument("--kind", choices=("worst", "average"), default="worst")
    p.add_argument("--n-points", type=int, default=256, help="training points used")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--n-iters", type=int, default=20, help="Auto-PGD steps per batch")
    p.add_argument("--max-length", type=int, default=64, help="token limit for text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", metavar="PATH", help="write results as JSON ('-' for stdout)")


def add_symmetries_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory (save_pretrained layout) or 'minilm'")
    p.add_argument("--no-check", action="store_true", help="skip the self-check")
    p.add_argument(
        "--cond",
        type=float,
        default=10.0,
        help="condition number of the self-check's random transforms",
    )


def _rho_table(spec: str, names: list[str]) -> dict[str, float]:
    from .measures import DEFAULT_RHO

    table = {n: DEFAULT_RHO.get(n, 0.05) for n in names}
    if not spec:
        return table
    try:
        if "=" not in spec:
            return {n: float(spec) for n in names}
        for item in spec.split(","):
            key, value = item.split("=")
            if key.strip() not in table:
                raise SystemExit(f"--rho names {key!r}, which is not in --measures")
            table[key.strip()] = float(value)
    except ValueError:
        raise SystemExit(f"could not read --rho {spec!r}: use 0.05 or name=0.05,...") from None
    return table


def _load_batches(args, config, path: Path) -> list[dict]:
    from . import data as datasets
    from .hf import image_batches_for, is_vision, text_batches_for

    source = args.data
    vision = is_vision(config)
    if source in ("digits", "fashion-mnist"):
        if not vision:
            raise SystemExit(f"--data {source} is image data but {args.model} is a text model")
        images = (
            datasets.load_digits() if source == "digits" else (datasets.load_fashion_mnist("train"))
        )
        x, y = images.images[: args.n_points], images.labels[: args.n_points]
        return list(image_batches_for(config, x, y, args.batch_size))
    if source == "rotten-tomatoes" or source.endswith(".csv"):
        if vision:
            raise SystemExit(f"--data {source} is text data but {args.model} is a vision model")
        if source == "rotten-tomatoes":
            text = datasets.load_rotten_tomatoes()
            order = torch.randperm(
                len(text.labels), generator=torch.Generator().manual_seed(args.seed)
            )
            texts = [text.texts[i] for i in order[: args.n_points]]
            labels = text.labels[order[: args.n_points]]
        else:
            with open(source, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))[: args.n_points]
            if not rows or not {"text", "label"} <= set(rows[0]):
                raise SystemExit(f"{source} needs 'text' and 'label' columns")
            texts = [r["text"] for r in rows]
            labels = torch.tensor([int(r["label"]) for r in rows])
        return list(text_batches_for(path, texts, labels, args.batch_size, args.max_length))
    if source.endswith(".pt"):
        tensors = torch.load(source, weights_only=True)
        if "labels" not in tensors:
            raise SystemExit(f"{source} must hold a dict of tensors with a 'labels' entry")
        n = min(args.n_points, len(tensors["labels"]))
        return [
            {k: v[s : min(s + args.batch_size, n)] for k, v in tensors.items()}
            for s in range(0, n, args.batch_size)
        ]
    raise SystemExit(
        f"unknown --data {source!r}: use one of {', '.join(BUILTIN_DATA)}, a .csv or a .pt file"
    )


def run_measure(args) -> int:
    from .hf import classification_loss, load_classifier, resolve_checkpoint
    from .measures import measure_kwargs, sharpness
    from .symmetry import find_symmetries

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = [n.strip() for n in args.measures.split(",") if n.strip()]
    for name in names:
        measure_kwargs(name)  # fail early on unknown names
    rhos = _rho_table(args.rho, names)
    path = resolve_checkpoint(args.model)
    model, config = load_classifier(path)
    model.to(args.device)
    batches = _load_batches(args, config, path)
    batches = [{k: v.to(args.device) for k, v in b.items()} for b in batches]
    symmetries = find_symmetries(model)
    n_pairs = sum(p.shape[0] for p in symmetries.pairs)
    print(
        f"{path}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{n_pairs} GL pairs; {len(batches)} batches of <= {args.batch_size}",
        file=sys.stderr,
    )

    results = []
    for name in names:
        start = time.perf_counter()
        result = sharpness(
            model,
            batches,
            classification_loss,
            rho=rhos[name],
            kind=args.kind,
            n_iters=args.n_iters,
            seed=args.seed,
            symmetries=symmetries,
            progress=True,
            **measure_kwargs(name),
        )
        row = result.to_dict()
        row.update(measure=name, seconds=time.perf_counter() - start)
        results.append(row)

    print(f"\n{'measure':<28} {'rho':>8} {'sharpness':>12} {'loss':>9} {'time':>7}")
    for r in results:
        print(
            f"{r['measure']:<28} {r['rho']:>8g} {r['value']:>12.5g} {r['loss']:>9.4g} "
            f"{r['seconds']:>6.1f}s"
        )
    if args.json:
        payload = json.dumps({"model": str(path), "data": args.data, "results": results}, indent=2)
        if args.json == "-":
            print(payload)
        else:
            Path(args.json).write_text(payload)
    return 0


def run_symmetries(args) -> int:
    from .hf import example_inputs, load_model
    from .symmetry import check_symmetries, find_symmetries

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = load_model(args.model)
    symmetries = find_symmetries(model, warn=False)
    print(symmetries.summary())
    if args.no_check:
        return 0
    check = check_symmetries(model, example_inputs(model), symmetries, cond=args.cond)
    print(check)
    return 0 if check.ok else 1
