"""The numbers the docs give about the committed zoos (studies/docs/zoo.md, "What these zoos
can and cannot show"), recomputed from studies/results/zoo/*/models.csv."""

import csv
import itertools
from pathlib import Path

import numpy as np
import pytest

from geosharp.measures import DEFAULT_RHO
from geosharp_studies.stats import kendall_tau, partial_tau, tau_difference

RESULTS = Path(__file__).resolve().parents[1] / "results" / "zoo"
MAIN = ("adaptive", "geodesic-inv", "geodesic-mix")


def _zoo(name: str):
    with (RESULTS / name / "models.csv").open() as f:
        rows = list(csv.DictReader(f))
    column = lambda key: np.array([float(r[key]) for r in rows])  # noqa: E731
    grid = {}
    for m in MAIN:
        keys = sorted(
            (k for k in rows[0] if k.startswith(m + "@")), key=lambda k: float(k[len(m) + 1 :])
        )
        grid[m] = {float(k[len(m) + 1 :]): column(k) for k in keys}
    return column, grid


@pytest.mark.parametrize("zoo, n_high_loss", [("text", 22), ("vision", 41)])
def test_under_trained(zoo, n_high_loss):
    column, _ = _zoo(zoo)
    assert int((column("train_loss") > 0.6).sum()) == n_high_loss


def test_text_zoo_is_in_the_first_order_regime_and_follows_the_training_loss():
    column, grid = _zoo("text")
    gap, loss = column("error_gap"), column("train_loss")
    for m, (low, high) in zip(MAIN, [(4.0, 4.11), (4.0, 4.82), (4.0, 4.06)]):
        radii = sorted(grid[m])
        ratio = grid[m][radii[1]] / grid[m][radii[0]]  # s(4 rho) / s(rho)
        assert (round(ratio.min(), 2), round(ratio.max(), 2)) == (low, high), m
    assert round(kendall_tau(gap, column("train_error"), "b"), 2) == -0.52
    measured = {m: grid[m][DEFAULT_RHO[m]] for m in MAIN}
    assert [round(kendall_tau(measured[m], loss, "b"), 2) for m in MAIN] == [-0.53, -0.69, -0.66]
    assert [round(partial_tau(measured[m], gap, loss), 2) for m in MAIN] == [0.17, 0.10, 0.08]
    diff = tau_difference(measured["geodesic-inv"], measured["adaptive"], gap, n_boot=1000)
    assert [round(x, 2) for x in (diff.estimate, diff.low, diff.high)] == [0.01, -0.09, 0.10]


def test_vision_zoo_gap_follows_label_noise():
    column, grid = _zoo("vision")
    gap = column("error_gap")
    assert round(kendall_tau(column("label_noise"), gap, "b"), 2) == -0.69
    for m, (low, high) in zip(MAIN, [(2.03, 2.29), (2.13, 3.12), (2.19, 3.37)]):
        radii = sorted(grid[m])
        medians = [np.median(grid[m][b] / grid[m][a]) for a, b in itertools.pairwise(radii)]
        assert (round(min(medians), 2), round(max(medians), 2)) == (low, high), m
    measured = {m: grid[m][DEFAULT_RHO[m]] for m in MAIN}
    diff = tau_difference(measured["geodesic-inv"], measured["adaptive"], gap, n_boot=1000)
    assert [round(x, 2) for x in (diff.estimate, diff.low, diff.high)] == [0.21, 0.02, 0.41]


@pytest.mark.parametrize(
    "seed, train_error, factors, ratios",
    [
        (
            0,
            0.005,
            {"adaptive": 8.0, "geodesic-inv": 1.0, "geodesic-mix": 8.0},
            {
                "adaptive": [2.09, 2.26, 2.95, 4.36, 5.29],
                "geodesic-inv": [5.06, 3.18, 1.54, 1.18, 1.04],
                "geodesic-mix": [2.12, 2.32, 2.97, 4.25, 4.87],
            },
        ),
        (
            1,
            0.006,
            {"adaptive": 4.0, "geodesic-inv": 1.0, "geodesic-mix": 4.0},
            {
                "adaptive": [2.24, 2.50, 3.11, 4.53, 5.68],
                "geodesic-inv": [5.73, 3.69, 1.58, 1.14, 1.05],
                "geodesic-mix": [2.27, 2.55, 3.08, 4.26, 5.44],
            },
        ),
    ],
)
def test_pilot_numbers_in_the_docs(seed, train_error, factors, ratios):
    import json

    from geosharp_studies.pilot import primary_factor

    path = RESULTS.parent / "study" / "pilot" / f"pilot-seed{seed}.json"
    record = json.loads(path.read_text())
    assert record["metrics"]["train_error"] == train_error
    pilot = record["radius_pilot"]
    assert {m: primary_factor(e) for m, e in pilot.items()} == factors
    assert {m: [round(r, 2) for r in e["ratio"]] for m, e in pilot.items()} == ratios
    for check in record["maximiser"].values():
        assert check["move_long"] < 1e-6 and check["move_starts"] < 1e-6
