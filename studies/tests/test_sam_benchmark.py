"""The SAM benchmark's summary: radius chosen on validation only, differences paired by
seed, final sharpness summarised only where every run logged it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sam_benchmark.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("sam_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GRIDS = {"adamw": [0.0], "sam": [0.01, 0.1]}


def _rows(sharpness: bool):
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(4):
        base = 0.7 + 0.05 * seed  # seeds differ much more than methods do
        for method, grid in GRIDS.items():
            for rho in grid:
                # rho 0.1 wins on validation but loses on test: the choice must follow
                # validation
                val = base + (0.02 if rho == 0.1 else 0.0)
                test = base + (0.01 if rho == 0.01 else -0.003) + 1e-4 * rng.standard_normal()
                row = dict(
                    method=method,
                    rho=rho,
                    seed=seed,
                    train_acc=1.0,
                    train_loss=0.01,
                    val_acc=val,
                    test_acc=test if method == "sam" else base,
                    seconds_per_step=2.0 if method == "sam" else 1.0,
                )
                if sharpness:
                    row["sharpness"] = {"adaptive@0.05": (0.5 if method == "sam" else 1.0) * base}
                rows.append(row)
    return rows


def test_radius_chosen_on_validation_and_differences_paired(bench):
    summary = bench.summarise(_rows(sharpness=True), list(range(4)), GRIDS)
    sam = summary["sam"]
    assert sam["rho"] == 0.1
    # paired by seed: the seeds' spread (0.05 apart) cancels, leaving -0.003
    assert sam["minus_adamw"] == pytest.approx(-0.003, abs=1e-3)
    lo, hi = sam["minus_adamw_ci"]
    assert hi - lo < 0.01 and lo < -0.003 < hi
    # unpaired, the same test accuracies have an interval wider than the seeds' spread
    assert sam["ci"][1] - sam["ci"][0] > 0.05
    assert sam["time_vs_adamw"] == pytest.approx(2.0)
    sharp = sam["sharpness"]["adaptive@0.05"]
    assert sharp["minus_adamw"] == pytest.approx(-0.5 * np.mean([0.7 + 0.05 * s for s in range(4)]))
    assert "| sam | 0.01 | 0.388 (-0.39 [" in bench.markdown(summary, _Args())


def test_runs_without_sharpness_summarised_without_it(bench):
    summary = bench.summarise(_rows(sharpness=False), list(range(4)), GRIDS)
    assert "sharpness" not in summary["sam"]
    assert "Final sharpness" not in bench.markdown(summary, _Args())


def test_incomplete_grid_left_out(bench):
    rows = [r for r in _rows(sharpness=False) if not (r["method"] == "sam" and r["seed"] == 3)]
    assert "sam" not in bench.summarise(rows, list(range(4)), GRIDS)


class _Args:
    setting, n_train, lr, wd, epochs, batch_size = "overfit", 500, 1e-3, 0.05, 100, 64
