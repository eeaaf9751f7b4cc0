"""The committed endpoints of the decisive study's populations are recomputed from their
committed ``models.csv`` with the committed code (every number in the docs comes from
these files)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from geosharp_studies.stats import kendall_tau
from geosharp_studies.zoo import get_preset
from geosharp_studies.zoo.report import endpoint_study, rows_from_table

RESULTS = Path(__file__).resolve().parents[1] / "results" / "study"


def tau_b(a, b) -> float:
    return kendall_tau(a, b, variant="b")


POPULATIONS = {
    "vision-finetune": ("vision-finetune", "full"),
    "seeds": ("text", "seeds"),
    "hparams": ("text", "hparams"),
}


@pytest.mark.parametrize("folder", sorted(POPULATIONS))
def test_endpoints_recomputed_from_models_csv(folder):
    stored = json.loads((RESULTS / folder / "endpoints.json").read_text())
    rows = rows_from_table((RESULTS / folder / "models.csv").read_text())
    seed_sd = stored.get("granulated", {}).get("seed_noise", {}).get("seed_sd")
    fresh = endpoint_study(get_preset(*POPULATIONS[folder]), rows, stored["population"], seed_sd)
    assert fresh["n_models"] == stored["n_models"] == len(rows) - stored["n_excluded"]
    assert [e["id"] for e in fresh["excluded"]] == [e["id"] for e in stored["excluded"]]
    for name, entry in stored["measures"].items():
        assert fresh["measures"][name]["rho"] == entry["rho"]
        assert fresh["measures"][name]["tau"] == pytest.approx(entry["tau"], abs=1e-12)
        for key in ("median_ratio_2rho", "median_ratio_from_half"):
            assert fresh["measures"][name][key] == pytest.approx(entry[key])
    for name, entry in stored["differences"].items():
        assert fresh["differences"][name]["tau_diff"] == pytest.approx(entry["tau_diff"], abs=1e-12)
        assert fresh["differences"][name]["ci"] == pytest.approx(entry["ci"], abs=1e-12)
    for name, entry in stored["baselines"].items():
        assert fresh["baselines"][name]["tau"] == pytest.approx(entry["tau"], abs=1e-12)
    assert fresh["reach"]["tau"] == pytest.approx(stored["reach"]["tau"], abs=1e-12)
    assert fresh["reach"]["ci"] == pytest.approx(stored["reach"]["ci"], abs=1e-12)
    assert set(fresh.get("secondary", {})) == set(stored.get("secondary", {}))
    for name, entry in stored.get("secondary", {}).items():
        again = fresh["secondary"][name]
        assert again["rho"] == entry["rho"] and again["tau"] == pytest.approx(entry["tau"])
        diff = again["main_minus_this"]
        assert diff["ci"] == pytest.approx(entry["main_minus_this"]["ci"], abs=1e-12)
    assert set(fresh.get("granulated", {})) == set(stored.get("granulated", {}))
    if "granulated" in stored:
        again, entry = fresh["granulated"], stored["granulated"]
        assert again["n_bases"] == entry["n_bases"]
        for name, g in entry["by_measure"].items():
            assert again["by_measure"][name]["granulated"] == pytest.approx(g["granulated"])
            assert again["by_measure"][name]["ci"] == pytest.approx(g["ci"], abs=1e-12)
        noise, stored_noise = again["seed_noise"], entry["seed_noise"]
        assert noise["per_axis"] == stored_noise["per_axis"]
        assert noise["threshold"] == pytest.approx(stored_noise["threshold"])
        assert noise["granulated"] == pytest.approx(stored_noise["granulated"], nan_ok=True)


def test_vision_finetune_geodesic_correction_claims():
    """studies/docs/zoo.md on the secondary pass: the straight line in the geodesic measure's
    ball gives the same values for ``inv`` on every model, and for ``mix`` on all but the
    strongest-regularised fine-tunes, where the geodesic correction raises sharpness."""
    rows = rows_from_table((RESULTS / "vision-finetune" / "models.csv").read_text())
    m = lambda r, key, rho: r["measures"][key][rho]  # noqa: E731
    inv = [m(r, "geodesic-norm-only-inv", 0.05) / m(r, "geodesic-inv", 0.05) for r in rows]
    assert 0.998 < min(inv) and max(inv) < 1.001
    mix = {r["id"]: m(r, "geodesic-norm-only-mix", 0.01) / m(r, "geodesic-mix", 0.01) for r in rows}
    strong = {
        r["id"] for r in rows if r["weight_decay"] == 0.2 and r["lr"] >= 1e-3 and r["epochs"] == 32
    }
    low = {k for k, v in mix.items() if v < 0.95}
    assert len(strong) == 5 and len(low) == 4 and low <= strong
    assert sorted(mix[k] for k in low) == pytest.approx([0.051, 0.106, 0.732, 0.901], abs=1e-3)
    grows = {r["id"]: m(r, "geodesic-mix", 0.01) / m(r, "geodesic-mix", 0.005) for r in rows}
    two = sorted(low, key=mix.get)[:2]
    assert [grows[k] for k in two] == pytest.approx([44.8, 23.8], abs=0.05)
    assert float(np.median(list(grows.values()))) == pytest.approx(3.0, abs=0.05)
    assert all(0.99 < v < 1.01 for k, v in mix.items() if k not in low)
    attn = [m(r, "geodesic-inv-attn", 0.05) / m(r, "geodesic-inv", 0.05) for r in rows]
    assert 0.95 < min(attn) and max(attn) < 1.03


@pytest.mark.parametrize("folder", sorted(POPULATIONS))
def test_summary_calibrates_to_the_presets_target(folder):
    """The exploratory summary uses the target the preset fixed, not one derived from
    the measured values (which would move whenever a measure is added)."""
    summary = json.loads((RESULTS / folder / "summary.json").read_text())
    assert summary["target_median_increase"] == get_preset(*POPULATIONS[folder]).target
    stored = json.loads((RESULTS / folder / "endpoints.json").read_text())
    for name, entry in stored["measures"].items():
        assert summary["calibrated"][name]["rho"] == entry["rho"]


def test_seed_population_tau_changes_sign_along_the_grid():
    """studies/docs/zoo.md on the seed population: at the smallest radius of every grid (linear
    regime) sharpness follows the training loss and correlates negatively with the gap;
    at the largest it follows the test error instead and correlates positively."""
    rows = rows_from_table((RESULTS / "seeds" / "models.csv").read_text())
    col = lambda key: np.array([r[key] for r in rows])  # noqa: E731
    gap, loss, test = col("error_gap"), col("train_loss"), col("test_error")
    for name in ("adaptive", "geodesic-inv", "geodesic-mix"):
        radii = sorted(rows[0]["measures"][name])
        small, large = (np.array([r["measures"][name][rho] for r in rows]) for rho in radii[::3])
        assert tau_b(small, gap) < -0.15 and tau_b(large, gap) > 0.3
        assert tau_b(small, loss) > 0.25 and tau_b(large, loss) < -0.2
        assert abs(tau_b(small, test)) < 0.05 and tau_b(large, test) > 0.25
        assert tau_b(small, col("grad_norm")) > 0.25


def test_seed_population_batches_rank_the_models_in_opposite_orders():
    """studies/docs/zoo.md: at the calibrated radii the two measurement batches' values are
    negatively rank-correlated, and each alone correlates with the gap more weakly than
    their mean."""
    stored = json.loads((RESULTS / "seeds" / "endpoints.json").read_text())
    rows = rows_from_table((RESULTS / "seeds" / "models.csv").read_text())
    gap = np.array([r["error_gap"] for r in rows])
    for name, entry in stored["measures"].items():
        between = stored["split_half"][name]["tau"]
        assert -0.25 < between < -0.2
        halves = np.array([r["per_batch"][name][entry["rho"]] for r in rows]).T
        assert tau_b(halves[0], halves[1]) == pytest.approx(between)
        for half in halves:
            assert 0 < tau_b(half, gap) < entry["tau"]


def test_report_of_a_seed_population_names_no_axes():
    """A population without hyperparameter axes has no granulated tau: the report says
    so instead of printing nan."""
    from geosharp_studies.zoo.report import format_report

    summary = json.loads((RESULTS / "seeds" / "summary.json").read_text())
    text = format_report(summary)
    assert "nan" not in text and "differ in their seed only" in text


KEPT = {"vision-finetune": 40, "seeds": 40, "hparams": 22}


@pytest.mark.parametrize("folder", sorted(POPULATIONS))
def test_no_paired_difference_excludes_zero(folder):
    """README: in every measured population each paired interval of
    tau(geodesic) - tau(adaptive), at the calibrated radius and at every grid
    position, contains 0; and the training loss and error rank the gap more strongly
    than any measure at its calibrated radius."""
    stored = json.loads((RESULTS / folder / "endpoints.json").read_text())
    intervals = [d["ci"] for d in stored["differences"].values()]
    for diffs in stored["differences_by_factor"].values():
        intervals += [d["ci"] for d in (diffs.values() if isinstance(diffs, dict) else diffs)]
    assert len(intervals) == 10 and all(lo <= 0 <= hi for lo, hi in intervals)
    strongest = max(abs(e["tau"]) for e in stored["measures"].values())
    baseline = min(abs(stored["baselines"][k]["tau"]) for k in ("train_loss", "train_error"))
    assert stored["n_models"] == KEPT[folder] and strongest < baseline


def test_seed_population_batch_losses_rank_the_models_alike():
    """studies/docs/zoo.md: the two batches' unperturbed losses rank the seeds alike, and at the
    smallest radii the halves' sharpness is unrelated, each following its own loss."""
    records = [
        json.loads(p.read_text())
        for p in sorted((RESULTS / "seeds" / "run" / "text" / "measures").glob("*.json"))
    ]
    assert len(records) == 40
    for name in ("adaptive", "geodesic-inv", "geodesic-mix"):
        smallest = min(records[0]["measures"][name], key=float)
        entries = [r["measures"][name][smallest] for r in records]
        loss = np.array([e["per_batch_loss"] for e in entries])
        value = np.array([e["per_batch"] for e in entries])
        assert tau_b(loss[:, 0], loss[:, 1]) == pytest.approx(0.28, abs=0.005)
        assert abs(tau_b(value[:, 0], value[:, 1])) < 0.05
        assert min(tau_b(value[:, b], loss[:, b]) for b in (0, 1)) > 0.35


