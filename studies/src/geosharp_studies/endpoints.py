"""The endpoints of a sharpness study, fixed before any gap is looked at.

A :class:`Protocol` is written down first: the inclusion rule (training error at most
``max_train_error``), the calibration target (the median loss increase every measure
is brought to), and the measurement settings. :func:`endpoints` then turns one row per
model into the study's ``endpoints.json``:

* **excluded** models, each with its reason (never dropped silently);
* per measure, the **calibrated radius** (the grid radius whose median loss increase is
  closest to the target, :func:`~geosharp_studies.stats.calibrated_index`), the median
  linearity ratio ``s(2 rho) / s(rho)`` there, Kendall's tau with the gap and its
  bootstrap interval, and the partial tau given the training loss;
* the **primary endpoint**, ``tau(geodesic) - tau(adaptive)`` by a paired bootstrap
  over models with the radius re-selected inside every resample
  (:func:`~geosharp_studies.stats.tau_difference`), also in ``|tau|``; and the same
  difference at every grid factor (secondary);
* the **baselines** (training loss, training error, gradient norm, ... whichever the
  rows carry) with their taus, in the same table.

Every value is recomputable from the rows (``models.csv``) with this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .stats import calibrated_index, kendall_tau_with_ci, partial_tau, tau_difference

__all__ = [
    "BASELINES",
    "Protocol",
    "endpoints",
    "format_endpoints",
    "plot_tau_curves",
    "pooled_difference",
    "split_included",
    "tau_curves",
]

# Columns of a model row that are reported as trivial baselines when present.
BASELINES = (
    "train_loss",
    "train_error",
    "grad_norm",
    "weight_norm",
    "distance_from_init",
    "measure_loss",
    "lr",
)


@dataclass(frozen=True)
class Protocol:
    """What is fixed before the gaps are seen."""

    population: str
    target: float  # median loss increase that every measure is calibrated to
    n_points: int
    batch_size: int
    n_iters: int
    starts: int | str = "zero"
    max_train_error: float = 0.05
    reference: str = "adaptive"  # the measure the geodesic ones are compared with
    compared: tuple[str, ...] | None = None  # compared with the reference (None: all others)
    n_boot: int = 2000
    seed: int = 0


def _grid(row: dict, measure: str) -> dict[float, float]:
    return {float(r): float(v) for r, v in row["measures"][measure].items()}


def _exclusions(rows: Sequence[dict], protocol: Protocol, measures: Sequence[str]) -> list:
    excluded = []
    for row in rows:
        if not row["train_error"] <= protocol.max_train_error:
            excluded.append(
                dict(
                    id=row["id"],
                    reason=f"training error {row['train_error']:.3g} > "
                    f"{protocol.max_train_error:g}",
                )
            )
            continue
        missing = [m for m in measures if m not in row.get("measures", {})]
        bad = [
            m
            for m in measures
            if m not in missing and not all(map(math.isfinite, _grid(row, m).values()))
        ]
        if missing or bad:
            excluded.append(
                dict(id=row["id"], reason=f"missing or non-finite values: {missing + bad}")
            )
    return excluded


def split_included(
    rows: Sequence[dict], protocol: Protocol, measures: Sequence[str]
) -> tuple[list[dict], list[dict]]:
    """The inclusion rule: ``(kept rows, excluded)``, each exclusion ``{id, reason}``
    (training error above ``protocol.max_train_error``, or a measure missing or not
    finite)."""
    excluded = _exclusions(rows, protocol, measures)
    out_ids = {e["id"] for e in excluded}
    return [r for r in rows if r["id"] not in out_ids], excluded


def endpoints(rows: Sequence[dict], protocol: Protocol, measures: Sequence[str]) -> dict:
    """The study's endpoints from one row per model.

    A row holds ``id``, ``train_error``, ``train_loss``, ``error_gap``, optional
    baseline columns (:data:`BASELINES`) and ``measures: {name: {rho: value}}``; every
    measure must have the same grid *factors* on every model (radii may differ between
    measures). Returns the ``endpoints.json`` dictionary.
    """
    kept, excluded = split_included(rows, protocol, measures)
    if len(kept) < 3:
        raise ValueError(f"{len(kept)} models pass the inclusion rule; a rank study needs more")
    gap = np.array([r["error_gap"] for r in kept], dtype=np.float64)
    loss = np.array([r["train_loss"] for r in kept], dtype=np.float64)
    boot = dict(n_boot=protocol.n_boot, seed=protocol.seed)

    radii, values = {}, {}
    for m in measures:
        radii[m] = sorted(_grid(kept[0], m))
        values[m] = np.array([[_grid(r, m)[rho] for r in kept] for rho in radii[m]])

    def select(v: np.ndarray) -> int:  # the radius rule, applied again in every resample
        return calibrated_index(v, protocol.target)

    result: dict = dict(
        population=protocol.population,
        protocol=asdict(protocol),
        n_models=len(kept),
        n_excluded=len(excluded),
        excluded=excluded,
        n_points=protocol.n_points,
        batch_size=protocol.batch_size,
        n_iters=protocol.n_iters,
        starts=protocol.starts,
        measures={},
        differences={},
        differences_by_factor={},
        baselines={},
    )
    for m in measures:
        k = calibrated_index(values[m], protocol.target)
        rho = radii[m][k]
        ratio = half = None  # JSON null when 2 rho (rho / 2) is not on the grid
        if 2 * rho in radii[m]:
            ratio = float(np.median(values[m][radii[m].index(2 * rho)] / values[m][k]))
        if rho / 2 in radii[m]:
            half = float(np.median(values[m][k] / values[m][radii[m].index(rho / 2)]))
        ci = kendall_tau_with_ci(values[m][k], gap, **boot)
        result["measures"][m] = dict(
            rho=rho,
            median_loss_increase=float(np.median(values[m][k])),
            median_ratio_2rho=ratio,
            median_ratio_from_half=half,
            tau=ci.estimate,
            ci=[ci.low, ci.high],
            partial_tau_given_train_loss=partial_tau(values[m][k], gap, loss),
        )
    ref = protocol.reference
    for m in measures:
        if m == ref or ref not in measures:
            continue
        if protocol.compared is not None and m not in protocol.compared:
            continue
        name = f"{m} minus {ref}"
        diff = tau_difference(values[m], values[ref], gap, select, select, **boot)
        absolute = tau_difference(
            values[m], values[ref], gap, select, select, absolute=True, **boot
        )
        result["differences"][name] = dict(
            tau_diff=diff.estimate,
            ci=[diff.low, diff.high],
            abs_tau_diff=absolute.estimate,
            abs_ci=[absolute.low, absolute.high],
        )
        if len(radii[m]) == len(radii[ref]):
            by_factor = {}
            for i in range(len(radii[m])):
                d = tau_difference(values[m][i], values[ref][i], gap, **boot)
                by_factor[f"{radii[m][i]:g} vs {radii[ref][i]:g}"] = dict(
                    tau_diff=d.estimate, ci=[d.low, d.high]
                )
            result["differences_by_factor"][name] = by_factor
    result["constant_baselines"] = []
    for column in BASELINES:
        if all(column in r for r in kept):
            x = np.array([r[column] for r in kept], dtype=np.float64)
            if np.all(x == x[0]):  # no ranking to correlate (e.g. one learning rate)
                result["constant_baselines"].append(column)
                continue
            ci = kendall_tau_with_ci(x, gap, **boot)
            result["baselines"][column] = dict(tau=ci.estimate, ci=[ci.low, ci.high])
    return result


def pooled_difference(
    studies: Sequence[tuple[Sequence[dict], Protocol]],
    measure: str,
    reference: str = "adaptive",
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """Exploratory (not pre-registered): the mean over populations of
    ``|tau(measure)| - |tau(reference)|`` with the gap, each at its population's
    calibrated radius (the radius rule applied again in every resample, as in the
    primary endpoint), with a bootstrap stratified by population (each population's
    models resampled within it). ``studies``: ``(rows, protocol)`` per population, the
    rows of :func:`endpoints`, filtered by the same inclusion rule."""
    from .stats import calibrated_index, kendall_tau, stratified_bootstrap_ci

    strata, targets, names = [], [], []
    for rows, protocol in studies:
        kept, _ = split_included(rows, protocol, [measure, reference])
        values = []
        for m in (measure, reference):
            radii = sorted(_grid(kept[0], m))
            values.append(np.array([[_grid(r, m)[rho] for rho in radii] for r in kept]))
        gap = np.array([r["error_gap"] for r in kept], dtype=np.float64)
        strata.append((*values, gap))
        targets.append(protocol.target)
        names.append(protocol.population)

    def differences(groups) -> list[float]:
        out = []
        for (a, b, gap), target in zip(groups, targets, strict=True):
            ta = kendall_tau(a[:, calibrated_index(a.T, target)], gap, "b")
            tb = kendall_tau(b[:, calibrated_index(b.T, target)], gap, "b")
            out.append(abs(ta) - abs(tb))
        return out

    ci = stratified_bootstrap_ci(
        lambda groups: float(np.mean(differences(groups))), strata, n_boot=n_boot, seed=seed
    )
    return dict(
        measure=measure,
        reference=reference,
        populations=names,
        n_models=[len(g[2]) for g in strata],
        per_population=dict(zip(names, differences(strata), strict=True)),
        estimate=ci.estimate,
        ci=[ci.low, ci.high],
        n_boot=n_boot,
        weighting="equal per population",
    )


def tau_curves(rows: Sequence[dict], measures: Sequence[str], n_boot: int = 500) -> dict:
    """Per measure and grid radius: the median loss increase and Kendall's tau with the
    gap (with its bootstrap interval), for the plot of tau against loss increase."""
    gap = np.array([r["error_gap"] for r in rows], dtype=np.float64)
    curves = {}
    for m in measures:
        points = []
        for rho in sorted(_grid(rows[0], m)):
            v = np.array([_grid(r, m)[rho] for r in rows])
            ci = kendall_tau_with_ci(v, gap, n_boot=n_boot)
            points.append(
                dict(rho=rho, median=float(np.median(v)), tau=ci.estimate, ci=[ci.low, ci.high])
            )
        curves[m] = points
    return curves


def plot_tau_curves(curves: dict, path, marks: Sequence[dict] = ()) -> None:
    """Kendall's tau against the median loss increase, one line with a band per measure;
    ``marks`` (each with ``median`` and ``tau``) are drawn as crosses (the secondary
    measures of a population report, listed in its ``endpoints.json``)."""
    from geosharp.cli.plots import require_matplotlib, save_png

    require_matplotlib()
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for i, (m, points) in enumerate(curves.items()):
        x = [p["median"] for p in points]
        ax.plot(x, [p["tau"] for p in points], "o-", color=f"C{i}", label=m, markersize=3)
        ax.fill_between(
            x, [p["ci"][0] for p in points], [p["ci"][1] for p in points], color=f"C{i}", alpha=0.15
        )
    if marks:
        ax.plot(
            [p["median"] for p in marks],
            [p["tau"] for p in marks],
            "x",
            color="0.25",
            markersize=4,
            label="secondary measures",
        )
    ax.axhline(0.0, color="0.5", linewidth=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("median loss increase over the models")
    ax.set_ylabel("Kendall tau with the error gap")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def _ci(value: float, ci: Sequence[float]) -> str:
    if not all(math.isfinite(x) for x in (value, *ci)):
        return "n/a"
    return f"{value:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}]"


def format_endpoints(study: dict, curves_png: str | None = None) -> str:
    """The Markdown section of a report for an :func:`endpoints` result (with the
    optional ``secondary``, ``granulated``, ``split_half`` and ``spread`` entries a
    population report adds)."""
    p = study["protocol"]
    lines = [
        f"# Pre-registered endpoints: {study['population']}",
        "",
        f"{study['n_models']} models kept, {study['n_excluded']} excluded (training error "
        f"above {p['max_train_error']:g}). Sharpness on {study['n_points']} training points "
        f"in batches of {study['batch_size']}, {study['n_iters']} Auto-PGD steps from "
        f"{study['starts']}. Every measure at its calibrated radius: the grid radius whose "
        f"median loss increase over the models is closest (log scale) to "
        f"{p['target']:g}. Kendall tau-b with the error gap; 95% percentile bootstrap "
        f"intervals over models ({p['n_boot']} resamples).",
        "",
        "| measure | calibrated rho | median loss increase | median s(2rho)/s(rho) "
        "| median s(rho)/s(rho/2) | tau with the gap | partial tau given training loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, e in study["measures"].items():
        ratios = [e["median_ratio_2rho"], e.get("median_ratio_from_half")]
        ratio, half = ("n/a" if r is None else f"{r:.2f}" for r in ratios)
        lines.append(
            f"| {m} | {e['rho']:.4g} | {e['median_loss_increase']:.4g} | {ratio} | {half} "
            f"| {_ci(e['tau'], e['ci'])} | {e['partial_tau_given_train_loss']:+.2f} |"
        )
    lines += [
        "",
        "## Primary endpoint: paired difference with the reference measure",
        "",
        "Paired bootstrap over models, the calibrated radius re-selected in every resample.",
        "",
        "| difference | tau | abs(tau) |",
        "|---|---|---|",
    ]
    for name, d in study["differences"].items():
        lines.append(
            f"| {name} | {_ci(d['tau_diff'], d['ci'])} | {_ci(d['abs_tau_diff'], d['abs_ci'])} |"
        )
    if study.get("differences_by_factor"):
        lines += ["", "Secondary: the same difference at every grid position.", ""]
        lines += ["| difference | radii | tau |", "|---|---|---|"]
        for name, by in study["differences_by_factor"].items():
            for radii, d in by.items():
                lines.append(f"| {name} | {radii} | {_ci(d['tau_diff'], d['ci'])} |")
    lines += ["", "## Trivial baselines", "", "| baseline | tau with the gap |", "|---|---|"]
    for name, b in study["baselines"].items():
        lines.append(f"| {name} | {_ci(b['tau'], b['ci'])} |")
    if study.get("secondary"):
        lines += [
            "",
            "## Secondary measures at the primary radius of their main measure",
            "",
            "Ablations keep one of the geodesic measure's two terms, attention-only "
            "variants perturb the query/key/value/output pairs only, average cases "
            "replace the worst case by the mean over random directions, Hessian traces "
            "(Hutchinson) in the main measure's geometry have no radius; a measure with a "
            "primary radius of its own (adaptive-linf) is measured there.",
            "",
            "| measure | main measure | rho | tau with the gap | tau(main) - tau(this) "
            "| median value / main's |",
            "|---|---|---|---|---|---|",
        ]
        for name, e in study["secondary"].items():
            d = e["main_minus_this"]
            rho = "-" if e["rho"] is None else f"{e['rho']:.4g}"
            ratio = "-" if e["median_value_ratio"] is None else f"{e['median_value_ratio']:.3g}"
            lines.append(
                f"| {name} | {e['main']} | {rho} | {_ci(e['tau'], e['ci'])} "
                f"| {_ci(d['tau_diff'], d['ci'])} | {ratio} |"
            )
    if study.get("reach"):
        reach = study["reach"]
        lines += [
            "",
            "## Tau against the reach of the ball (exploratory)",
            "",
            f"Over the {len(reach['points'])} worst-case columns (each main measure at each "
            "grid radius, each secondary measure at its radius), Kendall's tau between a "
            "column's median loss increase and its tau with the gap is "
            f"{_ci(reach['tau'], reach['ci'])} (bootstrap over models). Near +1: tau with "
            "the gap rises with how far the ball raises the loss, whichever measure and "
            "radius give the column.",
        ]
    if study.get("granulated"):
        gran = study["granulated"]
        axes = sorted({a for e in gran["by_measure"].values() for a in e["per_axis"]})
        lines += [
            "",
            f"## Granulated tau on the star design ({gran['n_bases']} base "
            f"configuration{'' if gran['n_bases'] == 1 else 's'})",
            "",
            "Jiang et al.'s definition on exact one-axis groups (a base and its variant); "
            "95% interval from a bootstrap over base configurations.",
            "",
            "| measure | granulated tau | " + " | ".join(axes) + " |",
            "|---|---|" + "---|" * len(axes),
        ]
        for name, e in gran["by_measure"].items():
            cells = [
                f"{e['per_axis'][a]['tau']:+.2f} ({e['per_axis'][a]['groups']})"
                if a in e["per_axis"]
                else "n/a"
                for a in axes
            ]
            lines.append(
                f"| {name} | {_ci(e['granulated'], e['ci'])} | " + " | ".join(cells) + " |"
            )
        if gran.get("seed_noise"):
            noise = gran["seed_noise"]
            counts = ", ".join(
                f"{a} {c['above']}/{c['pairs']}" for a, c in noise["per_axis"].items()
            )
            lines += [
                "",
                f"Seed-level noise: the gap's sd over the seed population is "
                f"{noise['seed_sd']:.4g}, so two seeds of one recipe differ by more than "
                f"{noise['threshold']:.4g} in 5% of cases (normal gaps). One-axis pairs "
                f"whose gaps differ by more: {counts}. Granulated tau on those pairs alone: "
                + ", ".join(
                    f"{name} {t:+.2f}" if t is not None and np.isfinite(t) else f"{name} n/a"
                    for name, t in noise["granulated"].items()
                )
                + ".",
            ]
    if study.get("split_half"):
        lines += [
            "",
            "## Split-half reliability (the two measurement batches, calibrated radius)",
            "",
            "| measure | tau between halves | Pearson r | Spearman-Brown |",
            "|---|---|---|---|",
        ]
        for m, h in study["split_half"].items():
            lines.append(
                f"| {m} | {h['tau']:+.2f} | {h['pearson']:+.3f} | {h['spearman_brown']:+.3f} |"
            )
    if study.get("spread"):
        lines += [
            "",
            "## Spread over the kept models",
            "",
            "The gap, the errors and every measure at its calibrated radius (in a seed "
            "population: the seed-level noise).",
            "",
            "| | mean | sd | sd / mean | min | max |",
            "|---|---|---|---|---|---|",
        ]
        for column, v in study["spread"].items():
            cv = f"{v['sd'] / v['mean']:.3g}" if v["mean"] else "n/a"
            lines.append(
                f"| {column} | {v['mean']:.4g} | {v['sd']:.4g} | {cv} | {v['min']:.4g} "
                f"| {v['max']:.4g} |"
            )
    if study["excluded"]:
        lines += [
            "",
            "Excluded: " + "; ".join(f"{e['id']} ({e['reason']})" for e in study["excluded"]),
        ]
    if curves_png:
        lines += ["", f"![tau against the median loss increase]({curves_png})"]
    return "\n".join(lines) + "\n"
