"""The report of a zoo: rank correlations over the radius grid, the scatter plots,
one CSV row per model."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from geosharp.cli.plots import require_matplotlib
from geosharp.errors import UsageError
from geosharp.io import write_json_atomic, write_text_atomic
from geosharp.measures.catalog import HESSIAN_TRACES, PAPER_TABLE

from ..endpoints import (
    Protocol,
    endpoints,
    format_endpoints,
    plot_tau_curves,
    split_included,
    tau_curves,
)
from ..stats import (
    granulated_tau,
    kendall_tau,
    kendall_tau_with_ci,
    reach_tau,
    split_half,
    tau_difference,
)
from .presets import MAIN_MEASURES, ZooPreset, sample_hyperparameters
from .store import missing, zoo_dir
from .tasks import task_for


def _load_zoo(preset: ZooPreset, out: str | Path) -> tuple[list[dict], list[dict]]:
    """The models whose main grid (and baselines, if the preset has them) is measured:
    the primary endpoint is reported before the secondary pass is done."""
    zdir = zoo_dir(out, preset)
    main = preset.passes()[0]
    metas, records = [], []
    for hp in sample_hyperparameters(preset):
        mpath = zdir / "models" / hp["id"] / "meta.json"
        rpath = zdir / "measures" / f"{hp['id']}.json"
        if not mpath.exists() or not rpath.exists():
            continue
        rec = json.loads(rpath.read_text())
        if missing(rec, main) or (preset.baselines and "baselines" not in rec):
            continue
        metas.append(json.loads(mpath.read_text()))
        records.append(rec)
    return metas, records


def _values(records: list[dict], name: str, rho_key: str) -> np.ndarray:
    return np.array([r["measures"][name][rho_key]["value"] for r in records], dtype=float)


def _tau_ci(x: np.ndarray, y: np.ndarray, n_boot: int, seed: int) -> dict:
    from ..stats import kendall_tau, kendall_tau_with_ci

    if len(x) < 2 or not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        nan = float("nan")
        return dict(tau=nan, low=nan, high=nan)
    ci = kendall_tau_with_ci(x, y, n_boot=n_boot, seed=seed)
    return dict(tau=kendall_tau(x, y, variant="b"), low=ci.low, high=ci.high)


def within_levels(
    values: np.ndarray, gap: np.ndarray, levels: Sequence, n_boot: int, seed: int
) -> dict:
    """Kendall tau (with bootstrap interval) within each level of a confounder (e.g. the
    label noise, which alone moves the error gap of noisy-label models below zero), and
    their mean weighted by the number of pairs in each level."""
    out, weights, taus = {}, [], []
    levels = np.asarray([str(v) for v in levels])
    for level in sorted(set(levels.tolist()), key=float):
        at = levels == level
        entry = _tau_ci(values[at], gap[at], n_boot, seed) if at.sum() >= 3 else None
        if entry is None:
            continue
        entry["n"] = int(at.sum())
        out[level] = entry
        if np.isfinite(entry["tau"]):
            taus.append(entry["tau"])
            weights.append(at.sum() * (at.sum() - 1) / 2)
    mean = float(np.average(taus, weights=weights)) if taus else float("nan")
    return dict(levels=out, mean=mean)


def analyse(
    preset: ZooPreset, metas: list[dict], records: list[dict], target: float | None = None
) -> dict:
    """Every statistic of the report (a JSON-able dict). The calibration target is
    ``target``, else the preset's, else the median over measures of the median loss
    increase at the middle of each grid."""
    gaps = {
        "error": np.array([m["error_gap"] for m in metas]),
        "loss": np.array([m["loss_gap"] for m in metas]),
    }
    hps = [m["hyperparameters"] for m in metas]
    axes = [a for a in preset.axes if len({str(h[a]) for h in hps}) > 1]
    grid: dict = {}
    for name in preset.measures:
        grid[name] = {}
        for rho in preset.rho_grid(name):
            key = repr(rho)
            vals = _values(records, name, key)
            entry = dict(rho=rho, median_increase=float(np.median(vals)))
            for gname, gap in gaps.items():
                entry[f"tau_{gname}"] = _tau_ci(vals, gap, preset.n_boot, preset.seed)
            entry["granulated_error"] = granulated_tau(vals, gaps["error"], hps, axes)
            grid[name][key] = entry
    # best radius: largest |tau| with the error gap on the grid (the sign is reported)
    best = {}
    for name, entries in grid.items():
        finite = [e for e in entries.values() if np.isfinite(e["tau_error"]["tau"])]
        if finite:
            best[name] = max(finite, key=lambda e: abs(e["tau_error"]["tau"]))
    # calibration: a common target median loss increase (the preset's, when it fixes
    # one); per measure the grid radius whose median increase is closest to it in log scale
    if target is None:
        target = preset.target
    if target is None:
        mids = [
            list(entries.values())[len(entries) // 2]["median_increase"]
            for entries in grid.values()
        ]
        mids = [m for m in mids if m > 0]
        target = float(np.median(mids)) if mids else 0.0
    calibrated = {}
    for name, entries in grid.items():

        def dist(e):
            m = e["median_increase"]
            if m <= 0 or target <= 0:
                return abs(m - target)
            return abs(np.log(m) - np.log(target))

        calibrated[name] = min(entries.values(), key=dist)
    stratified = {}
    if "label_noise" in axes:
        for sel, chosen in (("best", best), ("calibrated", calibrated)):
            stratified[sel] = {
                name: within_levels(
                    _values(records, name, repr(e["rho"])),
                    gaps["error"],
                    [h["label_noise"] for h in hps],
                    preset.n_boot,
                    preset.seed,
                )
                for name, e in chosen.items()
            }
    return dict(
        zoo=preset.zoo,
        n_models=len(metas),
        axes=axes,
        target_median_increase=target,
        grid=grid,
        best=best,
        calibrated=calibrated,
        within_label_noise=stratified,
        models=[
            dict(
                id=m["id"],
                **{k: m[k] for k in ("train_error", "test_error", "error_gap", "loss_gap")},
            )
            for m in metas
        ],
    )


def _signed(x: float) -> str:
    return f"{x:+.2f}" if np.isfinite(x) else "n/a"


def _fmt(t: dict) -> str:
    if not np.isfinite(t["tau"]):
        return "n/a"
    return f"{t['tau']:+.2f} [{t['low']:+.2f}, {t['high']:+.2f}]"


def format_report(summary: dict, figures: Sequence[str] = ()) -> str:
    zoo = summary["zoo"]
    setting = task_for(zoo).setting
    outside = summary.get("excluded_from_endpoints", ())
    scope = (
        f" (every measured model: the {len(outside)} the inclusion rule leaves out of the "
        "endpoints are in)"
        if outside
        else ""
    )
    lines = [
        f"# Sharpness vs generalization: {zoo} zoo",
        "",
        f"{summary['n_models']} models{scope}; hyperparameter axes varied: "
        f"{', '.join(summary['axes']) or 'none (the models differ in their seed only)'}.",
        "Kendall tau (tau-b) between each measure and the generalization gap, with 95% "
        "percentile bootstrap intervals over models.",
        "",
        "## The paper's table next to ours",
        "",
        "| setting | adaptive | geodesic, inv | geodesic, mix |",
        "|---|---|---|---|",
    ]
    for row in PAPER_TABLE:
        lines.append(f"| {row[0]} (paper) | {row[1]:+.2f} | {row[2]:+.2f} | {row[3]:+.2f} |")
    for label, sel in (("best radius", "best"), ("calibrated radius", "calibrated")):
        cells = [
            _fmt(summary[sel][m]["tau_error"]) if m in summary[sel] else "n/a"
            for m in MAIN_MEASURES
        ]
        lines.append(
            f"| {setting}, {summary['n_models']} models, {label} (ours) | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        f"Calibrated radii: each measure at the grid radius whose median loss increase "
        f"over the zoo is closest (log scale) to {summary['target_median_increase']:.4g}.",
        "",
        "## All measures",
        "",
        "| measure | best rho | tau (error gap) | tau (loss gap) | granulated tau | "
        "calibrated rho | tau at calibrated rho |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in summary["best"].items():
        c = summary["calibrated"][name]
        gran = e["granulated_error"]["granulated"]
        lines.append(
            f"| {name} | {e['rho']:.4g} | {_fmt(e['tau_error'])} | {_fmt(e['tau_loss'])} | "
            f"{_signed(gran)} | {c['rho']:.4g} | {_fmt(c['tau_error'])} |"
        )
    lines += [
        "",
        "## The whole grid",
        "",
        "| measure | rho | median loss increase | tau (error gap) | tau (loss gap) "
        "| granulated tau |",
        "|---|---|---|---|---|---|",
    ]
    for name, entries in summary["grid"].items():
        for e in entries.values():
            lines.append(
                f"| {name} | {e['rho']:.4g} | {e['median_increase']:.4g} | {_fmt(e['tau_error'])} "
                f"| {_fmt(e['tau_loss'])} | {_signed(e['granulated_error']['granulated'])} |"
            )
    strat = summary.get("within_label_noise") or {}
    if strat:
        levels = sorted({lv for d in strat["best"].values() for lv in d["levels"]}, key=float)
        lines += [
            "",
            "## Within each label-noise level",
            "",
            "Training labels with noise `q` make the training error (measured on those "
            "labels) large, so noise alone moves a model's error gap down; Kendall tau "
            "within each noise level removes that confounder (mean weighted by pairs).",
            "",
            "| measure | radius | "
            + " | ".join(f"noise {float(lv):g}" for lv in levels)
            + " | weighted mean |",
            "|---|---|" + "---|" * (len(levels) + 1),
        ]
        for sel in ("best", "calibrated"):
            for name in MAIN_MEASURES:
                if name not in strat[sel]:
                    continue
                d = strat[sel][name]
                cells = [
                    f"{_fmt(d['levels'][lv])} (n={d['levels'][lv]['n']})"
                    if lv in d["levels"]
                    else "n/a"
                    for lv in levels
                ]
                rho = summary[sel][name]["rho"]
                row = f"| {name} | {sel} ({rho:.4g}) | " + " | ".join(cells)
                lines.append(row + f" | {_signed(d['mean'])} |")
    lines += [
        "",
        "Granulated tau: per hyperparameter axis, the mean of sign(d measure) sign(d gap) over "
        "the pairs of models that differ in that axis and in the fewest other axes; averaged "
        "over axes (see `geosharp_studies.stats.granulated_tau`).",
        "",
    ]
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    return "\n".join(lines)


def write_scatter(
    summary: dict, records: list[dict], metas: list[dict], path: Path, sel: str
) -> Path:
    """Measure vs error gap for adaptive, geodesic inv and mix (paper's Figures 4, 5);
    points coloured by the models' label noise."""
    require_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    gap = np.array([m["error_gap"] for m in metas])
    noise = np.array([float(m["hyperparameters"].get("label_noise", 0.0)) for m in metas])
    levels = sorted(set(noise.tolist()))
    colours = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, max(len(levels), 1)))
    fig, axs = plt.subplots(1, len(MAIN_MEASURES), figsize=(4 * len(MAIN_MEASURES), 3.4))
    for ax, name in zip(np.atleast_1d(axs), MAIN_MEASURES, strict=False):
        if name not in summary[sel]:
            ax.set_visible(False)
            continue
        e = summary[sel][name]
        vals = _values(records, name, repr(e["rho"]))
        for level, colour in zip(levels, colours, strict=True):
            at = noise == level
            ax.scatter(vals[at], gap[at], s=14, color=colour, label=f"label noise {level:g}")
        ax.set_xlabel(f"{name} (rho={e['rho']:.3g})")
        ax.set_ylabel("test - train error")
        tau = e["tau_error"]["tau"]
        ax.set_title(f"tau = {tau:+.2f}" if np.isfinite(tau) else "tau = n/a")
        if np.all(vals > 0) and vals.max() > 10 * vals.min():
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.tick_params(axis="x", labelrotation=30)
    if len(levels) > 1:
        np.atleast_1d(axs)[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{summary['zoo']} zoo, {sel} radius")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def report_zoo(
    preset: ZooPreset,
    out: str | Path,
    target: float | None = None,
    population: str | None = None,
    seed_sd: float | None = None,
) -> dict:
    """Write ``report/report.md``, ``report/summary.json``, ``report/models.csv`` (one row
    per model) and the scatter PNGs; for a preset with a calibration target also
    ``report/endpoints.json`` (:func:`endpoint_study`, computed from ``models.csv`` as
    written, with ``seed_sd`` for a star design) and ``report/tau_curves.png``."""
    metas, records = _load_zoo(preset, out)
    if len(metas) < 2:
        raise UsageError(
            f"the report needs at least 2 trained and measured models in "
            f"{zoo_dir(out, preset)}, found {len(metas)}: run train and measure first"
        )
    summary = analyse(preset, metas, records, target=target)
    rdir = zoo_dir(out, preset) / "report"
    figures = [
        write_scatter(summary, records, metas, rdir / f"{preset.zoo}_scatter_{sel}.png", sel)
        for sel in ("best", "calibrated")
    ]
    table = models_table(preset, metas, records)
    if preset.target is not None:
        rows = rows_from_table(table)
        included, excluded = split_included(rows, population_protocol(preset), preset.measures)
        summary["excluded_from_endpoints"] = [e["id"] for e in excluded]
    text = format_report(summary, [str(f) for f in figures])
    if preset.target is not None:
        if len(included) >= 3:
            study = endpoint_study(preset, rows, population or preset.zoo, seed_sd)
            write_json_atomic(rdir / "endpoints.json", study)
            extra = [p for p in study["reach"].get("points", ()) if not p["main"]]
            plot_tau_curves(study["tau_curves"], rdir / "tau_curves.png", extra)
            text = format_endpoints(study, "tau_curves.png") + "\n" + text
            summary["endpoints"] = study
        else:
            text = (
                f"# Pre-registered endpoints: not computed\n\n{len(included)} measured "
                "model(s) pass the inclusion rule (training error at most "
                f"{preset.max_train_error:g}, every measure finite); the endpoints need at "
                "least 3.\n\n" + text
            )
    write_json_atomic(rdir / "summary.json", summary)
    write_text_atomic(rdir / "models.csv", table)
    write_text_atomic(rdir / "report.md", text)
    return summary


