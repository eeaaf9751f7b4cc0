"""The pilot of a population: radii and maximiser fixed before any gap is looked at.

A few models drawn like the population's (from another seed, so none of them is in it)
are trained and measured with the preset's protocol over a doubling grid of radii
(:func:`~geosharp_studies.pilot.radius_pilot`); at each measure's ratio-rule radius
(:func:`~geosharp_studies.pilot.primary_factor`) the maximiser is checked with more
steps and more starts (:func:`~geosharp_studies.pilot.maximiser_check`). Results go to
``<out>/<zoo>/pilot/<id>.json``, each written once its model is done; a killed run
resumes with the next model. Only losses are recorded for the choice; the models'
errors are stored but are not the population's gaps.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from geosharp import distributed as gd
from geosharp.io import write_json_atomic
from geosharp.loading.data import move_batch

from ..pilot import maximiser_check, primary_factor, radius_pilot
from .measure import measurement_batches, measurement_setting
from .presets import ZooPreset, sample_hyperparameters
from .store import my_share, read_json, zoo_dir
from .tasks import task_for
from .train import prepare, train_one

__all__ = ["PILOT_FACTORS", "format_pilot", "pilot_zoo", "propose_protocol"]

PILOT_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
PILOT_SEED_OFFSET = 1000  # pilot models draw from preset.seed + this: not in the population


def pilot_hyperparameters(preset: ZooPreset, n_models: int) -> list[dict]:
    """The pilot's models: drawn like the population's, from another seed."""
    draw = dataclasses.replace(preset, n_models=n_models, seed=preset.seed + PILOT_SEED_OFFSET)
    return [dict(hp, id=f"pilot-{i:03d}") for i, hp in enumerate(sample_hyperparameters(draw))]


def pilot_zoo(
    preset: ZooPreset,
    out: str | Path,
    n_models: int = 2,
    factors=PILOT_FACTORS,
    long_iters: int = 50,
    starts: int = 3,
    progress: bool = True,
    device: torch.device | None = None,
) -> list[dict]:
    """Train and measure the pilot models not done yet; returns every pilot record."""
    from geosharp.progress import Progress

    prepare(preset, out, device=device)
    task = task_for(preset.zoo)
    pdir = zoo_dir(out, preset) / "pilot"
    pdir.mkdir(parents=True, exist_ok=True)
    hps = pilot_hyperparameters(preset, n_models)
    todo = my_share([hp for hp in hps if not (pdir / f"{hp['id']}.json").exists()])
    for hp in Progress(todo, desc=f"pilot {preset.zoo}", unit="model", enabled=progress):
        start = time.time()
        model, metrics = train_one(hp, preset.zoo, preset.n_test, device=device)
        batches = [move_batch(b, device) for b in measurement_batches(preset, hp)]
        record = dict(
            hyperparameters=hp,
            metrics=metrics,
            n_points=preset.n_points,
            batch_size=preset.measure_batch,
            n_iters=preset.n_iters,
        )
        with measurement_setting(preset, model, batches) as (measured, kwargs):
            pilot = radius_pilot(
                model, measured, task.loss, preset.measures, factors, preset.n_iters, **kwargs
            )
            record["radius_pilot"] = pilot
            record["maximiser"] = {}
            for name, entry in pilot.items():
                factor = primary_factor(entry) or entry["factors"][-1]
                rho = entry["rho"][entry["factors"].index(factor)]
                record["maximiser"][name] = maximiser_check(
                    model,
                    measured,
                    task.loss,
                    name,
                    rho,
                    preset.n_iters,
                    long_iters,
                    starts,
                    **kwargs,
                )
        record["seconds"] = time.time() - start
        write_json_atomic(pdir / f"{hp['id']}.json", record)
    gd.barrier()  # every rank's records are written before any rank reads them
    return [read_json(pdir / f"{hp['id']}.json") for hp in hps]


def format_pilot(records: list[dict], min_ratio: float = 3.0) -> str:
    """The pilot's table: per measure, the ratios along the grid for each model and the
    ratio-rule factor; and the maximiser's relative moves there."""
    lines = [
        "| measure | model | s(2 rho)/s(rho) along the grid | primary factor "
        "| move with more steps | move with more starts |",
        "|---|---|---|---|---|---|",
    ]
    for record in records:
        if not record:
            continue
        for name, entry in record["radius_pilot"].items():
            ratios = ", ".join(f"{r:.2f}" for r in entry["ratio"])
            factor = primary_factor(entry, min_ratio)
            check = record["maximiser"][name]
            lines.append(
                f"| {name} | {record['hyperparameters']['id']} | {ratios} | "
                f"{'none' if factor is None else f'{factor:g}'} | "
                f"{check['move_long']:.2%} | {check['move_starts']:.2%} |"
            )
    if any(records):
        proposal = propose_protocol(records, min_ratio)
        lines += ["", f"Proposed (`propose_protocol`): target {proposal.pop('target'):g}; "]
        lines[-1] += "; ".join(
            f"{m} primary x{p['primary']:g}, grid x{', x'.join(f'{g:g}' for g in p['grid'])}"
            for m, p in proposal.items()
        )
    return "\n".join(lines) + "\n"


def propose_protocol(records: list[dict], min_ratio: float = 3.0) -> dict:
    """The rule that turns a pilot into a population's protocol, fixed in code:

    * per measure, the **primary factor** is the largest over the pilot models of the
      first factor whose ratio ``s(2 rho)/s(rho)`` reaches ``min_ratio`` (the last
      factor if none does); its **grid** is that factor times 1/4, 1/2, 1 and 2, so
      the linear regime and the curved one are both on it;
    * the **calibration target** is the geometric mean over measures of the median
      (over models) loss increase at the primary factor, to one significant digit.

    >>> entry = {"factors": [1, 2, 4, 8], "ratio": [2.1, 2.5, 3.2], "value": [.01, .02, .05, .16]}
    >>> propose_protocol([{"radius_pilot": {"adaptive": entry}}])["adaptive"]["grid"]
    [1.0, 2.0, 4.0, 8.0]
    """
    records = [r for r in records if r]
    out: dict = {}
    increases = []
    for name in records[0]["radius_pilot"]:
        entries = [r["radius_pilot"][name] for r in records]
        factors = [primary_factor(e, min_ratio) or e["factors"][-1] for e in entries]
        primary = max(factors)
        at = [e["value"][e["factors"].index(primary)] for e in entries]
        increases.append(float(np.median(at)))
        out[name] = dict(primary=primary, grid=[primary * f for f in (0.25, 0.5, 1.0, 2.0)])
    mean = float(np.exp(np.mean(np.log(increases))))
    out["target"] = float(f"{mean:.1g}")
    return out
