"""Command-line options shared by every command and study, defined once.

Each ``add_*`` function adds one option to a parser; each ``check_*`` function turns
a value into what the program uses, or raises :class:`~geosharp.errors.UsageError`
with a one-line message. Checks are cheap and run before anything slow (loading a
model, training), so that a typo costs no time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

from ..errors import UsageError

__all__ = [
    "Parser",
    "add_autocast",
    "add_device",
    "add_json",
    "add_seed",
    "at_least_one",
    "autocast_dtype",
    "check_device",
    "check_output_path",
    "note",
    "positive_float",
    "positive_int",
]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def at_least_one(text: str) -> float:
    """argparse type: a finite number >= 1 (a condition number)."""
    value = positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def seed_int(text: str) -> int:
    """argparse type: a seed torch accepts, 0 to 2**63 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**63 - 1, got {text}")
    return value


def add_seed(p: argparse.ArgumentParser, what: str = "random choices") -> None:
    p.add_argument("--seed", type=seed_int, default=0, help=f"seed of the {what} (default: 0)")


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:1, mps, ... (default: auto = this process's GPU if there is "
        "one, else cpu)",
    )


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH ('-': only JSON on stdout)",
    )


def add_autocast(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--autocast",
        choices=("none", "bf16", "fp16"),
        default="none",
        help="run forward/backward under torch.autocast; the perturbation stays float32 "
        "(default: none)",
    )


def autocast_dtype(name: str):
    import torch

    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def check_device(spec: str):
    """The ``torch.device`` for ``--device``; ``auto`` is this process's GPU if any
    (``LOCAL_RANK`` under torchrun), else the CPU. An error names devices that do not
    exist here."""
    import torch

    from .. import distributed as gd

    if spec == "auto":
        return gd.device("auto")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"--device {spec!r} is not a device: use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {spec}: no CUDA GPU is available here; use cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {spec}: there are only {torch.cuda.device_count()} CUDA GPU(s)"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {spec}: MPS is not available here; use cpu or auto")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {spec}: geosharp runs on cpu, cuda or mps")
    return device


def check_output_path(
    path: str | None,
    option: str = "--json",
    protected: dict[str, str | os.PathLike] | None = None,
    force: bool = False,
) -> None:
    """An error unless ``path`` (``None`` and ``-`` pass) can be written: its directory
    exists and takes a test file, it is not a directory, and (unless ``force``) it is
    not one of the user's inputs in ``protected`` (``{"--data": file, "the checkpoint":
    directory}``: the file itself, or anything inside the directory)."""
    if path is None or path == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path} is a directory: give a file name")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {parent} does not exist; create it first")
    if not force:
        where = target.resolve()
        for what, other in (protected or {}).items():
            other = Path(other).resolve()
            if where == other or (other.is_dir() and other in where.parents):
                inside = "is" if where == other else "is inside"
                raise UsageError(
                    f"{option} {path} {inside} {what} ({other}): writing it would destroy "
                    "an input; choose another path (or add --force)"
                )
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{option} {path}: not writable; choose another path")
    try:  # os.access does not know read-only file systems or quotas: try it
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{target.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise UsageError(
            f"{option} {path}: cannot write in {parent} ({err.strerror}); choose another path"
        ) from None


def note(message: str) -> None:
    """One informational line on stderr (stdout stays for results)."""
    print(message, file=sys.stderr, flush=True)
