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

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BootstrapCI",
    "above_seed_noise",
    "bootstrap_ci",
    "calibrated_index",
    "granulated_tau",
    "granulated_tau_ci",
    "grouped_granulated_tau",
    "kendall_tau",
    "kendall_tau_with_ci",
    "partial_tau",
    "reach_tau",
    "seed_noise_threshold",
    "split_half",
    "stratified_bootstrap_ci",
    "tau_difference",
]


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
    return float(_tau_rows(a[None], b[None], variant)[0])


@functools.cache
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs ``i < j`` of ``n`` points."""
    return np.triu_indices(n, k=1)


def _tau_rows(a: np.ndarray, b: np.ndarray, variant: str) -> np.ndarray:
    """:func:`kendall_tau` of each row of ``a`` and ``b`` (``(R, N)``, ``N >= 2``): the
    same numbers as row by row (the sums are of small integers, exact in any order)."""
    n = a.shape[1]
    i, j = _pairs(n)
    sa, sb = np.sign(a[:, i] - a[:, j]), np.sign(b[:, i] - b[:, j])
    concordance = np.sum(sa * sb, axis=1)
    if variant == "a":
        return concordance / (n * (n - 1) / 2)
    denominator = np.sqrt(
        np.count_nonzero(sa, axis=1).astype(np.float64) * np.count_nonzero(sb, axis=1)
    )
    safe = np.where(denominator > 0, denominator, 1.0)
    return np.where(denominator > 0, concordance / safe, np.nan)


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
    # the same indices as one draw of n per replicate, in order
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    rows = getattr(statistic, "rows", None)  # the statistic of every replicate at once
    if rows is not None:
        values = rows(*(x[idx] for x in arrays))
    else:
        values = [float(statistic(*(x[i] for x in arrays))) for i in idx]
    return _percentile_ci(estimate, [float(v) for v in values if np.isfinite(v)], level)


def stratified_bootstrap_ci(
    statistic: Callable[[list[tuple[np.ndarray, ...]]], float],
    strata: Sequence[Sequence[Sequence[float]]],
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapCI:
    """Percentile bootstrap of ``statistic(strata)`` resampling within each stratum:
    every replicate draws each stratum's ``N_k`` rows with replacement, independently of
    the others (the populations keep their sizes), and applies them to that stratum's
    paired samples. Replicates whose statistic is NaN are dropped. Seeded.

    >>> strata = [([1, 2, 3, 4], [1, 2, 4, 3]), ([1, 2, 3], [3, 2, 1])]
    >>> mean_tau = lambda s: np.mean([kendall_tau(a, b) for a, b in s])
    >>> ci = stratified_bootstrap_ci(mean_tau, strata, n_boot=200)
    >>> round(ci.estimate, 3), ci.low <= ci.estimate <= ci.high
    (-0.167, True)
    """
    groups = [tuple(np.asarray(x, dtype=np.float64) for x in stratum) for stratum in strata]
    if not groups:
        raise ValueError("stratified_bootstrap_ci needs at least one stratum")
    for group in groups:
        if len({len(x) for x in group}) != 1:
            raise ValueError("the samples of a stratum must have the same length")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    estimate = float(statistic(groups))
    rng = np.random.default_rng(seed)
    replicates = []
    for _ in range(n_boot):
        drawn = []
        for group in groups:
            idx = rng.integers(0, len(group[0]), size=len(group[0]))
            drawn.append(tuple(x[idx] for x in group))
        value = float(statistic(drawn))
        if np.isfinite(value):
            replicates.append(value)
    return _percentile_ci(estimate, replicates, level)


def _percentile_ci(estimate: float, replicates: list[float], level: float) -> BootstrapCI:
    """The percentile interval of the finite ``replicates`` (NaN bounds when none)."""
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

    tau.rows = lambda x, y: _tau_rows(x, y, variant)  # type: ignore[attr-defined]
    return bootstrap_ci(tau, a, b, n_boot=n_boot, level=level, seed=seed)


def partial_tau(x: Sequence[float], y: Sequence[float], z: Sequence[float]) -> float:
    r"""Kendall's partial tau of ``x`` and ``y`` given ``z`` (tau-b throughout):

    .. math:: \tau_{xy \cdot z} = \frac{\tau_{xy} - \tau_{xz}\tau_{yz}}
              {\sqrt{(1 - \tau_{xz}^2)(1 - \tau_{yz}^2)}}

    How much of the rank agreement of ``x`` and ``y`` is left once the part both share
    with ``z`` (e.g. the training loss) is taken out. It is not a test of conditional
    independence: two noisy copies of ``z`` keep a partial tau well above 0. NaN when
    ``z`` orders ``x`` or ``y`` perfectly.

    >>> z = [1, 2, 3, 4, 5, 6]
    >>> round(partial_tau([1, 2, 3, 4, 6, 5], [2, 1, 3, 4, 5, 6], z), 3)  # both follow z
    -0.071
    """
    txy, txz, tyz = (kendall_tau(p, q, "b") for p, q in ((x, y), (x, z), (y, z)))
    denominator = np.sqrt((1.0 - txz**2) * (1.0 - tyz**2))
    return float((txy - txz * tyz) / denominator) if denominator > 0 else float("nan")


def split_half(half_a: Sequence[float], half_b: Sequence[float]) -> dict:
    r"""How reproducibly a measure ranks the models: its values on two disjoint halves
    of the measurement points, one per model in each.

    Returns Kendall's tau-b between the halves, their Pearson correlation ``r``, and the
    Spearman-Brown reliability of the full measurement, :math:`2r / (1 + r)`, the
    correlation expected between two full measurements on independent points.

    >>> out = split_half([1.0, 2.0, 3.0, 4.0], [1.1, 1.9, 3.2, 3.9])
    >>> out["tau"], round(out["pearson"], 3), round(out["spearman_brown"], 3)
    (1.0, 0.993, 0.997)
    """
    a, b = (np.asarray(v, dtype=np.float64) for v in (half_a, half_b))
    r = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
    brown = 2 * r / (1 + r) if np.isfinite(r) and r > -1 else float("nan")
    return dict(tau=float(kendall_tau(a, b, "b")), pearson=r, spearman_brown=brown)


def calibrated_index(values: np.ndarray, target: float) -> int:
    """The radius (row of ``values``, radii x models, loss increases) whose median over
    the models is closest to ``target`` on a log scale: the calibration rule that puts
    every measure at the same typical loss increase.

    >>> calibrated_index(np.array([[1e-4, 2e-4], [1e-3, 3e-3], [1e-2, 1e-2]]), 2e-3)
    1
    """
    medians = np.median(np.asarray(values, dtype=np.float64), axis=1)
    distance = np.abs(np.log(np.maximum(medians, 1e-300)) - np.log(target))
    return int(np.argmin(distance))


def tau_difference(
    a: np.ndarray,
    b: np.ndarray,
    target: Sequence[float],
    select_a: Callable[[np.ndarray], int] | None = None,
    select_b: Callable[[np.ndarray], int] | None = None,
    absolute: bool = False,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapCI:
    """``tau(a, target) - tau(b, target)`` with a paired bootstrap over models.

    ``a`` and ``b`` are the two measures' values, ``(radii, models)`` (or ``(models,)``
    for one radius each); ``select_a``/``select_b`` pick the radius from the models at
    hand (e.g. ``lambda v: calibrated_index(v, 1e-2)``) and are applied again inside
    every resample, so that the interval includes the radius choice. Both taus are
    taken on the same resampled models, which is what makes the difference's interval
    narrower than the two taus' intervals suggest. ``absolute`` compares ``|tau|``.

    >>> gap = np.arange(8.0)
    >>> ci = tau_difference(gap + 0.1, gap[::-1], gap, n_boot=100)
    >>> ci.estimate, ci.low, ci.high
    (2.0, 2.0, 2.0)
    """
    a2, b2 = (np.atleast_2d(np.asarray(x, dtype=np.float64)) for x in (a, b))
    target = np.asarray(target, dtype=np.float64)
    if a2.shape[1] != target.size or b2.shape[1] != target.size:
        raise ValueError("a, b (radii x models) and target must have the same number of models")
    pick_a = select_a or (lambda v: 0)
    pick_b = select_b or (lambda v: 0)
    if (a2.shape[0] > 1 and select_a is None) or (b2.shape[0] > 1 and select_b is None):
        raise ValueError("several radii need select_a/select_b to choose one")

    def statistic(at: np.ndarray, bt: np.ndarray, g: np.ndarray) -> float:
        ta = kendall_tau(at[:, pick_a(at.T)], g, "b")
        tb = kendall_tau(bt[:, pick_b(bt.T)], g, "b")
        return abs(ta) - abs(tb) if absolute else ta - tb

    def rows(at: np.ndarray, bt: np.ndarray, g: np.ndarray) -> np.ndarray:
        """Every replicate at once (``(B, N, radii)``): the radii picked per replicate."""
        ia = np.array([pick_a(x.T) for x in at])
        ib = np.array([pick_b(x.T) for x in bt])
        ta = _tau_rows(np.take_along_axis(at, ia[:, None, None], 2)[..., 0], g, "b")
        tb = _tau_rows(np.take_along_axis(bt, ib[:, None, None], 2)[..., 0], g, "b")
        return np.abs(ta) - np.abs(tb) if absolute else ta - tb

    statistic.rows = rows  # type: ignore[attr-defined]
    return bootstrap_ci(statistic, a2.T, b2.T, target, n_boot=n_boot, level=level, seed=seed)


def granulated_tau(
    values: Sequence[float], gap: Sequence[float], hps: list[dict], axes: Sequence[str]
) -> dict:
    """Granulated Kendall tau (Jiang et al. 2019) for randomly sampled hyperparameters.

    Jiang et al. average, for each axis ``k``, Kendall's tau over groups of models whose
    other hyperparameters are all equal, then average over axes. With random
    hyperparameters such groups are rare, so for axis ``k`` we take the pairs of models
    that differ in axis ``k`` and in the *fewest* other axes present in the zoo
    (``m_k`` others; ``m_k = 0`` is Jiang's exact setting), and let

        tau_k = mean over those pairs of sign(value_i - value_j) sign(gap_i - gap_j).

    On a full grid this equals Jiang's tau_k (every group along axis ``k`` has the same
    number of pairs). Returns ``{"per_axis": {k: {tau, pairs, other_axes_differing}},
    "granulated": mean of the tau_k}``; an axis with a single value in the zoo is left out.

    >>> hps = [{"lr": 1, "wd": 0}, {"lr": 2, "wd": 0}, {"lr": 1, "wd": 1}]
    >>> granulated_tau([1.0, 2.0, 3.0], [1.0, 2.0, 0.0], hps, ["lr", "wd"])["per_axis"]["lr"]
    {'tau': 1.0, 'pairs': 1, 'other_axes_differing': 0}
    """
    v, g = np.asarray(values, float), np.asarray(gap, float)
    n = len(v)
    per_axis = {}
    for k in axes:
        pairs, best_m = [], None
        for i in range(n):
            for j in range(i + 1, n):
                if hps[i][k] == hps[j][k]:
                    continue
                m = sum(hps[i][a] != hps[j][a] for a in axes if a != k)
                if best_m is None or m < best_m:
                    best_m, pairs = m, [(i, j)]
                elif m == best_m:
                    pairs.append((i, j))
        if not pairs:
            continue
        s = [np.sign(v[i] - v[j]) * np.sign(g[i] - g[j]) for i, j in pairs]
        per_axis[k] = dict(tau=float(np.mean(s)), pairs=len(pairs), other_axes_differing=best_m)
    taus = [d["tau"] for d in per_axis.values()]
    return dict(per_axis=per_axis, granulated=float(np.mean(taus)) if taus else float("nan"))


def grouped_granulated_tau(
    values: Sequence[float],
    gap: Sequence[float],
    groups: dict[str, list[list[int]]],
) -> dict:
    """Jiang et al.'s granulated Kendall tau on designed groups.

    ``groups[axis]`` lists groups of model indices that differ in ``axis`` alone (all
    other hyperparameters equal, e.g. a base configuration and its one-axis variants).
    ``tau_axis`` is the mean of Kendall's tau (tau-b) within those groups; the result
    is the mean over axes. Groups of fewer than two models, or where tau is undefined,
    are skipped.

    >>> groups = {"lr": [[0, 1, 2]], "wd": [[0, 3]]}
    >>> grouped_granulated_tau([1, 2, 3, 4], [1, 2, 3, 0], groups)["granulated"]
    0.0
    """
    v, g = np.asarray(values, float), np.asarray(gap, float)
    per_axis = {}
    for axis, members in groups.items():
        taus = [kendall_tau(v[idx], g[idx], "b") for idx in map(list, members) if len(idx) > 1]
        taus = [t for t in taus if np.isfinite(t)]
        if taus:
            per_axis[axis] = dict(tau=float(np.mean(taus)), groups=len(taus))
    values_ = [d["tau"] for d in per_axis.values()]
    return dict(per_axis=per_axis, granulated=float(np.mean(values_)) if values_ else float("nan"))


def granulated_tau_ci(
    values: Sequence[float],
    gap: Sequence[float],
    groups_by_base: list[dict[str, list[int]]],
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapCI:
    """:func:`grouped_granulated_tau` with a bootstrap over base configurations.

    ``groups_by_base[b][axis]`` is the group of base configuration ``b`` along
    ``axis``; a replicate draws the bases with replacement and keeps their groups."""
    n = len(groups_by_base)
    if n < 1:
        raise ValueError("granulated_tau_ci needs at least one base configuration")

    v, g = np.asarray(values, float), np.asarray(gap, float)
    # a group's tau does not depend on which bases a replicate draws: computed once
    cached = [
        {
            axis: kendall_tau(v[list(idx)], g[list(idx)], "b") if len(idx) > 1 else math.nan
            for axis, idx in groups.items()
        }
        for groups in groups_by_base
    ]

    def statistic(chosen: Sequence[int]) -> float:
        """:func:`grouped_granulated_tau` of the chosen bases' groups (the same sums in
        the same order)."""
        taus: dict[str, list[float]] = {}
        for b in chosen:
            for axis, tau in cached[b].items():
                taus.setdefault(axis, []).append(tau)
        means = [
            float(np.mean(f))
            for f in ([x for x in ts if np.isfinite(x)] for ts in taus.values())
            if f
        ]
        return float(np.mean(means)) if means else float("nan")

    estimate = statistic(range(n))
    rng = np.random.default_rng(seed)
    reps = np.array([statistic(rng.integers(0, n, size=n)) for _ in range(n_boot)])
    reps = reps[np.isfinite(reps)]
    if reps.size == 0:
        nan = float("nan")
        return BootstrapCI(estimate, nan, nan, nan, level, 0)
    alpha = 0.5 * (1.0 - level)
    low, high = np.quantile(reps, [alpha, 1.0 - alpha])
    std = float(reps.std(ddof=1)) if reps.size > 1 else 0.0
    return BootstrapCI(estimate, float(low), float(high), std, level, int(reps.size))


def reach_tau(
    values: np.ndarray,
    target: Sequence[float],
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> BootstrapCI:
    """Does a measure's tau with the target follow how far its ball reaches?

    ``values`` is ``(columns, models)``: one column per measure and radius, each a loss
    increase. The statistic is Kendall's tau-b, over the columns, between the median
    loss increase of a column and its tau-b with ``target``; the interval resamples the
    models (every column's median and tau on the same resample). Near +1: tau with the
    target rises with the reach, whichever measure and radius gives it.

    >>> gap = np.arange(10.0)
    >>> columns = np.stack([0.01 * gap[::-1], 1 + gap % 2, 10 + gap])  # tau -1, 0.15, +1
    >>> reach_tau(columns, gap, n_boot=50).estimate
    1.0
    """
    v = np.atleast_2d(np.asarray(values, dtype=np.float64))
    target = np.asarray(target, dtype=np.float64)
    if v.shape[1] != target.size or v.shape[0] < 2:
        raise ValueError("values must be (columns >= 2, models) with one target per model")

    def statistic(vt: np.ndarray, g: np.ndarray) -> float:
        taus = _tau_rows(vt.T, np.broadcast_to(g, vt.T.shape), "b")
        ok = np.isfinite(taus)  # a column constant on a resample has no tau
        return kendall_tau(np.median(vt, axis=0)[ok], taus[ok], "b")

    return bootstrap_ci(statistic, v.T, target, n_boot=n_boot, level=level, seed=seed)


def above_seed_noise(
    gap_a: Sequence[float], gap_b: Sequence[float], seed_sd: float, z: float = 1.96
) -> np.ndarray:
    r"""Whether two models' gaps differ by more than seed noise alone explains:
    ``|g_a - g_b| > z sqrt(2) s``, with ``s`` the sd of the gap over seeds of one recipe
    (a seed population), so ``z sqrt(2) s`` is the half-width of a 95% interval for the
    difference of two independent seeds' gaps.

    >>> above_seed_noise([0.10, 0.10], [0.12, 0.20], 0.01).tolist()
    [False, True]
    """
    diff = np.abs(np.asarray(gap_a, np.float64) - np.asarray(gap_b, np.float64))
    return diff > seed_noise_threshold(seed_sd, z)


def seed_noise_threshold(seed_sd: float, z: float = 1.96) -> float:
    """``z sqrt(2) s``: the gap difference two seeds of one recipe stay below with
    probability 95% (normal gaps, ``z = 1.96``)."""
    if not seed_sd >= 0:
        raise ValueError(f"seed_sd must be a non-negative number, got {seed_sd!r}")
    return float(z * np.sqrt(2.0) * seed_sd)
