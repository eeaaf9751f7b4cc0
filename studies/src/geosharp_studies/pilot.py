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

from geosharp.measures import DEFAULT_RHO, WorstCase, sharpness

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
    sharpness_kwargs = _with_symmetries(model, batches, loss_fn, sharpness_kwargs)
    out = {}
    for name in measures:
        rhos = [DEFAULT_RHO[name] * f for f in factors]
        values = [
            sharpness(
                model,
                batches,
                loss_fn,
                measure=name,
                rho=rho,
                estimator=WorstCase(n_iters=n_iters),
                seed=seed,
                **sharpness_kwargs,
            ).value
            for rho in rhos
        ]
        ratios = [b / a if a > 0 else float("nan") for a, b in itertools.pairwise(values)]
        out[name] = dict(factors=factors, rho=rhos, value=values, ratio=ratios)
    return out


def _with_symmetries(model, batches, loss_fn, kwargs: dict) -> dict:
    """``kwargs`` with the model's symmetries, found once on the first batch, for the
    several measurements that follow, and ``nonfinite="inf"`` unless it says otherwise."""
    kwargs = {"nonfinite": "inf", **kwargs}  # a broken radius is a ratio of inf, not a stop
    if "symmetries" in kwargs:
        return kwargs
    from geosharp.symmetry import find_symmetries

    batches = list(batches)
    return {**kwargs, "symmetries": find_symmetries(model, batches[0], loss_fn=loss_fn, warn=False)}


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
    sharpness_kwargs = _with_symmetries(model, batches, loss_fn, sharpness_kwargs)

    def run(estimator: WorstCase) -> float:
        return sharpness(
            model, batches, loss_fn, measure, rho, estimator, seed=seed, **sharpness_kwargs
        ).value

    base = run(WorstCase(n_iters))
    longer = run(WorstCase(long_iters))
    several = run(WorstCase(n_iters, starts=starts))
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


DESCRIPTION = (
    "Pilot of the seed-population study: train one MiniLM-L6 fine-tune with the fixed "
    "recipe, record s(2 rho)/s(rho) over a doubling grid and how much more Auto-PGD steps "
    "or starts move the best value (no generalisation gap is looked at)."
)


def add_arguments(p) -> None:
    """The pilot's command-line options (``geosharp study pilot --help``)."""
    from geosharp.cli.options import add_seed, positive_float, positive_int
    from geosharp.measures import MEASURES

    p.add_argument("--out", default="runs/pilot", help="results directory (runs/pilot)")
    p.add_argument(
        "--measures",
        nargs="+",
        choices=list(MEASURES),
        default=["adaptive", "geodesic-inv", "geodesic-mix"],
        metavar="M",
    )
    p.add_argument(
        "--factors",
        nargs="+",
        type=positive_float,
        default=[1, 2, 4, 8, 16, 32],
        help="radii as multiples of each measure's default, doubling (1 2 4 8 16 32)",
    )
    p.add_argument("--n-points", type=positive_int, default=64, help="training points (64)")
    p.add_argument("--n-iters", type=positive_int, default=20, help="Auto-PGD steps (20)")
    p.add_argument("--long-iters", type=positive_int, default=50, help="longer run (50)")
    p.add_argument("--starts", type=positive_int, default=3, help="starts to compare (3)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (2)")
    add_seed(p, "model's training")


def run(args) -> int:
    """Train one model with ``SEED_RECIPE``, measure, write ``pilot.json``."""
    import json
    import time
    from pathlib import Path

    import torch

    from geosharp.io import write_json_atomic

    from .zoo.presets import SEED_RECIPE
    from .zoo.tasks import task_for
    from .zoo.train import train_one

    torch.set_num_threads(args.threads)
    out = Path(args.out) / "pilot.json"
    hp = dict(SEED_RECIPE, seed=args.seed, id=f"pilot-{args.seed}")
    start = time.time()
    model, metrics = train_one(hp, "text", 2000)
    task = task_for("text")
    n = args.n_points
    batches = task.batches(task.train_set(hp), n, n)
    # the 11.7M-row word-embedding table is left unperturbed, as in the text zoos
    frozen = {"bert.embeddings.word_embeddings.weight"}
    params = [name for name, _ in model.named_parameters() if name not in frozen]
    loss = task.loss
    record = dict(hyperparameters=hp, metrics=metrics, n_points=n, unperturbed=sorted(frozen))
    record["radius_pilot"] = radius_pilot(
        model, batches, loss, args.measures, args.factors, args.n_iters, parameters=params
    )
    write_json_atomic(out, record)
    record["maximiser"] = {}
    for name, entry in record["radius_pilot"].items():
        factor = primary_factor(entry) or entry["factors"][-1]
        rho = entry["rho"][entry["factors"].index(factor)]
        check = maximiser_check(
            model,
            batches,
            loss,
            name,
            rho,
            args.n_iters,
            args.long_iters,
            args.starts,
            parameters=params,
        )
        record["maximiser"][name] = dict(check, factor=factor)
        write_json_atomic(out, record)
    record["seconds"] = time.time() - start
    write_json_atomic(out, record)
    print(json.dumps({k: record[k] for k in ("metrics", "maximiser")}, indent=1))
    return 0
