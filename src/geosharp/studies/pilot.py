"""Pilot of a sharpness study: pick radii and a maximiser without looking at any gap.

Worst-case sharpness of a model that is not at a minimum, or at a radius too small for
the loss to bend, is ``rho`` times a dual gradient norm: doubling ``rho`` doubles it,
and neither the metric's curvature nor the ball's shape can change a ranking much. So
before a study measures a population, a pilot on a few models records, per measure,

* the **linearity ratio** ``s(2 rho) / s(rho)`` over a doubling grid of radii (2 in the
  first-order regime, above 2 where curvature matters); the primary radius is the
  smallest one whose ratio reaches ``min_ratio`` (3 by default);
* at that radius, how far the best value moves with **more Auto-PGD steps** and with
  **more starts** (random starts besides ``xi = 0``): the protocol is trusted where
  both stay below ``tolerance`` (2%).

Only the models' losses are used, never their generalisation gaps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from ..measures import DEFAULT_RHO, measure_kwargs, sharpness

__all__ = ["maximiser_check", "primary_factor", "radius_pilot"]


def radius_pilot(
    model,
    batches,
    loss_fn,
    measures: Sequence[str],
    factors: Sequence[float] = (1, 2, 4, 8, 16, 32),
    n_iters: int = 20,
    seed: int = 0,
    **sharpness_kwargs,
) -> dict:
    """``{measure: {"factors", "rho", "value", "ratio"}}``: sharpness at ``DEFAULT_RHO
    x factor`` for each factor (a doubling grid), and ``ratio[i] = value[i + 1] /
    value[i]``."""
    factors = [float(f) for f in factors]
    if any(not np.isclose(b, 2 * a) for a, b in itertools.pairwise(factors)):
        raise ValueError(f"factors must double from one to the next, got {factors}")
    out = {}
    for name in measures:
        rhos = [DEFAULT_RHO[name] * f for f in factors]
        values = [
            sharpness(
                model,
                batches,
                loss_fn,
                rho=rho,
                n_iters=n_iters,
                seed=seed,
                **{**sharpness_kwargs, **measure_kwargs(name)},
            ).value
            for rho in rhos
        ]
        ratios = [b / a if a > 0 else float("nan") for a, b in itertools.pairwise(values)]
        out[name] = dict(factors=factors, rho=rhos, value=values, ratio=ratios)
    return out


def primary_factor(entry: dict, min_ratio: float = 3.0) -> float | None:
    """The smallest factor of a :func:`radius_pilot` entry whose ratio ``s(2 rho) /
    s(rho)`` reaches ``min_ratio`` (``None`` if none does).

    >>> primary_factor({"factors": [1, 2, 4, 8], "ratio": [2.0, 2.4, 3.5]})
    4
    """
    for factor, ratio in zip(entry["factors"], entry["ratio"]):
        if np.isfinite(ratio) and ratio >= min_ratio:
            return factor
    return None


def maximiser_check(
    model,
    batches,
    loss_fn,
    measure: str,
    rho: float,
    n_iters: int = 20,
    long_iters: int = 50,
    starts: int = 3,
    seed: int = 0,
    **sharpness_kwargs,
) -> dict:
    """The best value at ``rho`` with ``n_iters`` steps from ``xi = 0``, with
    ``long_iters`` steps, and with ``starts`` starts; and the relative moves of the
    latter two against the first."""

    def run(**kwargs):
        return sharpness(
            model,
            batches,
            loss_fn,
            rho=rho,
            seed=seed,
            **{**sharpness_kwargs, **measure_kwargs(measure)},
            **kwargs,
        ).value

    base = run(n_iters=n_iters)
    longer = run(n_iters=long_iters)
    several = run(n_iters=n_iters, starts=starts)
    return dict(
        rho=rho,
        value=base,
        value_long=longer,
        value_starts=several,
        move_long=abs(longer - base) / abs(base) if base else float("nan"),
        move_starts=abs(several - base) / abs(base) if base else float("nan"),
        n_iters=n_iters,
        long_iters=long_iters,
        starts=starts,
    )