def test_seed_population_secondary_pass_claims():
    """studies/docs/zoo.md on the seed population's secondary pass: no curvature term, attention
    carries the geodesic worst case, and every worst-case measure's tau follows its
    median loss increase."""
    stored = json.loads((RESULTS / "seeds" / "endpoints.json").read_text())
    rows = rows_from_table((RESULTS / "seeds" / "models.csv").read_text())
    gap = np.array([r["error_gap"] for r in rows])
    m = lambda key, rho: np.array([r["measures"][key][rho] for r in rows])  # noqa: E731
    inv, mix, ad = m("geodesic-inv", 0.05), m("geodesic-mix", 0.04), m("adaptive", 0.4)
    for ratio, lo, hi in (
        (m("geodesic-norm-only-inv", 0.05) / inv, 0.9997, 1.0),
        (m("geodesic-norm-only-mix", 0.04) / mix, 0.9999, 1.0001),
        (m("geodesic-inv-attn", 0.05) / inv, 0.988, 0.994),
        (m("geodesic-mix-attn", 0.04) / mix, 0.988, 0.993),
        (m("adaptive-attn", 0.4) / ad, 0.16, 0.26),
    ):
        assert lo < ratio.min() and ratio.max() < hi
    curv = m("geodesic-curvature-only-inv", 0.05), m("geodesic-curvature-only-mix", 0.04)
    assert [float(np.median(c)) for c in curv] == pytest.approx([0.0047, 0.0037], abs=5e-5)
    assert tau_b(*curv) > 0.98
    assert all(tau_b(c, gap) == pytest.approx(-0.21, abs=0.005) for c in curv)
    assert tau_b(m("adaptive-linf", 0.000625), ad) == pytest.approx(0.74, abs=0.005)
    assert stored["secondary"]["adaptive-linf"]["main_minus_this"]["ci"][0] < 0
    worst = [
        (k, rho) for k in rows[0]["measures"] if "/" not in k for rho in rows[0]["measures"][k]
    ]
    assert len(worst) == 20
    medians = [float(np.median(m(k, rho))) for k, rho in worst]
    taus = [tau_b(m(k, rho), gap) for k, rho in worst]
    assert min(taus) == pytest.approx(-0.21, abs=0.005) and max(taus) == pytest.approx(
        0.45, abs=0.005
    )
    assert tau_b(medians, taus) == pytest.approx(0.90, abs=0.005)
    assert stored["reach"]["tau"] == pytest.approx(tau_b(medians, taus))
    assert stored["reach"]["ci"] == pytest.approx([0.67, 0.95], abs=0.005)
    negative = {
        k: int((m(k, rho) < 0).sum())
        for k in rows[0]["measures"]
        if "/" in k
        for rho in rows[0]["measures"][k]
    }
    assert negative == {
        "adaptive/average": 9,
        "geodesic-inv/average": 0,
        "geodesic-mix/average": 20,
    }


