"""Command-line interface: one tree of commands, every option shown by ``--help``.

``geosharp demo | measure | symmetries | study {diagonal,toy,paper} | zoo``. A user error
(bad argument, missing file, data that does not fit the model) prints one line
``geosharp: error: ...`` naming the problem and the fix, and exits with status 2;
``--debug`` shows the traceback instead. Any other exception is a bug and is raised.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import torch

from .errors import UsageError
from .options import Parser, add_json, add_seed, at_least_one, positive_int

__all__ = ["build_parser", "main"]

# `geosharp study NAME` and `geosharp zoo`: modules with DESCRIPTION, add_arguments(parser)
# and run(args).
STUDIES = {
    "diagonal": "geosharp.studies.diagonal",
    "toy": "geosharp.studies.toy",
    "paper": "geosharp.studies.paper",
    "pilot": "geosharp.studies.pilot",
}
ZOO = "geosharp.studies.zoo"


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .options import check_output_path

    check_output_path(args.json)
    return run_demo(seed=args.seed, n_iters=args.n_iters, cond=args.cond, json_path=args.json)


def _run_measure(args: argparse.Namespace) -> int:
    from .commands import run_measure

    return run_measure(args)


def _run_symmetries(args: argparse.Namespace) -> int:
    from .commands import run_symmetries

    return run_symmetries(args)


def _module_runner(module_name: str):
    def run(args: argparse.Namespace) -> int:
        return int(importlib.import_module(module_name).run(args) or 0)

    return run


def build_parser() -> argparse.ArgumentParser:
    from .commands import add_measure_arguments, add_symmetries_arguments

    parser = Parser(
        prog="geosharp",
        description="Symmetry-aware (geodesic) sharpness of neural networks.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors too")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description or help)

    demo = command(
        "demo",
        "train a tiny ViT on digits, measure adaptive vs geodesic sharpness, "
        "re-parameterise by a random symmetry and measure again",
    )
    add_seed(demo, "data split, training and measures")
    demo.add_argument("--n-iters", type=positive_int, default=20, help="Auto-PGD steps (20)")
    demo.add_argument(
        "--cond",
        type=at_least_one,
        default=100.0,
        help="condition number of the random symmetry transforms (100)",
    )
    add_json(demo)
    demo.set_defaults(run=_run_demo)

    measure = command("measure", "measure the sharpness of a Hugging Face checkpoint on data")
    add_measure_arguments(measure)
    measure.set_defaults(run=_run_measure)

    symmetries = command("symmetries", "list the symmetric pairs of a model and self-check them")
    add_symmetries_arguments(symmetries)
    symmetries.set_defaults(run=_run_symmetries)

    study = command("study", "run a study: " + ", ".join(STUDIES))
    studies = study.add_subparsers(dest="study", required=True, metavar="STUDY")
    for name, module_name in STUDIES.items():
        module = importlib.import_module(module_name)
        p = studies.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        module.add_arguments(p)
        p.set_defaults(run=_module_runner(module_name))

    zoo_module = importlib.import_module(ZOO)
    zoo = command("zoo", "model zoos: train | measure | report | all", zoo_module.DESCRIPTION)
    zoo_module.add_arguments(zoo)
    zoo.set_defaults(run=_module_runner(ZOO))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    try:
        args = build_parser().parse_args([a for a in argv if a != "--debug"])
    except SystemExit as exit:  # --help (0) or a bad option (2, message printed)
        return int(exit.code or 0)
    try:
        return int(args.run(args) or 0)
    except UsageError as err:
        if debug:
            raise
        message = " ".join(str(err).split())  # one line
        print(f"geosharp: error: {message}", file=sys.stderr)
        return 2
    except (MemoryError, torch.OutOfMemoryError) as err:
        if debug:
            raise
        print(
            f"geosharp: error: out of memory ({type(err).__name__}): lower --batch-size or "
            "--n-points, or use --autocast bf16",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("geosharp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
