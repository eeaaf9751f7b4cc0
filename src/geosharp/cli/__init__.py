"""Command-line interface: one tree of commands, every option shown by ``--help``.

``geosharp demo | measure | symmetries``, and the commands other installed packages add
through the entry-point group ``geosharp.commands`` (the research studies of the repository,
``studies/``, add ``study`` and ``zoo``). A user error
(bad argument, missing file, data that does not fit the model) prints one line
``geosharp: error: ...`` naming the problem and the fix, and exits with status 2;
``--debug`` shows the traceback instead. Any other exception is a bug and is raised.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from ..errors import UsageError
from .options import Parser, add_json, add_seed, at_least_one, positive_int

__all__ = ["build_parser", "main"]

# Commands of other packages: each entry point is a function register(command) that adds
# its parsers through command(name, help, description) and sets `run` on them.
PLUGIN_GROUP = "geosharp.commands"
# Where the repository's own plug-in commands come from, for the error when it is missing.
KNOWN_PLUGINS = {"study": "studies/", "zoo": "studies/"}


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


def plugins() -> list:
    """The installed entry points of :data:`PLUGIN_GROUP`, by name."""
    from importlib.metadata import entry_points

    return sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("geosharp")
    except PackageNotFoundError:  # run from a source tree
        from .. import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    from .commands import add_measure_arguments, add_symmetries_arguments

    parser = Parser(
        prog="geosharp",
        description="Symmetry-aware (geodesic) sharpness of neural networks.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors too")
    parser.add_argument("--version", action="version", version=f"geosharp {_version()}")
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

    for plugin in plugins():
        plugin.load()(command)
    parser.commands = set(sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    missing = [a for a in argv[:1] if a in KNOWN_PLUGINS and a not in parser.commands]
    if missing:
        print(
            f"geosharp: error: '{missing[0]}' is a command of the research studies: "
            f"pip install -e {KNOWN_PLUGINS[missing[0]]} (from a clone of the repository)",
            file=sys.stderr,
        )
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:  # --help (0) or a bad option (2, message printed)
        return int(exit.code or 0)
    done = False
    try:
        code, done = int(args.run(args) or 0), True
        return code
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
    finally:
        if not done:  # under torchrun: leave without waiting for the other processes
            from ..distributed import failed

            failed()
