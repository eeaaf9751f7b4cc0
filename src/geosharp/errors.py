"""Errors that are the user's to fix, told apart from bugs of ours, and the warning
that part of a model's symmetry is not used.

A :class:`UsageError` names the problem and the fix in one sentence. The command line
prints it as one line and exits with status 2; any other exception is a bug and shows
a traceback. Both classes derive from the built-in error a Python caller would expect
(``ValueError``, ``FileNotFoundError``), so library callers catch them as usual.
"""

from __future__ import annotations

__all__ = [
    "MissingDependencyError",
    "MissingInputError",
    "PrecisionWarning",
    "SymmetryWarning",
    "UsageError",
    "real_number",
    "require",
    "require_all",
    "warn_user",
]


class UsageError(ValueError):
    """A bad argument, path or data set: the message says what is wrong and how to fix it."""


class MissingInputError(UsageError, FileNotFoundError):
    """A file or directory the user named does not exist or lacks what is needed."""


class MissingDependencyError(UsageError, ImportError):
    """An optional package is needed for what was asked: the message says which."""


EXTRAS = {"transformers": "hf", "sklearn": "data", "matplotlib": "plots", "datasets": "datasets"}
"""The extra of ``geosharp`` that installs each optional package."""
PACKAGES = {"sklearn": "scikit-learn"}
"""The names packages are installed by, where they differ from the module's."""


def require_all(modules: tuple[str, ...], purpose: str) -> None:
    """A :class:`MissingDependencyError` naming every module of ``modules`` that is not
    installed, and the extras that install them, if any is missing."""
    import importlib

    def absent(module: str) -> bool:
        try:
            importlib.import_module(module)
        except ImportError:
            return True
        return False

    missing = [m for m in modules if absent(m)]
    if missing:
        extras = ",".join(EXTRAS.get(m, m) for m in missing)
        raise MissingDependencyError(
            f"{purpose} needs {' and '.join(PACKAGES.get(m, m) for m in missing)}: "
            f"pip install 'geosharp[{extras}]'"
        )


def require(module: str, purpose: str):
    """The module ``module`` (imported), or a :class:`MissingDependencyError` saying
    that ``purpose`` needs it and how to install it.

    >>> require("math", "counting").pi > 3
    True
    >>> require("no_such_package", "this")
    Traceback (most recent call last):
    geosharp.errors.MissingDependencyError: this needs no_such_package: pip install no_such_package
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        extra = EXTRAS.get(top)
        name = PACKAGES.get(top, top)
        how = f"pip install 'geosharp[{extra}]'" if extra else f"pip install {name}"
        raise MissingDependencyError(f"{purpose} needs {name}: {how}") from None


def real_number(value: object, name: str) -> float:
    """``value`` as a float if it is a real number (Python, NumPy, or a one-element
    torch tensor), else a ``TypeError`` naming ``name``; booleans are not numbers.

    >>> import numpy as np
    >>> real_number(np.float32(0.5), "rho")
    0.5
    >>> real_number(True, "rho")
    Traceback (most recent call last):
    TypeError: rho must be a number, got bool True
    """
    number = value
    if hasattr(value, "item") and hasattr(value, "shape"):  # NumPy scalar or torch tensor
        size = getattr(value, "numel", lambda: getattr(value, "size", 0))()
        is_complex = getattr(getattr(value, "dtype", None), "is_complex", False)
        number = value.item() if size == 1 and not is_complex else None  # type: ignore[union-attr]
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(number)


class SymmetryWarning(UserWarning):
    """A measure or discovery says that part of a model's symmetry is not used: an
    attention module whose symmetry geosharp does not understand, or a pair that failed
    its check. The command line prints its own line instead."""


class PrecisionWarning(UserWarning):
    """A measured value is within 10x of the round-off floor of the loss at the
    precision it was computed in: the perturbation is near what that precision can
    see. The command line prints its own line instead."""


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's call: the first frame outside geosharp
    and the decorators that wrap its functions (torch's, contextlib's)."""
    import contextlib
    import os
    import sys
    import warnings

    import torch

    ours = (
        os.path.dirname(__file__) + os.sep,
        os.path.dirname(torch.__file__) + os.sep,
        contextlib.__file__,
    )
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