def models_table(preset: ZooPreset, metas: list[dict], records: list[dict]) -> str:
    """One CSV row per model: id, hyperparameters, train/test error and loss, gaps, the
    baselines the records hold (:func:`~geosharp_studies.zoo.measure.model_baselines`),
    and the sharpness of every measure at every radius (column ``<measure>@<rho>``);
    for a preset with a calibration target also each batch's value
    (``<measure>@<rho>/<batch>``), from which the split-half reliability follows."""
    import csv
    import io

    axes = list(preset.axes) + [k for k in preset.fixed if k not in preset.axes]
    if preset.design == "star":
        axes += ["base", "varied"]
    metrics = ["train_error", "test_error", "train_loss", "test_loss", "error_gap", "loss_gap"]
    baselines = [k for k in BASELINE_KEYS if all(k in r.get("baselines", {}) for r in records)]
    columns = [
        (key, repr(rho))
        for grid in preset.passes()
        if not any(missing(r, grid) for r in records)  # the secondary pass once complete
        for key, radii in grid.items()
        for rho in radii
    ]
    n_batches = 0
    batched = [(m, k) for m, k in columns if m not in HESSIAN_TRACES]
    if preset.target is not None:
        n_batches = min(len(r["measures"][m][k]["per_batch"]) for r in records for m, k in batched)
    header = ["id", *axes, *metrics, *baselines, *(f"{m}@{r}" for m, r in columns)]
    header += [f"{m}@{r}/{b}" for m, r in batched for b in range(n_batches)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for meta, record in zip(metas, records, strict=True):
        hp = meta["hyperparameters"]
        row = [meta["id"], *(hp.get(a) for a in axes), *(meta[k] for k in metrics)]
        row += [record["baselines"][k] for k in baselines]
        row += [record["measures"][m][r]["value"] for m, r in columns]
        row += [
            record["measures"][m][r]["per_batch"][b] for m, r in batched for b in range(n_batches)
        ]
        writer.writerow(row)
    return buffer.getvalue()


BASELINE_KEYS = ("grad_norm", "weight_norm", "distance_from_init", "measure_loss")


def rows_from_table(text: str) -> list[dict]:
    """The rows of :func:`~geosharp_studies.endpoints.endpoints` from ``models.csv``:
    numeric columns as floats, ``measures: {name: {rho: value}}`` and
    ``per_batch: {name: {rho: [values]}}``."""
    import csv
    import io

    rows = []
    for raw in csv.DictReader(io.StringIO(text)):
        row: dict = dict(id=raw.pop("id"), measures={}, per_batch={})
        for column, cell in raw.items():
            if "@" not in column:
                try:
                    row[column] = float(cell)
                except ValueError:
                    row[column] = cell
                continue
            name, rest = column.split("@", 1)
            rho, _, batch = rest.partition("/")
            if batch:
                row["per_batch"].setdefault(name, {}).setdefault(float(rho), []).append(float(cell))
            else:
                row["measures"].setdefault(name, {})[float(rho)] = float(cell)
        rows.append(row)
    return rows


def population_protocol(preset: ZooPreset, population: str = "") -> Protocol:
    """The :class:`~geosharp_studies.endpoints.Protocol` a preset with a target fixes."""
    return Protocol(
        population=population or preset.zoo,
        target=float(preset.target),
        n_points=preset.n_points,
        batch_size=preset.measure_batch,
        n_iters=preset.n_iters,
        starts="zero",
        max_train_error=preset.max_train_error,
        compared=tuple(m for m in preset.measures if m.startswith("geodesic-")),
        n_boot=2000,
        seed=preset.seed,
    )


def endpoint_study(
    preset: ZooPreset, rows: list[dict], population: str, seed_sd: float | None = None
) -> dict:
    """The pre-registered endpoints of a population (:func:`~geosharp_studies.endpoints.
    endpoints` with the preset's protocol), plus the split-half reliability of every
    measure at its calibrated radius, the spread over the kept models of the gap, the
    errors and every measure there (in a seed population: the seed-level noise), and
    the tau-against-loss-increase curves. ``seed_sd``, the gap's sd over a seed
    population of the same base, marks the star design's pairs above seed noise."""
    protocol = population_protocol(preset, population)
    study = endpoints(rows, protocol, preset.measures)
    kept, _ = split_included(rows, protocol, preset.measures)
    study["split_half"] = {}
    for m, entry in study["measures"].items():
        halves = [r["per_batch"].get(m, {}).get(entry["rho"], []) for r in kept]
        if all(len(h) == 2 for h in halves):
            study["split_half"][m] = split_half([h[0] for h in halves], [h[1] for h in halves])
    columns = {c: [r[c] for r in kept] for c in ("error_gap", "test_error", "train_error")}
    for m, entry in study["measures"].items():
        columns[f"{m}@{entry['rho']:g}"] = [r["measures"][m][entry["rho"]] for r in kept]
    spread = {}
    for column, values in columns.items():
        v = np.array(values, dtype=np.float64)
        spread[column] = dict(
            mean=float(v.mean()), sd=float(v.std(ddof=1)), min=float(v.min()), max=float(v.max())
        )
    study["spread"] = spread
    study["tau_curves"] = tau_curves(kept, preset.measures, n_boot=500)
    study["secondary"] = secondary_study(preset, kept)
    study["reach"] = reach_study(preset, kept)
    if preset.design == "star":
        study["granulated"] = granulated_study(preset, kept, study, seed_sd)
    return study


def star_groups(rows: list[dict], axes) -> list[dict[str, list[int]]]:
    """``groups[b][axis]``: the indices (into ``rows``) of base ``b`` and of its variants
    along ``axis``; a base whose own model is not among the rows has no groups."""
    groups = []
    for b in sorted({int(r["base"]) for r in rows}):
        members = [i for i, r in enumerate(rows) if int(r["base"]) == b]
        roots = [i for i in members if not rows[i]["varied"]]
        if not roots:
            continue
        by_axis = {}
        for axis in axes:
            variants = [i for i in members if rows[i]["varied"] == axis]
            if variants:
                by_axis[axis] = roots + variants
        groups.append(by_axis)
    return groups


def granulated_study(
    preset: ZooPreset, rows: list[dict], study: dict, seed_sd: float | None = None
) -> dict:
    """Jiang et al.'s granulated tau on the star design's exact one-axis groups, for
    every main measure at its calibrated radius and every baseline, with a bootstrap
    over base configurations, and the number of groups per axis. With ``seed_sd`` (the
    gap's sd over seeds of one recipe), ``seed_noise`` counts per axis the variants
    whose gap differs from their base's by more than seed noise
    (:func:`~geosharp_studies.stats.above_seed_noise`) and gives every column's
    granulated tau on those pairs alone."""
    from ..stats import (
        above_seed_noise,
        granulated_tau_ci,
        grouped_granulated_tau,
        seed_noise_threshold,
    )

    groups = star_groups(rows, preset.axes)
    gap = np.array([r["error_gap"] for r in rows], dtype=np.float64)
    columns = {m: [r["measures"][m][e["rho"]] for r in rows] for m, e in study["measures"].items()}
    columns |= {b: [r[b] for r in rows] for b in study["baselines"]}
    out = {}
    for name, values in columns.items():
        pooled: dict[str, list[list[int]]] = {}
        for g in groups:
            for axis, idx in g.items():
                pooled.setdefault(axis, []).append(idx)
        per_axis = grouped_granulated_tau(values, gap, pooled)["per_axis"]
        ci = granulated_tau_ci(values, gap, groups, n_boot=2000, seed=preset.seed)
        out[name] = dict(granulated=ci.estimate, ci=[ci.low, ci.high], per_axis=per_axis)
    result = dict(n_bases=len(groups), by_measure=out)
    if seed_sd is not None:
        pairs: dict[str, list[list[int]]] = {}  # (base, variant) pairs above seed noise
        counts: dict[str, dict[str, int]] = {}
        for g in groups:
            for axis, (root, *variants) in g.items():
                c = counts.setdefault(axis, dict(pairs=0, above=0))
                above = above_seed_noise(gap[[root] * len(variants)], gap[variants], seed_sd)
                c["pairs"] += len(variants)
                c["above"] += int(above.sum())
                pairs.setdefault(axis, []).extend(
                    [root, v] for v, a in zip(variants, above, strict=True) if a
                )
        result["seed_noise"] = dict(
            seed_sd=float(seed_sd),
            threshold=seed_noise_threshold(seed_sd),
            per_axis=counts,
            granulated={
                name: grouped_granulated_tau(values, gap, pairs)["granulated"]
                for name, values in columns.items()
            },
        )
    return result


def reach_study(preset: ZooPreset, rows: list[dict]) -> dict:
    """Every worst-case column the rows carry (each main measure at each grid radius,
    each secondary sharpness measure at its radius; no average case, no trace) with its
    median loss increase and tau with the gap, and :func:`~geosharp_studies.stats.
    reach_tau` over them: how closely tau follows the ball's reach. Exploratory, not a
    pre-registered endpoint."""
    columns = [(m, rho) for m in preset.measures for rho in sorted(rows[0]["measures"][m])]
    columns += [
        (k, preset.secondary_rho(k))
        for k in preset.secondary
        if all(k in r["measures"] for r in rows)
    ]
    if len(columns) < 3:
        return {}
    values = np.array([[r["measures"][m][rho] for r in rows] for m, rho in columns])
    gap = np.array([r["error_gap"] for r in rows], dtype=np.float64)
    ci = reach_tau(values, gap, n_boot=2000, seed=preset.seed)
    points = [
        dict(
            measure=m,
            rho=rho,
            main=m in preset.measures,
            median=float(np.median(v)),
            tau=kendall_tau(v, gap, "b"),
        )
        for (m, rho), v in zip(columns, values, strict=True)
    ]
    return dict(points=points, tau=ci.estimate, ci=[ci.low, ci.high])


def secondary_study(preset: ZooPreset, rows: list[dict]) -> dict:
    """Each secondary measure and average case at its main measure's primary radius
    (or its own, :meth:`~geosharp_studies.zoo.presets.ZooPreset.secondary_rho`),
    and each Hessian trace beside its geometry's main measure there: tau with the gap,
    the paired difference ``tau(main) - tau(secondary)`` (does the ablated term
    matter? does worst-case sharpness rank better than curvature?) and the median
    ratio of their values (neither a radius nor a ratio for a trace: ``None``). A key
    is in once every row has it (the passes end at different times)."""
    if len(preset.passes()) < 2:
        return {}
    keys = {
        k: base
        for k, base in preset.secondary_keys().items()
        if base in preset.primary and all(k in r["measures"] for r in rows)
    }
    gap = np.array([r["error_gap"] for r in rows], dtype=np.float64)
    boot = dict(n_boot=2000, seed=preset.seed)
    out = {}
    for key, base in keys.items():
        rho = preset.primary_rho(base)
        trace = key in HESSIAN_TRACES
        at = 0.0 if trace else preset.secondary_rho(key)
        v = np.array([r["measures"][key][at] for r in rows], dtype=np.float64)
        ref = np.array([r["measures"][base][rho] for r in rows], dtype=np.float64)
        ci = kendall_tau_with_ci(v, gap, **boot)
        diff = tau_difference(ref, v, gap, **boot)
        out[key] = dict(
            main=base,
            rho=None if trace else at,
            tau=ci.estimate,
            ci=[ci.low, ci.high],
            main_minus_this=dict(tau_diff=diff.estimate, ci=[diff.low, diff.high]),
            median_value_ratio=None if trace else float(np.median(v / ref)),
        )
    return out
