"""Measurement: every trained model at every (measure, radius) of its preset, with
the trivial baselines beside it; results are written as they come."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from geosharp import distributed as gd
from geosharp.io import write_json_atomic
from geosharp.loading.data import move_batch

from .presets import ZooPreset, sample_hyperparameters
from .store import check_preset, missing, model_complete, my_share, read_json, zoo_dir
from .tasks import task_for
from .train import prepare

__all__ = ["measure_grid", "measure_zoo", "measurement_batches", "model_baselines"]


def measurement_batches(preset: ZooPreset, hp: dict) -> list:
    """The fixed training points (the first ``n_points`` of the pool, a prefix of every
    model's training set), with the labels that model was trained on, in batches."""
    task = task_for(preset.zoo)
    return task.batches(task.train_set(hp), preset.measure_batch, preset.n_points)


def model_baselines(preset: ZooPreset, hp: dict, model, device=None) -> dict:
    """The trivial predictors a measure must beat, for one model:

    * ``grad_norm``: ``||grad L||_2`` of the mean loss over the whole training set
      (without augmentation);
    * ``weight_norm``: ``||theta||_2`` over every parameter;
    * ``distance_from_init``: ``||theta - theta_0||_2`` from the model's own starting
      point (the pre-trained encoder and its seeded head for text, the seeded
      initialisation for vision), which the task rebuilds exactly from ``hp``;
    * ``measure_loss``: the mean loss on the measurement points.
    """
    task = task_for(preset.zoo)

    def weighted(batches):
        n = sum(len(task.labels(b)) for b in batches)
        for b in batches:
            yield move_batch(b, device), len(task.labels(b)) / n

    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    for batch, w in weighted(task.batches(task.train_set(hp), preset.measure_batch)):
        (task.loss(model, batch) * w).backward()
    grad_sq = sum(
        float(p.grad.double().square().sum()) for p in params.values() if p.grad is not None
    )
    model.zero_grad(set_to_none=True)
    start = dict(task.build_model(hp).named_parameters())
    with torch.no_grad():
        weight_sq = sum(float(p.double().square().sum()) for p in params.values())
        dist_sq = sum(
            float((p.double().cpu() - start[name].double()).square().sum())
            for name, p in params.items()
        )
        loss = sum(
            float(task.loss(model, b)) * w for b, w in weighted(measurement_batches(preset, hp))
        )
    return dict(
        grad_norm=grad_sq**0.5,
        weight_norm=weight_sq**0.5,
        distance_from_init=dist_sq**0.5,
        measure_loss=loss,
    )


def _measured(record: dict, preset: ZooPreset) -> bool:
    if preset.baselines and "baselines" not in record:
        return False
    return not any(missing(record, grid) for grid in preset.passes())


def _done(record: dict, preset: ZooPreset) -> bool:
    return bool(record.get("complete")) and _measured(record, preset)


def measure_zoo(
    preset: ZooPreset,
    out: str | Path,
    progress: bool = True,
    on_model_done: Callable[[str], None] | None = None,
    device: torch.device | None = None,
) -> list[str]:
    """Measure every trained model at every (measure, radius) of the preset, and its
    baselines (:func:`model_baselines`) when the preset asks for them.

    The measurements go in the preset's passes (:meth:`ZooPreset.passes`): the main grid
    for every model first, then the secondary measures at the primary radii, so the
    primary endpoint is complete first. ``measures/<id>.json`` is rewritten atomically
    after the baselines and after each (measure, radius), so a killed run loses at most
    one of them; a record is marked ``complete`` once every pass is in it. Returns the
    ids of the models measured to completion by this call."""
    from geosharp.progress import Progress

    check_preset(preset, out)
    prepare(preset, out, device=device)
    zdir = zoo_dir(out, preset)
    if gd.rank_and_world()[0] == 0:  # the settings now measured (what is measured may grow)
        write_json_atomic(zdir / "preset.json", asdict(preset))
    mdir = zdir / "measures"
    mdir.mkdir(parents=True, exist_ok=True)
    pending = my_share(
        [
            hp
            for hp in sample_hyperparameters(preset)
            if model_complete(zdir / "models" / hp["id"])
            and not _done(read_json(mdir / f"{hp['id']}.json"), preset)
        ]
    )
    passes = preset.passes()
    done_ids = []

    def finish(hp: dict) -> None:  # a model whose every pass is in: mark it complete
        path = mdir / f"{hp['id']}.json"
        record = read_json(path)
        if not record.get("complete"):
            record["complete"] = True
            write_json_atomic(path, record)
        done_ids.append(hp["id"])
        if on_model_done is not None:
            on_model_done(hp["id"])

    for i, grid in enumerate(passes):
        todo = [hp for hp in pending if missing(read_json(mdir / f"{hp['id']}.json"), grid)]
        desc = f"measure {preset.zoo}" + (f" ({i + 1}/{len(passes)})" if len(passes) > 1 else "")
        for hp in Progress(todo, desc=desc, unit="model", enabled=progress):
            path = mdir / f"{hp['id']}.json"
            _measure_one(preset, hp, path, zdir, grid, device)
            if _measured(read_json(path), preset):
                finish(hp)
    for hp in pending:  # measured before (e.g. by a run killed before marking them)
        if hp["id"] not in done_ids:
            finish(hp)
    return done_ids


@contextlib.contextmanager
def measurement_setting(preset: ZooPreset, model, batches):
    """What every measure of the preset sees: yields ``(batches, kwargs)``, the batches
    (with the token-embedding table restricted to their rows while the block lasts,
    when ``measure_vocabulary == "batch"``) and the keywords of the measure (the
    parameters left unperturbed by ``frozen_in_measure``)."""
    from geosharp.loading.vocabulary import compact_vocabulary

    kwargs = {}
    if preset.frozen_in_measure:
        frozen = set(preset.frozen_in_measure)
        kwargs["parameters"] = [n for n, _ in model.named_parameters() if n not in frozen]
    if preset.measure_vocabulary != "batch":
        yield batches, kwargs
        return
    with compact_vocabulary(model, batches, task_for(preset.zoo).embedding) as compact:
        yield compact, kwargs


def _measure_one(preset: ZooPreset, hp: dict, path: Path, zdir: Path, grid: dict, device) -> None:
    task = task_for(preset.zoo)
    record = read_json(path)
    record.setdefault("id", hp["id"])
    record.setdefault("n_points", preset.n_points)
    record.setdefault("batch_size", preset.measure_batch)
    record.setdefault("n_iters", preset.n_iters)
    model = task.load_model(zdir / "models" / hp["id"]).to(device or "cpu")
    if preset.baselines and "baselines" not in record:
        record["baselines"] = model_baselines(preset, hp, model, device=device)
        write_json_atomic(path, record)
    batches = [move_batch(b, device) for b in measurement_batches(preset, hp)]
    if preset.frozen_in_measure:
        record.setdefault("unperturbed_parameters", sorted(preset.frozen_in_measure))
    with measurement_setting(preset, model, batches) as (measured, kwargs):
        if preset.measure_vocabulary == "batch":
            record.setdefault("embedding_rows", model.get_submodule(task.embedding).num_embeddings)
        measure_grid(
            record,
            path,
            model,
            measured,
            task.loss,
            grid,
            n_iters=preset.n_iters,
            seed=preset.seed,
            complete=False,
            trace_probes=preset.trace_probes,
            average_samples=preset.average_samples,
            **kwargs,
        )


def measure_grid(
    record: dict,
    path: Path,
    model,
    batches,
    loss_fn,
    grid: dict[str, Sequence[float]],
    n_iters: int,
    seed: int,
    complete: bool = True,
    trace_probes: int = 30,
    average_samples: int = 10,
    **sharpness_kwargs,
) -> dict:
    """Fill ``record["measures"][key][repr(rho)]`` (value, per-batch values, loss,
    per-batch losses) for every ``(key, rho)`` of ``grid`` not in it yet, rewriting
    ``path`` atomically after each; then (``complete``) mark the record complete.

    A key is a measure's name (worst case, ``n_iters`` Auto-PGD steps),
    ``"<name>/average"`` (its average case over ``average_samples`` directions), or a
    Hessian trace of :data:`~geosharp.measures.HESSIAN_TRACES` (``trace_probes``
    probes; its one "radius" is 0, and it keeps ``stderr`` and ``per_probe``). A radius
    where a perturbed loss is not finite is recorded as ``inf`` (the endpoints leave
    such a model out, saying why), not an error that stops the study."""
    from geosharp.measures import HESSIAN_TRACES, AverageCase, WorstCase, hessian_trace, sharpness
    from geosharp.symmetry import find_symmetries

    sharpness_kwargs.setdefault("nonfinite", "inf")
    if "symmetries" not in sharpness_kwargs:  # found once for every measure of the grid
        sharpness_kwargs["symmetries"] = find_symmetries(
            model, batches[0], loss_fn=loss_fn, warn=False
        )
    results = record.setdefault("measures", {})
    for key, radii in grid.items():
        per_rho = results.setdefault(key, {})
        if key in HESSIAN_TRACES:
            if repr(0.0) not in per_rho:
                kwargs = {
                    k: v for k, v in sharpness_kwargs.items() if k in ("parameters", "symmetries")
                }
                trace = hessian_trace(
                    model,
                    batches,
                    loss_fn,
                    HESSIAN_TRACES[key],
                    n_probes=trace_probes,
                    seed=seed,
                    **kwargs,
                )
                per_rho[repr(0.0)] = dict(
                    value=trace.value,
                    stderr=trace.stderr,
                    per_probe=trace.per_probe,
                    loss=trace.loss,
                    per_batch=[],
                )
                write_json_atomic(path, record)
            continue
        name, _, kind = key.partition("/")
        estimator = AverageCase(average_samples) if kind == "average" else WorstCase(n_iters)
        for rho in radii:
            if repr(rho) in per_rho:
                continue
            res = sharpness(
                model,
                batches,
                loss_fn,
                measure=name,
                rho=rho,
                estimator=estimator,
                seed=seed,
                **sharpness_kwargs,
            )
            per_rho[repr(rho)] = dict(
                value=res.value,
                per_batch=list(res.per_batch),
                loss=res.loss,
                per_batch_loss=list(res.per_batch_loss),
            )
            write_json_atomic(path, record)
    if complete:
        record["complete"] = True
        write_json_atomic(path, record)
    return record