@pytest.mark.parametrize(
    "folder, n_columns, lowest, highest, reach, ci",
    [
        ("seeds", 20, -0.21, 0.45, 0.90, [0.67, 0.95]),
        ("vision-finetune", 23, -0.48, -0.12, 0.82, [0.48, 0.85]),
        ("hparams", 12, -0.59, -0.35, 0.86, [-0.22, 0.95]),
    ],
)
def test_tau_follows_the_reach_of_the_ball(folder, n_columns, lowest, highest, reach, ci):
    """README and studies/docs/zoo.md: over every worst-case column of a population, tau with the
    gap rises with the column's median loss increase."""
    stored = json.loads((RESULTS / folder / "endpoints.json").read_text())
    points = stored["reach"]["points"]
    assert len(points) == n_columns
    taus = [p["tau"] for p in points]
    assert [min(taus), max(taus)] == pytest.approx([lowest, highest], abs=0.005)
    assert stored["reach"]["tau"] == pytest.approx(reach, abs=0.005)
    assert stored["reach"]["ci"] == pytest.approx(ci, abs=0.005)


def test_hparams_population_claims():
    """README and studies/docs/zoo.md on the star design: the inclusion rule removes the slow
    recipes (every model of the two bases at lr 2e-5 for 3 epochs, 17 of the 20 at
    lr 2e-5), so the kept models mostly share one learning rate; the gap among them
    follows the training error; the granulated tau rests on 2-4 one-axis pairs per
    axis, few of them above seed noise."""
    stored = json.loads((RESULTS / "hparams" / "endpoints.json").read_text())
    rows = {r["id"]: r for r in rows_from_table((RESULTS / "hparams" / "models.csv").read_text())}
    excluded = {e["id"] for e in stored["excluded"]}
    assert len(rows) == 42 and len(excluded) == 20
    assert all(rows[k]["train_error"] > 0.05 for k in excluded)
    slow_bases = {k for k, r in rows.items() if int(r["base"]) in (3, 5)}
    assert all(
        rows[k]["lr"] == 2e-5 and rows[k]["epochs"] == 3
        for k in slow_bases
        if not rows[k]["varied"]
    )
    assert slow_bases <= excluded
    slow_errors = [rows[k]["train_error"] for k in slow_bases]
    assert len(slow_bases) == 14 and 0.1 <= min(slow_errors) and max(slow_errors) < 0.345
    assert sum(rows[k]["lr"] == 2e-5 for k in excluded) == 17
    others = {k for k in excluded if rows[k]["lr"] != 2e-5}
    assert all(rows[k]["epochs"] == 3 and rows[k]["batch_size"] >= 32 for k in others)
    kept = [r for k, r in rows.items() if k not in excluded]
    assert [sum(r["lr"] == lr for r in kept) for lr in (1e-4, 5e-5, 2e-5)] == [18, 1, 3]
    assert {int(r["base"]) for r in kept if not r["varied"]} == {0, 1, 2, 4}
    gap = np.array([r["error_gap"] for r in kept])
    assert tau_b([r["train_error"] for r in kept], gap) == pytest.approx(-0.68, abs=0.005)
    spread = stored["spread"]
    assert spread["train_error"]["sd"] > 2 * spread["test_error"]["sd"]
    assert spread["error_gap"]["sd"] / stored["granulated"]["seed_noise"]["seed_sd"] > 2.3
    gran = stored["granulated"]
    assert gran["n_bases"] == 4
    counts = gran["seed_noise"]["per_axis"]
    assert sorted(c["pairs"] for c in counts.values()) == [2, 2, 3, 3, 4, 4]
    assert sum(c["above"] for c in counts.values()) == 5
    g = {k: v["granulated"] for k, v in gran["by_measure"].items()}
    assert [g[k] for k in ("adaptive", "geodesic-inv", "geodesic-mix")] == pytest.approx(
        [0.11, -0.19, 0.0], abs=0.005
    )
    assert all(
        v["ci"][0] < 0 < v["ci"][1]
        for k, v in gran["by_measure"].items()
        if k.startswith(("adaptive", "geodesic"))
    )
    assert [g[k] for k in ("train_loss", "train_error", "grad_norm")] == pytest.approx(
        [-0.31, -0.5, -0.33], abs=0.005
    )
    measures = stored["measures"]
    assert all(e["tau"] < 0 and e["median_ratio_from_half"] > 3.4 for e in measures.values())
    assert [stored["split_half"][k]["tau"] for k in measures] == pytest.approx(
        [0.65, 0.73, 0.71], abs=0.005
    )
    every = list(rows.values())
    gap = np.array([r["error_gap"] for r in every])
    assert [gap.min(), gap.max()] == pytest.approx([0.043, 0.241], abs=5e-4)
    assert tau_b([r["train_error"] for r in every], gap) == pytest.approx(-0.89, abs=0.005)
    smallest = [
        tau_b([r["measures"][k][min(every[0]["measures"][k])] for r in every], gap)
        for k in measures
    ]
    assert min(smallest) == pytest.approx(-0.33, abs=0.005)
    assert max(smallest) == pytest.approx(-0.31, abs=0.005)
    summary = json.loads((RESULTS / "hparams" / "summary.json").read_text())
    assert summary["excluded_from_endpoints"] == sorted(excluded)
    calibrated = [summary["calibrated"][k]["tau_error"]["tau"] for k in measures]
    assert [min(calibrated), max(calibrated)] == pytest.approx([-0.06, 0.17], abs=0.005)
    points = stored["reach"]["points"]
    for pick, low, high in ((min, -0.59, -0.58), (max, -0.45, -0.35)):
        ends = [
            p["tau"]
            for p in points
            if p["rho"] == pick(q["rho"] for q in points if q["measure"] == p["measure"])
        ]
        assert [min(ends), max(ends)] == pytest.approx([low, high], abs=0.005)


def test_pooled_estimate_is_recomputed_and_quoted():
    """studies/docs/studies.md: the exploratory pooled |tau| difference over the three
    populations (stratified bootstrap) is what studies/results/study/pooled.py computes
    from the stored rows, and the docs quote it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pooled", RESULTS / "pooled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stored = json.loads((RESULTS / "pooled.json").read_text())
    fresh = json.loads(json.dumps(module.pooled()))
    assert fresh == stored
    docs = (RESULTS.parent.parent / "docs" / "studies.md").read_text().replace("\u2212", "-")
    for measure, short in (("geodesic-inv", "inv"), ("geodesic-mix", "mix")):
        r = stored[measure]
        quoted = f"`{short}` {r['estimate']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]"
        assert quoted in docs, quoted
        assert r["excludes_paper"] and r["ci"][0] < 0 < r["ci"][1]
