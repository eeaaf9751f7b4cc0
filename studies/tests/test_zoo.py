"""Model zoos: smoke presets end to end, resume after a kill, atomic files, report."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from geosharp_studies import zoo
from geosharp_studies.stats import granulated_tau
from launch import run_python


class Killed(Exception):
    pass


def _kill_after_first(_id):
    raise Killed(_id)


def _snapshot(directory):
    return {
        p.relative_to(directory).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module", params=["vision", "text"])
def smoke_zoo(request, tmp_path_factory):
    """Train (killed after the first model, then resumed), measure (idem) and report."""
    preset = zoo.get_preset(request.param, "smoke")
    out = tmp_path_factory.mktemp(f"zoo-{request.param}")
    with pytest.raises(Killed):
        zoo.train_zoo(preset, out, progress=False, on_model_done=_kill_after_first)
    models = out / preset.zoo / "models"
    first = sorted(p.name for p in models.iterdir() if not p.name.startswith("."))
    assert first == [f"{preset.zoo}-000"]
    before = _snapshot(models / first[0])
    trained = zoo.train_zoo(preset, out, progress=False)
    assert trained == [f"{preset.zoo}-{i:03d}" for i in range(1, preset.n_models)]
    assert _snapshot(models / first[0]) == before  # not retrained, not rewritten

    with pytest.raises(Killed):
        zoo.measure_zoo(preset, out, progress=False, on_model_done=_kill_after_first)
    measured = zoo.measure_zoo(preset, out, progress=False)
    assert len(measured) == preset.n_models - 1
    summary = zoo.report_zoo(preset, out)
    return preset, out, summary


def test_layout_and_meta(smoke_zoo):
    preset, out, _ = smoke_zoo
    root = out / preset.zoo
    hps = zoo.sample_hyperparameters(preset)
    for hp in hps:
        d = root / "models" / hp["id"]
        assert (d / "config.json").exists() and (d / "model.safetensors").exists()
        meta = json.loads((d / "meta.json").read_text())
        assert meta["hyperparameters"] == hp
        for k in ("train_error", "test_error", "train_loss", "test_loss"):
            assert math.isfinite(meta[k])
        assert meta["error_gap"] == pytest.approx(meta["test_error"] - meta["train_error"])
        rec = json.loads((root / "measures" / f"{hp['id']}.json").read_text())
        assert rec["complete"]
        for name in preset.measures:
            assert sorted(rec["measures"][name]) == sorted(map(repr, preset.rho_grid(name)))
            for entry in rec["measures"][name].values():
                assert len(entry["per_batch"]) == math.ceil(preset.n_points / preset.measure_batch)
                assert entry["value"] == pytest.approx(np.mean(entry["per_batch"]))
    # no temporary files left behind (atomic writes)
    assert not [p for p in root.rglob("*") if p.name.startswith(".")]


def test_resume_is_a_no_op(smoke_zoo):
    preset, out, _ = smoke_zoo
    before = _snapshot(out / preset.zoo / "models")
    measures_before = _snapshot(out / preset.zoo / "measures")
    assert zoo.train_zoo(preset, out, progress=False) == []
    assert zoo.measure_zoo(preset, out, progress=False) == []
    assert _snapshot(out / preset.zoo / "models") == before
    assert _snapshot(out / preset.zoo / "measures") == measures_before


def test_report(smoke_zoo):
    preset, out, summary = smoke_zoo
    assert summary["n_models"] == preset.n_models
    for name in preset.measures:
        for entry in summary["grid"][name].values():
            for gap in ("tau_error", "tau_loss"):
                t = entry[gap]
                if math.isfinite(t["tau"]):
                    assert -1 <= t["tau"] <= 1
                    assert t["low"] - 1e-12 <= t["high"]
            g = entry["granulated_error"]["granulated"]
            assert math.isnan(g) or -1 <= g <= 1
        assert summary["calibrated"][name]["rho"] in preset.rho_grid(name)
    rdir = out / preset.zoo / "report"
    text = (rdir / "report.md").read_text()
    assert "| setting | adaptive | geodesic, inv | geodesic, mix |" in text
    assert "MNLI, BERT fine-tunes (35 models) (paper) | +0.06 | +0.28 | +0.38 |" in text
    assert "(ours)" in text
    for sel in ("best", "calibrated"):
        png = rdir / f"{preset.zoo}_scatter_{sel}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((rdir / "summary.json").read_text())["zoo"] == preset.zoo
    import csv

    rows = list(csv.DictReader((rdir / "models.csv").open()))
    assert [r["id"] for r in rows] == [f"{preset.zoo}-{i:03d}" for i in range(preset.n_models)]
    name, rho = preset.measures[0], preset.rho_grid(preset.measures[0])[0]
    for row in rows:
        record = json.loads((out / preset.zoo / "measures" / f"{row['id']}.json").read_text())
        meta = json.loads((out / preset.zoo / "models" / row["id"] / "meta.json").read_text())
        assert float(row[f"{name}@{rho!r}"]) == record["measures"][name][repr(rho)]["value"]
        assert float(row["error_gap"]) == meta["error_gap"]


def test_sampling_is_deterministic_and_prefix_stable():
    preset = zoo.get_preset("vision", "full")
    hps = zoo.sample_hyperparameters(preset)
    assert len(hps) >= 40 and len(zoo.sample_hyperparameters(zoo.get_preset("text", "full"))) >= 30
    assert hps == zoo.sample_hyperparameters(preset)
    more = zoo.sample_hyperparameters(dataclasses.replace(preset, n_models=preset.n_models + 5))
    assert more[: len(hps)] == hps
    for axis in preset.axes:  # every axis actually varies over the zoo
        assert len({str(h[axis]) for h in hps}) > 1


def test_granulated_tau_on_a_grid():
    # full 2x2 grid; the measure equals the gap: every axis gives tau 1
    hps = [dict(a=a, b=b) for a in (0, 1) for b in (0, 1)]
    gap = [0.1, 0.3, 0.2, 0.5]
    out = granulated_tau(gap, gap, hps, ["a", "b"])
    assert out["granulated"] == 1.0
    assert all(d["other_axes_differing"] == 0 and d["pairs"] == 2 for d in out["per_axis"].values())
    out = granulated_tau([-g for g in gap], gap, hps, ["a", "b"])
    assert out["granulated"] == -1.0


def test_within_levels_removes_a_confounder():
    """Within each level the measure orders the gap perfectly (tau = +1), while a level
    shift of the gap makes the pooled tau negative."""
    from geosharp_studies.stats import kendall_tau

    rng = np.random.default_rng(0)
    levels = np.repeat([0.0, 0.1, 0.25], 6)
    values = rng.uniform(size=18) + 3 * levels  # noisier models look sharper ...
    gap = values - 10 * levels  # ... and have much smaller gaps
    assert kendall_tau(values, gap, variant="b") < 0
    out = zoo.within_levels(values, gap, levels, n_boot=50, seed=0)
    assert set(out["levels"]) == {"0.0", "0.1", "0.25"}
    for entry in out["levels"].values():
        assert entry["tau"] == pytest.approx(1.0) and entry["n"] == 6
    assert out["mean"] == pytest.approx(1.0)
    small = zoo.within_levels(values[:4], gap[:4], [0, 0, 1, 1], n_boot=10, seed=0)
    assert small["levels"] == {} and math.isnan(small["mean"])


def test_augment_shapes():
    import torch

    from geosharp_studies.zoo.tasks import augment

    x = torch.rand(5, 1, 28, 28) * 2 - 1
    gen = torch.Generator().manual_seed(0)
    for mode in ("none", "shift", "shift+flip"):
        y = augment(x, mode, gen)
        assert y.shape == x.shape
    assert torch.equal(augment(x, "none", gen), x)


def test_cli_zoo(tmp_path):
    from geosharp.cli import main

    args = ["--zoo", "vision", "--preset", "smoke", "--out", str(tmp_path), "--n-models", "2"]
    assert main(["zoo", "train", *args, "--no-progress"]) == 0
    assert len(list((tmp_path / "vision" / "models").iterdir())) == 2


def test_vision_falls_back_to_digits(monkeypatch, tmp_path):
    import geosharp.loading.data

    monkeypatch.setattr(geosharp.loading.data, "FASHION_MNIST_DIRS", (tmp_path,))
    monkeypatch.setattr(zoo.tasks, "_VISION_CACHE", {})
    xtr, ytr, _, yte, source = zoo.tasks.VisionTask().pool()
    yte = yte[:10]
    assert source.startswith("digits")
    assert xtr.shape[1:] == (1, 28, 28) and len(yte) == 10 and len(ytr) == len(xtr)
    assert -1.0 <= float(xtr.min()) and float(xtr.max()) <= 1.0


def test_torchrun_shares_the_zoo_and_writes_the_same_files(tmp_path, monkeypatch):
    """Two gloo ranks train and measure 3 models (2 + 1) into the files a single process
    (this one) writes: same weights, same metrics, byte-identical measurement files and
    summary."""
    from geosharp.cli import main
    from launch import one_thread

    args = ["zoo", "all", "--zoo", "vision", "--preset", "smoke", "--n-models", "3"]
    args += ["--threads", "1", "--no-progress"]
    single, shared = tmp_path / "single", tmp_path / "shared"
    monkeypatch.chdir(tmp_path)
    with one_thread():
        assert main([*args, "--out", str(single)]) == 0
    cli = ["-m", "geosharp.cli", *args, "--out", str(shared)]
    stdout = run_python(cli, 2, cwd=tmp_path)
    for rank in (0, 1):  # both ranks took a share (2 + 1, unless a retry resumed)
        assert f"[rank {rank}/2] measured" in stdout
    ids = [f"vision-{i:03d}" for i in range(3)]
    for i in ids:
        a, b = single / "vision" / "models" / i, shared / "vision" / "models" / i
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
        meta_a, meta_b = (json.loads((d / "meta.json").read_text()) for d in (a, b))
        meta_a.pop("train_seconds"), meta_b.pop("train_seconds")
        assert meta_a == meta_b
        name = f"measures/{i}.json"
        assert (single / "vision" / name).read_bytes() == (shared / "vision" / name).read_bytes()
    summary = "report/summary.json"
    assert (single / "vision" / summary).read_bytes() == (shared / "vision" / summary).read_bytes()


def test_text_model_round_trip_and_symmetries(tmp_path):
    """The mean-pooling MiniLM classifier saves/loads exactly, ignores padding, and its
    12 query-key and 12 value-output GL(32) pairs are found."""
    import torch

    import geosharp

    hp = dict(layers=1, seed=3)
    task = zoo.task_for("text")
    model = task.build_model(hp).eval()
    zoo.store.save_model(model, tmp_path / "m")
    loaded = task.load_model(tmp_path / "m")
    ids = torch.tensor([[101, 2023, 3185, 2003, 2307, 102, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).logits
        b = loaded(input_ids=ids, attention_mask=mask).logits
        c = loaded(input_ids=ids[:, :6], attention_mask=mask[:, :6]).logits
    assert torch.equal(a, b)
    assert torch.allclose(b, c, atol=1e-6)
    summary = geosharp.find_symmetries(loaded).summary()
    assert "query-key      GL(32) x 12 heads" in summary
    assert "value-output   GL(32) x 12 heads" in summary


def test_seed_population_varies_only_the_seed():
    """The seed preset: every model shares the pilot's recipe; only the seed differs,
    and each measure has its own radius grid."""
    from geosharp.measures import DEFAULT_RHO
    from geosharp_studies.zoo import SEED_RECIPE

    preset = zoo.get_preset("text", "seeds")
    hps = zoo.sample_hyperparameters(preset)
    assert len({hp["seed"] for hp in hps}) == len(hps) == preset.n_models
    for hp in hps:
        assert {k: v for k, v in hp.items() if k not in ("seed", "id")} == SEED_RECIPE
    grids = {name: preset.rho_grid(name) for name in preset.measures}
    assert grids["geodesic-inv"][-1] == DEFAULT_RHO["geodesic-inv"]
    assert grids["adaptive"][0] == 2 * DEFAULT_RHO["adaptive"]


def test_get_preset_names_the_choices():
    from geosharp.errors import UsageError

    with pytest.raises(UsageError, match="text/seeds"):
        zoo.get_preset("vision", "seeds")


@pytest.fixture
def small_bert(monkeypatch):
    """The text zoo's classifier on a 1-layer BERT 32 wide (MiniLM's vocabulary, seeded
    random weights) in place of MiniLM: the tests that take it check the studies'
    bookkeeping (passes, records, reports), which does not depend on the encoder; the
    smoke zoos above and the torchrun test train MiniLM itself."""
    import torch
    from transformers import BertConfig, BertModel

    from geosharp_studies.zoo.tasks import MeanPoolClassifier

    def build_model(task, hp):
        config = BertConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=int(hp["layers"]),
            num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(hp["seed"]))
            bert = BertModel(config, add_pooling_layer=False)
            return MeanPoolClassifier(bert, num_labels=task.classes)

    monkeypatch.setattr(type(zoo.task_for("text")), "build_model", build_model)


def _endpoint_preset():
    """The text smoke zoo with the seed population's protocol: batch vocabulary,
    baselines, a calibration target, two measurement batches."""
    return dataclasses.replace(
        zoo.get_preset("text", "smoke"),
        n_models=4,
        measures=zoo.MAIN_MEASURES,
        frozen_in_measure=(),
        measure_vocabulary="batch",
        baselines=True,
        target=0.01,
        max_train_error=1.0,  # smoke models are not converged
        n_points=16,
        measure_batch=8,
        primary={"adaptive": 2.0, "geodesic-inv": 0.5, "geodesic-mix": 2.0},
        secondary={"geodesic-norm-only-inv": "geodesic-inv", "adaptive-attn": "adaptive"},
        average_case=("geodesic-mix",),
        average_samples=2,
        traces=("hessian-trace-inv",),
        trace_probes=3,
    )


def test_endpoint_population_end_to_end(tmp_path):
    from geosharp.measures import DEFAULT_RHO
    from geosharp_studies.zoo.report import endpoint_study, rows_from_table

    preset = _endpoint_preset()
    zoo.train_zoo(preset, tmp_path, progress=False)
    zoo.measure_zoo(preset, tmp_path, progress=False)
    record = json.loads((tmp_path / "text" / "measures" / "text-000.json").read_text())
    assert 0 < record["embedding_rows"] <= 16 * 24 < 30522
    assert set(record["baselines"]) == {
        "grad_norm",
        "weight_norm",
        "distance_from_init",
        "measure_loss",
    }
    assert record["baselines"]["distance_from_init"] > 0
    zoo.report_zoo(preset, tmp_path, population="text/test")
    rdir = tmp_path / "text" / "report"
    study = json.loads((rdir / "endpoints.json").read_text())
    for key in ("population", "n_models", "n_excluded", "excluded", "n_points", "batch_size"):
        assert key in study
    assert study["n_models"] == 4 and study["population"] == "text/test"
    assert set(study["measures"]) == set(zoo.MAIN_MEASURES)
    assert set(study["differences"]) == {
        "geodesic-inv minus adaptive",
        "geodesic-mix minus adaptive",
    }
    assert {"grad_norm", "train_loss", "distance_from_init"} <= set(study["baselines"])
    assert set(study["split_half"]) == set(zoo.MAIN_MEASURES)
    assert set(study["secondary"]) == {
        "geodesic-norm-only-inv",
        "adaptive-attn",
        "geodesic-mix/average",
        "hessian-trace-inv",
    }
    measured = json.loads((tmp_path / "text" / "measures" / "text-000.json").read_text())
    trace = measured["measures"]["hessian-trace-inv"]["0.0"]
    assert len(trace["per_probe"]) == 3 and trace["stderr"] >= 0
    assert study["secondary"]["adaptive-attn"]["rho"] == 2.0 * DEFAULT_RHO["adaptive"]
    # every value recomputes from models.csv
    again = endpoint_study(preset, rows_from_table((rdir / "models.csv").read_text()), "text/test")
    assert json.loads(json.dumps(again)) == study
    text = (rdir / "report.md").read_text()
    assert "Pre-registered endpoints: text/test" in text and (rdir / "tau_curves.png").exists()
    reach = study["reach"]  # every worst-case column: no average case, no trace
    grid = [(m, rho) for m in zoo.MAIN_MEASURES for rho in preset.rho_grid(m)]
    secondary = [("geodesic-norm-only-inv", preset.primary_rho("geodesic-inv"))]
    secondary.append(("adaptive-attn", preset.primary_rho("adaptive")))
    assert [(p["measure"], p["rho"]) for p in reach["points"]] == grid + secondary
    assert [p["main"] for p in reach["points"]] == [True] * len(grid) + [False, False]
    assert reach["ci"][0] <= reach["tau"] <= reach["ci"][1] and "reach of the ball" in text
    assert "inclusion rule leaves out" not in text
    # the exploratory summary covers every measured model and says so when the
    # inclusion rule keeps some of them out of the endpoints
    errors = sorted(r["train_error"] for r in rows_from_table((rdir / "models.csv").read_text()))
    strict = dataclasses.replace(preset, max_train_error=(errors[0] + errors[-1]) / 2)
    assert errors[0] < errors[-1]
    summary = zoo.report_zoo(strict, tmp_path, population="text/test")
    outside = summary["excluded_from_endpoints"]
    assert 0 < len(outside) < 4 and summary["n_models"] == 4
    text = (rdir / "report.md").read_text()
    assert f"4 models (every measured model: the {len(outside)} the inclusion rule" in text


def test_baselines_of_an_untrained_model():
    """distance_from_init is 0 at the model's starting point, and grad_norm is the norm
    of the full-batch gradient computed in one piece."""
    import torch

    preset = zoo.get_preset("vision", "smoke")
    hp = zoo.sample_hyperparameters(preset)[0]
    task = zoo.task_for("vision")
    model = task.build_model(hp).eval()
    out = zoo.model_baselines(preset, hp, model)
    assert out["distance_from_init"] == 0.0
    x, y = task.train_set(hp)
    task.loss(model, (x, y)).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert out["grad_norm"] == pytest.approx(float(grad), rel=1e-5)


def test_measurement_passes_main_grid_first(tmp_path, small_bert):
    """The seed preset measures its grid first, then the secondary measures at the
    primary radii; a record complete for the first pass is resumed by the second."""
    preset = zoo.get_preset("text", "seeds")
    main, second = preset.passes()
    assert sum(len(r) for r in main.values()) == 12
    assert second["geodesic-curvature-only-inv"] == [preset.primary_rho("geodesic-inv")]
    assert second["geodesic-mix/average"] == [preset.primary_rho("geodesic-mix")]
    assert preset.primary_rho("geodesic-inv") in main["geodesic-inv"]  # on the grid
    small = dataclasses.replace(
        _endpoint_preset(), n_models=2, secondary={}, average_case=(), traces=(), target=None
    )
    zoo.train_zoo(small, tmp_path, progress=False)
    zoo.measure_zoo(small, tmp_path, progress=False)
    record = json.loads((tmp_path / "text" / "measures" / "text-000.json").read_text())
    assert record["complete"] and "adaptive-attn" not in record["measures"]
    more = dataclasses.replace(small, secondary={"adaptive-attn": "adaptive"})
    (tmp_path / "text" / "preset.json").unlink()  # the same zoo, one more measure
    assert zoo.measure_zoo(more, tmp_path, progress=False) == ["text-000", "text-001"]
    again = json.loads((tmp_path / "text" / "measures" / "text-000.json").read_text())
    assert again["measures"]["adaptive"] == record["measures"]["adaptive"]
    assert list(again["measures"]["adaptive-attn"]) == [repr(more.primary_rho("adaptive"))]


def _minimal_study() -> dict:
    """An endpoints result with nothing in its tables, for rendering one section."""
    protocol = dict(max_train_error=0.05, target=0.01, n_boot=10)
    return dict(
        population="p", protocol=protocol, n_models=6, n_excluded=0, n_points=8,
        batch_size=8, n_iters=1, starts="zero", measures={}, differences={}, baselines={},
        excluded=[],
    )  # fmt: skip


def test_a_secondary_measure_with_its_own_primary_radius_is_measured_there():
    from geosharp.measures import DEFAULT_RHO

    preset = zoo.get_preset("text", "seeds")
    more = dataclasses.replace(
        preset,
        secondary={**preset.secondary, "adaptive-linf": "adaptive"},
        primary={**preset.primary, "adaptive-linf": 0.5},
    )
    second = more.passes()[1]
    assert second["adaptive-linf"] == [DEFAULT_RHO["adaptive-linf"] * 0.5]
    assert second["adaptive-attn"] == [more.primary_rho("adaptive")]  # the main's radius
    from geosharp_studies.zoo.report import secondary_study

    only = dataclasses.replace(more, secondary={"adaptive-linf": "adaptive"}, average_case=())
    rng = np.random.default_rng(1)
    rows = [
        dict(
            error_gap=float(rng.uniform()),
            measures={
                "adaptive": {only.primary_rho("adaptive"): 1.0 + i},
                "adaptive-linf": {second["adaptive-linf"][0]: 2.0 * (1.0 + i)},
            },
        )
        for i in range(5)
    ]
    out = secondary_study(only, rows)["adaptive-linf"]
    assert out["rho"] == second["adaptive-linf"][0] and out["median_value_ratio"] == 2.0


def test_secondary_keys_are_reported_once_every_model_has_them():
    """The Hessian traces come in a last pass of their own: until every model has a key,
    the secondary study leaves it out and reports the keys that are in."""
    from geosharp_studies.endpoints import format_endpoints
    from geosharp_studies.zoo.report import secondary_study

    preset = _endpoint_preset()
    _, second, traces = preset.passes()
    assert set(traces) == {"hessian-trace-inv"} and "hessian-trace-inv" not in second
    rho = preset.primary_rho("geodesic-inv")
    rng = np.random.default_rng(0)
    rows = []
    for i in range(6):
        v = float(rng.uniform(1, 2))
        measures = {"geodesic-inv": {rho: v}, "geodesic-norm-only-inv": {rho: 0.9 * v}}
        if i:  # the first model has no trace yet
            measures["hessian-trace-inv"] = {0.0: float(rng.uniform())}
        rows.append(dict(error_gap=float(rng.uniform()), measures=measures))
    preset = dataclasses.replace(preset, average_case=())
    out = secondary_study(preset, rows)
    assert set(out) == {"geodesic-norm-only-inv"}
    assert out["geodesic-norm-only-inv"]["main_minus_this"]["tau_diff"] == 0.0
    assert out["geodesic-norm-only-inv"]["median_value_ratio"] == pytest.approx(0.9)
    rows[0]["measures"]["hessian-trace-inv"] = {0.0: 0.5}
    out = secondary_study(preset, rows)
    assert set(out) == {"geodesic-norm-only-inv", "hessian-trace-inv"}
    trace = out["hessian-trace-inv"]
    assert trace["rho"] is None and trace["median_value_ratio"] is None  # no radius
    line = next(
        x
        for x in format_endpoints(dict(_minimal_study(), secondary=out)).splitlines()
        if x.startswith("| hessian-trace-inv ")
    )
    assert line.split("|")[3].strip() == "-" and line.split("|")[6].strip() == "-"


def test_reach_study_leaves_out_columns_some_models_lack():
    from geosharp_studies.stats import kendall_tau
    from geosharp_studies.zoo.report import reach_study

    preset = dataclasses.replace(
        _endpoint_preset(), measures=("adaptive",), rho_factors=(0.5, 1.0, 2.0, 4.0)
    )
    grid = preset.rho_grid("adaptive")
    rng = np.random.default_rng(3)
    rows = []
    for i in range(8):
        gap = float(rng.uniform())
        measures = {"adaptive": {rho: (1 + gap) * rho * (1 + 0.1 * rng.uniform()) for rho in grid}}
        if i:  # the first model's secondary pass is not done
            measures["adaptive-attn"] = {preset.primary_rho("adaptive"): gap}
        rows.append(dict(error_gap=gap, measures=measures))
    out = reach_study(preset, rows)
    assert [p["measure"] for p in out["points"]] == ["adaptive"] * len(grid)
    assert out["tau"] == kendall_tau(
        [p["median"] for p in out["points"]], [p["tau"] for p in out["points"]], "b"
    )
    rows[0]["measures"]["adaptive-attn"] = {preset.primary_rho("adaptive"): 0.0}
    assert [p["measure"] for p in reach_study(preset, rows)["points"]][-1] == "adaptive-attn"
    one_radius = [dict(r, measures={"adaptive": {grid[0]: r["error_gap"]}}) for r in rows]
    assert reach_study(preset, one_radius) == {}  # fewer than 3 columns


def test_star_design_population_reports_the_granulated_tau(tmp_path, small_bert):
    """Base configurations and their one-axis variants: exact pairs, the granulated tau
    over them with a bootstrap over bases, and word dropout in training."""
    preset = dataclasses.replace(
        _endpoint_preset(),
        design="star",
        axes=dict(lr=[3e-5, 3e-4], word_dropout=[0.0, 0.2]),
        fixed=dict(
            max_length=24,
            weight_decay=0.01,
            epochs=1,
            batch_size=16,
            n_train=48,
            label_noise=0.0,
            freeze_embeddings=False,
            layers=1,
        ),
        n_models=6,
        secondary={},
        average_case=(),
        traces=(),
    )
    hps = zoo.sample_hyperparameters(preset)
    assert [(hp["base"], hp["varied"]) for hp in hps] == [
        (0, None),
        (0, "lr"),
        (0, "word_dropout"),
        (1, None),
        (1, "lr"),
        (1, "word_dropout"),
    ]
    for hp in hps:
        base = hps[3 * hp["base"]]
        differ = {a for a in preset.axes if hp[a] != base[a]}
        assert differ == ({hp["varied"]} if hp["varied"] else set())
    zoo.train_zoo(preset, tmp_path, progress=False)
    zoo.measure_zoo(preset, tmp_path, progress=False)
    zoo.report_zoo(preset, tmp_path, population="text/star", seed_sd=0.01)
    study = json.loads((tmp_path / "text" / "report" / "endpoints.json").read_text())
    gran = study["granulated"]
    assert gran["n_bases"] == 2
    assert {a: c["pairs"] for a, c in gran["seed_noise"]["per_axis"].items()} == {
        "lr": 2,
        "word_dropout": 2,
    }
    assert "Seed-level noise" in (tmp_path / "text/report/report.md").read_text()
    for entry in gran["by_measure"].values():
        # groups with a defined tau (the smoke models' gaps can tie): at most 2 per axis
        assert all(1 <= d["groups"] <= 2 for d in entry["per_axis"].values())
        assert -1.0 <= entry["granulated"] <= 1.0
    assert "Granulated tau on the star design" in (tmp_path / "text/report/report.md").read_text()


def test_seed_noise_keeps_the_pairs_whose_gaps_differ_by_more_than_seeds_do():
    """Variants along ``lr`` move the gap by 0.1, along ``wd`` by 0.001: with a seed sd
    of 0.01 (threshold 1.96 sqrt(2) 0.01 = 0.028) only the ``lr`` pairs are above seed
    noise, and the granulated tau on them is that of a measure equal to the gap."""
    from geosharp_studies.endpoints import format_endpoints
    from geosharp_studies.zoo.report import granulated_study

    preset = dataclasses.replace(_endpoint_preset(), design="star", axes=dict(lr=[1, 2], wd=[1, 2]))
    rows = []
    for b, root in enumerate([0.1, 0.2, 0.3]):
        for varied, gap in ((None, root), ("lr", root + 0.1), ("wd", root - 0.001)):
            measures = {"adaptive": {0.1: gap}}
            rows.append(dict(base=b, varied=varied, error_gap=gap, measures=measures))
    study = dict(measures={"adaptive": {"rho": 0.1}}, baselines={})
    assert "seed_noise" not in granulated_study(preset, rows, study)
    gran = granulated_study(preset, rows, study, seed_sd=0.01)
    noise = gran["seed_noise"]
    assert noise["threshold"] == pytest.approx(1.96 * math.sqrt(2) * 0.01)
    assert noise["per_axis"] == {"lr": dict(pairs=3, above=3), "wd": dict(pairs=3, above=0)}
    assert noise["granulated"]["adaptive"] == 1.0
    assert gran["by_measure"]["adaptive"]["granulated"] == 1.0  # wd pairs agree too
    text = format_endpoints(dict(_minimal_study(), granulated=gran))
    assert "lr 3/3, wd 0/3" in text and "adaptive +1.00" in text


def test_star_groups_drop_a_base_without_its_own_model():
    from geosharp_studies.zoo.report import star_groups

    rows = [
        dict(base=0.0, varied=""),
        dict(base=0.0, varied="lr"),
        dict(base=0.0, varied="wd"),
        dict(base=1.0, varied="lr"),
        dict(base=1.0, varied="wd"),  # base 1 itself excluded
    ]
    assert star_groups(rows, ["lr", "wd"]) == [{"lr": [0, 1], "wd": [0, 2]}]


def test_word_dropout_replaces_only_ordinary_tokens():
    import torch

    task = zoo.task_for("text")
    ids = torch.tensor([[101, 2023, 3185, 2003, 102, 0, 0]] * 200)
    data = (ids, (ids != 0).long(), torch.zeros(200, dtype=torch.long))
    gen = torch.Generator().manual_seed(0)
    out = task.batch(data, slice(0, 200), dict(word_dropout=0.5), gen)["input_ids"]
    dropped = out == task.unk_id
    assert out.shape[1] == 5 and not dropped[:, [0, 4]].any()  # padding columns dropped
    assert 0.4 < dropped[:, 1:4].float().mean() < 0.6
    same = task.batch(data, slice(0, 200), dict(word_dropout=0.5))["input_ids"]
    assert torch.equal(same, ids[:, :5])  # no generator: evaluation, no dropout


def test_pilot_of_the_fine_tune_population(tmp_path):
    """The pilot pre-trains once, trains models drawn from another seed than the
    population's, and records ratios along a doubling grid and the maximiser check."""
    from geosharp.cli import main
    from geosharp_studies.zoo.pilot import pilot_hyperparameters

    preset = zoo.get_preset("vision-finetune", "smoke")
    pilots = pilot_hyperparameters(preset, 2)
    population = zoo.sample_hyperparameters(preset)
    assert not {hp["seed"] for hp in pilots} & {hp["seed"] for hp in population}
    args = ["zoo", "pilot", "--zoo", "vision-finetune", "--preset", "smoke", "--out", str(tmp_path)]
    assert main([*args, "--pilot-models", "1", "--no-progress"]) == 0
    root = tmp_path / "vision-finetune"
    meta = json.loads((root / "pretrained" / "meta.json").read_text())
    assert meta["data"].endswith("classes 0,1,2,3,4")
    record = json.loads((root / "pilot" / "pilot-000.json").read_text())
    for name in zoo.MAIN_MEASURES:
        entry = record["radius_pilot"][name]
        assert len(entry["ratio"]) == len(entry["factors"]) - 1
        assert record["maximiser"][name]["starts"] == 3
    assert "| adaptive | pilot-000 |" in (root / "pilot" / "pilot.md").read_text()
    before = (root / "pilot" / "pilot-000.json").stat().st_mtime_ns
    assert main([*args, "--pilot-models", "1", "--no-progress"]) == 0  # resumes: nothing to do
    assert (root / "pilot" / "pilot-000.json").stat().st_mtime_ns == before


def test_report_before_three_models_pass_says_so(tmp_path, small_bert):
    """A report while the population is being measured: no endpoints, no traceback."""
    preset = dataclasses.replace(
        _endpoint_preset(), n_models=2, secondary={}, average_case=(), traces=()
    )
    zoo.train_zoo(preset, tmp_path, progress=False)
    zoo.measure_zoo(preset, tmp_path, progress=False)
    zoo.report_zoo(preset, tmp_path)
    rdir = tmp_path / "text" / "report"
    assert "endpoints need at least 3" in (rdir / "report.md").read_text()
    assert not (rdir / "endpoints.json").exists()
