"""The study's endpoints on a synthetic population whose answer is known."""

import json

import numpy as np
import pytest

from geosharp.io import write_json_atomic
from geosharp_studies.endpoints import Protocol, endpoints, plot_tau_curves, tau_curves


def _population(n=30, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        gap = float(rng.uniform())
        scale_adaptive = float(rng.lognormal())  # unrelated to the gap
        scale_inv = float(np.exp(3 * gap + 0.1 * rng.normal()))  # follows the gap
        rows.append(
            dict(
                id=f"m{i}",
                train_error=float(rng.uniform(0, 0.05)),
                train_loss=float(rng.uniform(0.01, 0.1)),
                error_gap=gap,
                lr=float(rng.choice([1e-5, 3e-5])),
                measures={
                    "adaptive": {rho: scale_adaptive * rho**2 for rho in (0.05, 0.1, 0.2)},
                    "geodesic-inv": {rho: scale_inv * rho**2 for rho in (0.0125, 0.025, 0.05)},
                },
            )
        )
    rows.append(dict(rows[0], id="noisy", train_error=0.2))
    broken = dict(rows[1], id="broken")
    broken["measures"] = dict(rows[1]["measures"], adaptive={0.05: float("nan"), 0.1: 1, 0.2: 1})
    rows.append(broken)
    return rows


PROTOCOL = Protocol(
    population="synthetic", target=0.01, n_points=128, batch_size=64, n_iters=20, n_boot=300
)


def test_endpoints_find_the_measure_that_follows_the_gap(tmp_path):
    rows = _population()
    result = endpoints(rows, PROTOCOL, ["adaptive", "geodesic-inv"])
    assert result["n_models"] == 30 and result["n_excluded"] == 2
    reasons = {e["id"]: e["reason"] for e in result["excluded"]}
    assert "training error" in reasons["noisy"] and "non-finite" in reasons["broken"]
    adaptive, inv = result["measures"]["adaptive"], result["measures"]["geodesic-inv"]
    assert adaptive["rho"] == 0.1 and inv["rho"] == 0.05  # calibrated to 0.01
    assert adaptive["median_ratio_2rho"] == pytest.approx(4.0)  # values grow as rho^2
    assert inv["median_ratio_2rho"] is None  # 2 rho is off the grid
    assert inv["median_ratio_from_half"] == pytest.approx(4.0)  # rho / 2 is on it
    assert adaptive["median_ratio_from_half"] == pytest.approx(4.0)
    assert inv["tau"] > 0.8 and adaptive["ci"][0] < 0 < adaptive["ci"][1]
    diff = result["differences"]["geodesic-inv minus adaptive"]
    assert diff["ci"][0] > 0.5 and diff["abs_ci"][0] > 0.3
    assert len(result["differences_by_factor"]["geodesic-inv minus adaptive"]) == 3
    assert set(result["baselines"]) == {"train_loss", "train_error", "lr"}
    path = tmp_path / "endpoints.json"
    write_json_atomic(path, result)
    text = path.read_text()
    assert "NaN" not in text and json.loads(text)["population"] == "synthetic"
    assert endpoints(rows, PROTOCOL, ["adaptive", "geodesic-inv"]) == result  # seeded


def test_only_the_compared_measures_are_differenced():
    """An extra measure (here ``adaptive-linf``) is calibrated and reported but is not a
    primary endpoint unless the protocol compares it; the others' numbers stay the same."""
    import dataclasses

    rows = _population()
    for r in rows:
        r["measures"] = dict(r["measures"], **{"adaptive-linf": r["measures"]["adaptive"]})
    base = endpoints(rows, PROTOCOL, ["adaptive", "geodesic-inv"])
    every = endpoints(rows, PROTOCOL, ["adaptive", "geodesic-inv", "adaptive-linf"])
    assert set(every["differences"]) == {
        "geodesic-inv minus adaptive",
        "adaptive-linf minus adaptive",
    }
    chosen = dataclasses.replace(PROTOCOL, compared=("geodesic-inv",))
    some = endpoints(rows, chosen, ["adaptive", "geodesic-inv", "adaptive-linf"])
    assert set(some["differences"]) == {"geodesic-inv minus adaptive"}
    assert some["differences"] == base["differences"]
    assert some["measures"]["adaptive-linf"]["rho"] == base["measures"]["adaptive"]["rho"]


def test_too_few_models_and_the_curves(tmp_path):
    rows = _population(n=2)
    with pytest.raises(ValueError, match="inclusion rule"):
        endpoints(rows, PROTOCOL, ["adaptive"])
    curves = tau_curves(_population()[:30], ["adaptive", "geodesic-inv"], n_boot=100)
    assert [p["rho"] for p in curves["adaptive"]] == [0.05, 0.1, 0.2]
    assert all(p["tau"] > 0.8 for p in curves["geodesic-inv"])
    plot_tau_curves(curves, tmp_path / "tau.png")
    assert (tmp_path / "tau.png").stat().st_size > 1000
