"""Rank correlation for sharpness studies: Kendall's tau and bootstrap intervals.

The paper (and Dziugaite et al. 2020, Jiang et al. 2020, Andriushchenko et al. 2023)
compares sharpness with the generalization gap through Kendall's rank correlation

    tau = 2 / (N (N - 1)) * sum_{i<j} sign(a_i - a_j) sign(b_i - b_j)

(``variant="a"``; tied pairs count 0). ``variant="b"`` divides by the geometric mean of
the numbers of pairs untied in ``a`` and in ``b`` instead (SciPy's default); both agree
when there are no ties.

>>> kendall_tau([1, 2, 3, 4], [10, 20, 30, 40])
1.0
>>> kendall_tau([1, 2, 3, 4], [4, 3, 2, 1])
-1.0
>>> kendall_tau([1, 2, 3], [1, 3, 2])  # (+1 + 1 - 1) / 3
0.3333333333333333
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BootstrapCI", "bootstrap_ci", "kendall_tau", "kendall_tau_with_ci"]


def _pair_signs(x: np.ndarray) -> np.ndarray:
    """``sign(x_i - x_j)`` for ``i < j`` (a flat vector of ``N (N - 1) / 2`` entries)."""
    i, j = np.triu_indices(len(x), k=1)
    return np.sign(x[i] - x[j])


def kendall_tau(a: Sequence[float], b: Sequence[float], variant: str = "a") -> float:
    """Kendall's rank correlation between ``a`` and ``b`` (``variant`` ``"a"`` or
    ``"b"``). NaN when fewer than two points, or (``"b"``) when one side is constant."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same length, got {a.size} and {b.size}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("kendall_tau needs finite values")
    if variant not in ("a", "b"):
        raise ValueError(f"variant must be 'a' or 'b', got {variant!r}")
    n = a.size
    if n < 2:
        return float("nan")
    sa, sb = _pair_signs(a), _pair_signs(b)
    concordance = float(np.sum(sa * sb))
    if variant == "a":
        return concordance / (n * (n - 1) / 2)
    denominator = np.sqrt(float(np.count_nonzero(sa)) * float(np.count_nonzero(sb)))
    return concordance / denominator if denominator > 0 else float("nan")


@dataclass(frozen=True)
class BootstrapCI:
    """A statistic, its percentile bootstrap interval and the bootstrap standard error."""

    estimate: float
    low: float
    high: float
    std_error: float
    level: float
    n_boot: int

    def to_dict(self) -> dict:
        return {
            "estimate": self.estimate,
            "low": self.low,
            "high": self.high,
            "std_error": self.std_error,
            "level": self.level,
            "n_boot": self.n_boot,
        }

    def __str__(self) -> str:
        pct = round(100 * self.level)
        return f"{self.estimate:+.3f} [{self.low:+.3f}, {self.high:+.3f}] ({pct}% CI)"


def bootstrap_ci(
    statistic: Callable[..., float],
    *samples: Sequence[float],
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapCI:
    """Percentile bootstrap interval of ``statistic(*samples)``.

    The samples are paired (same length ``N``): each replicate draws ``N`` indices with
    replacement and applies them to every sample. Replicates whose statistic is NaN
    (e.g. a constant resample) are dropped. Seeded; the global RNG is not touched.

    >>> ci = bootstrap_ci(kendall_tau, [1, 2, 3, 4, 5, 6], [1, 3, 2, 4, 6, 5], n_boot=200)
    >>> ci.low <= ci.estimate <= ci.high
    True
    """
    if not samples:
        raise ValueError("bootstrap_ci needs at least one sample")
    arrays = [np.asarray(s, dtype=np.float64) for s in samples]
    n = len(arrays[0])
    if any(len(x) != n for x in arrays):
        raise ValueError("all samples must have the same length")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    estimate = float(statistic(*arrays))
    rng = np.random.default_rng(seed)
    replicates = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, size=n)
        value = float(statistic(*(x[idx] for x in arrays)))
        if np.isfinite(value):
            replicates.append(value)
    if not replicates:
        nan = float("nan")
        return BootstrapCI(estimate, nan, nan, nan, level, 0)
    reps = np.asarray(replicates)
    alpha = 0.5 * (1.0 - level)
    low, high = np.quantile(reps, [alpha, 1.0 - alpha])
    std_error = float(reps.std(ddof=1)) if len(reps) > 1 else 0.0
    return BootstrapCI(estimate, float(low), float(high), std_error, level, len(reps))


def kendall_tau_with_ci(
    a: Sequence[float],
    b: Sequence[float],
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    variant: str = "b",
) -> BootstrapCI:
    """Kendall's tau of ``(a, b)`` with a percentile bootstrap interval over the points.

    Resamples repeat points, and a repeated point forms a tied pair: ``tau_a`` counts it
    as 0 and is biased towards 0 on resamples, ``tau_b`` leaves it out. Hence the
    default ``variant="b"``, which equals ``tau_a`` on data without ties.
    """

    def tau(x: np.ndarray, y: np.ndarray) -> float:
        return kendall_tau(x, y, variant=variant)

    return bootstrap_ci(tau, a, b, n_boot=n_boot, level=level, seed=seed)
