"""``geosharp zoo``: the command line of the zoos."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from geosharp import distributed as gd
from geosharp.cli.plots import require_matplotlib
from geosharp.errors import UsageError
from geosharp.io import write_text_atomic

from .measure import measure_zoo
from .pilot import format_pilot, pilot_zoo
from .presets import PRESETS, ZOOS, get_preset
from .report import report_zoo
from .store import check_preset
from .train import train_zoo

DESCRIPTION = (
    "Model zoos (vision: ViTs on Fashion-MNIST, text: MiniLM on Rotten Tomatoes, "
    "vision-finetune: fine-tunes of one pre-trained ViT): pilot, train, measure and report; "
    "every step resumes where a killed run stopped."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The zoo's command-line options (``geosharp zoo --help``)."""
    from geosharp.cli.options import add_device, positive_float, positive_int

    p.add_argument(
        "action",
        choices=("train", "measure", "report", "all", "pilot"),
        help="pilot: train a few models drawn like the population's (not in it) and "
        "record the linearity ratios and maximiser checks that fix the radii",
    )
    p.add_argument("--zoo", choices=ZOOS, default="vision", help=f"{', '.join(ZOOS)} (vision)")
    p.add_argument(
        "--preset",
        choices=sorted({name for _, name in PRESETS}),
        default="smoke",
        help="smoke, full (vision, text, vision-finetune), seeds or hparams (text: the "
        "seed and hyperparameter populations); (smoke)",
    )
    p.add_argument("--pilot-models", type=positive_int, default=2, help="models in the pilot (2)")
    p.add_argument("--out", default="runs/zoo", help="results directory (runs/zoo)")
    p.add_argument("--n-models", type=positive_int, help="override the preset's number of models")
    p.add_argument("--target", type=positive_float, help="calibration target median loss increase")
    p.add_argument(
        "--seed-noise",
        metavar="ENDPOINTS_JSON",
        help="report of a star-design population: the seed population's endpoints.json, "
        "whose gap sd marks the one-axis pairs above seed noise",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (1)")
    add_device(p)
    p.add_argument("--no-progress", action="store_true", help="no progress reports")


def _parser() -> argparse.ArgumentParser:
    from geosharp.cli.options import Parser

    p = Parser(prog="geosharp zoo", description=DESCRIPTION)
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run(_parser().parse_args(argv))


def _seed_noise(args: argparse.Namespace, preset) -> float | None:
    """The gap's sd in the seed population's ``endpoints.json`` (``--seed-noise``),
    checked before any work."""
    if args.seed_noise is None:
        return None
    if preset.design != "star" or args.action not in ("report", "all"):
        raise UsageError(
            "--seed-noise applies to the report of a star-design population "
            "(e.g. zoo report --zoo text --preset hparams): leave it out here"
        )
    path = Path(args.seed_noise)
    try:
        sd = json.loads(path.read_text())["spread"]["error_gap"]["sd"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(
            f"--seed-noise {path}: not a readable endpoints.json with the gap's spread; "
            "pass the seed population's report/endpoints.json"
        ) from None
    if not isinstance(sd, (int, float)) or not sd >= 0:
        raise UsageError(f"--seed-noise {path}: the gap's sd is {sd!r}, not a number >= 0")
    return float(sd)


def run(args: argparse.Namespace) -> int:
    """Run the zoo action for parsed options; settings are checked before any work."""

    from geosharp.cli.options import check_device

    preset = get_preset(args.zoo, args.preset)
    if args.n_models is not None:
        preset = dataclasses.replace(preset, n_models=args.n_models)
    device = check_device(args.device)
    check_preset(preset, args.out)
    seed_sd = _seed_noise(args, preset)
    if args.action in ("report", "all"):
        require_matplotlib()  # the report's figures; before hours of training
    torch.set_num_threads(max(1, args.threads))
    rank, world = gd.init()  # under torchrun every rank takes its share of the models
    who = f"[rank {rank}/{world}] " if world > 1 else ""
    progress = not args.no_progress and rank == 0
    if args.action in ("train", "all"):
        ids = train_zoo(preset, args.out, progress=progress, device=device)
        print(f"{who}trained {len(ids)} model(s) in {Path(args.out) / preset.zoo / 'models'}")
        gd.barrier()
    if args.action in ("measure", "all"):
        ids = measure_zoo(preset, args.out, progress=progress, device=device)
        print(f"{who}measured {len(ids)} model(s) in {Path(args.out) / preset.zoo / 'measures'}")
        gd.barrier()
    if args.action == "pilot":
        records = pilot_zoo(
            preset, args.out, n_models=args.pilot_models, progress=progress, device=device
        )
        path = Path(args.out) / preset.zoo / "pilot" / "pilot.md"
        if rank == 0:
            write_text_atomic(path, format_pilot(records))
            print(f"pilot of {len(records)} models: {path}")
    if args.action in ("report", "all") and rank == 0:
        summary = report_zoo(
            preset,
            args.out,
            target=args.target,
            population=f"{args.zoo}/{args.preset}",
            seed_sd=seed_sd,
        )
        path = Path(args.out) / preset.zoo / "report" / "report.md"
        print(f"report of {summary['n_models']} models: {path}")
    return 0
