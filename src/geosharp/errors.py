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
]


class UsageError(ValueError):
    """A bad argument, path or data set: the message says what is wrong and how to fix it."""


class MissingInputError(UsageError, FileNotFoundError):
    """A file or directory the user named does not exist or lacks what is needed."""


class MissingDependencyError(UsageError, ImportError):
    """An optional package is needed for what was asked: the message says which."""


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
