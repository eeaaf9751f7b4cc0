"""Command-line interface: ``geosharp demo | measure | symmetries | study | zoo``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# `geosharp study NAME ...` runs `geosharp.studies.NAME.main(argv)`.
STUDIES = {
    "diagonal": "geosharp.studies.diagonal",
    "paper": "geosharp.studies.paper",
    "toy": "geosharp.studies.toy",
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geosharp",
        description="Symmetry-aware (geodesic) sharpness of neural networks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="train a tiny ViT on digits, measure adaptive vs geodesic sharpness, "
        "re-parameterise by a random symmetry and measure again",
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--n-iters", type=int, default=20, help="Auto-PGD steps per batch")
    demo.add_argument(
        "--cond",
        type=float,
        default=100.0,
        help="condition number of the random symmetry transforms",
    )
    demo.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    from .commands import add_measure_arguments, add_symmetries_arguments

    add_measure_arguments(
        sub.add_parser("measure", help="measure the sharpness of a Hugging Face checkpoint on data")
    )
    add_symmetries_arguments(
        sub.add_parser("symmetries", help="list the symmetric pairs of a model and self-check them")
    )

    study = sub.add_parser("study", help="run a study (" + ", ".join(STUDIES) + ")")
    study.add_argument("name", choices=sorted(STUDIES))
    study.add_argument("args", nargs=argparse.REMAINDER, help="options of the study")

    zoo = sub.add_parser(
        "zoo",
        help="model zoos (vision: ViTs on Fashion-MNIST, text: MiniLM on Rotten Tomatoes): "
        "train | measure | report | all",
        add_help=False,
    )
    zoo.add_argument("args", nargs=argparse.REMAINDER, help="see `geosharp zoo --help`")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["zoo"]:  # its own parser, so that `geosharp zoo --help` works
        from .studies.zoo import main as zoo_main

        return int(zoo_main(argv[1:]) or 0)
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(seed=args.seed, n_iters=args.n_iters, cond=args.cond, json_path=args.json)
    if args.command == "measure":
        from .commands import run_measure

        return run_measure(args)
    if args.command == "symmetries":
        from .commands import run_symmetries

        return run_symmetries(args)
    if args.command == "study":
        module = importlib.import_module(STUDIES[args.name])
        return int(module.main(args.args) or 0)
    if args.command == "zoo":
        from .studies.zoo import main as zoo_main

        return int(zoo_main(args.args) or 0)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
