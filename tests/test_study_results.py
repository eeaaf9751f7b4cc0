"""The committed endpoints of the decisive study's populations are recomputed from their
committed ``models.csv`` with the committed code (every number in the docs comes from
these files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from geosharp.studies.zoo import get_preset
from geosharp.studies.zoo.report import endpoint_study, rows_from_table

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "study"
POPULATIONS = {"vision-finetune": ("vision-finetune", "full")}


@pytest.mark.parametrize("folder", sorted(POPULATIONS))
def test_endpoints_recomputed_from_models_csv(folder):
    stored = json.loads((RESULTS / folder / "endpoints.json").read_text())
    rows = rows_from_table((RESULTS / folder / "models.csv").read_text())
    fresh = endpoint_study(get_preset(*POPULATIONS[folder]), rows, stored["population"])
    assert fresh["n_models"] == stored["n_models"] == len(rows)
    for name, entry in stored["measures"].items():
        assert fresh["measures"][name]["rho"] == entry["rho"]
        assert fresh["measures"][name]["tau"] == pytest.approx(entry["tau"], abs=1e-12)
    for name, entry in stored["differences"].items():
        assert fresh["differences"][name]["tau_diff"] == pytest.approx(entry["tau_diff"], abs=1e-12)
        assert fresh["differences"][name]["ci"] == pytest.approx(entry["ci"], abs=1e-12)
    for name, entry in stored["baselines"].items():
        assert fresh["baselines"][name]["tau"] == pytest.approx(entry["tau"], abs=1e-12)
    assert set(fresh.get("secondary", {})) == set(stored.get("secondary", {}))
    for name, entry in stored.get("secondary", {}).items():
        again = fresh["secondary"][name]
        assert again["rho"] == entry["rho"] and again["tau"] == pytest.approx(entry["tau"])
        diff = again["main_minus_this"]
        assert diff["ci"] == pytest.approx(entry["main_minus_this"]["ci"], abs=1e-12)
