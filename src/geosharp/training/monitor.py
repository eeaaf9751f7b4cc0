"""Sharpness during training: a plain hook for custom loops.

:class:`SharpnessMonitor` measures chosen measures on a fixed set of training batches
whenever it is called and returns them as metrics (``{"sharpness/adaptive": ...}``)
for any logger; :class:`geosharp.training.callbacks.SharpnessCallback` drives it from a Hugging
Face ``Trainer``. Measuring never changes the model (see :func:`geosharp.sharpness`);
it costs ``n_iters`` forward+backward passes per batch and measure.

A custom loop::

    monitor = SharpnessMonitor(train_batches[:2], loss_fn, measures=["geodesic-inv"])
    for step, batch in enumerate(loader):
        ...
        if step % 100 == 0:
            writer.add_scalars("sharpness", monitor(model, step), step)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from ..loading.data import move_batch
from ..measures import DEFAULT_RHO, WorstCase, measure_kwargs, sharpness
from ..measures.problem import check_model, checked_rho
from ..params import LossFunction

__all__ = ["SharpnessMonitor"]


def _hf_loss(model: nn.Module, batch):
    from ..loading.hfdata import task_loss

    return task_loss(model, batch)


class SharpnessMonitor:
    """Measure ``measures`` of a model on fixed ``batches`` each time it is called.

    Args:
        batches: the training batches to measure on (kept; use the same ones all along).
        loss_fn: ``loss_fn(model, batch)``; default: the training loss of a Hugging Face
            classifier on dict batches with ``labels``.
        measures: names of :data:`geosharp.measures.MEASURES`.
        rho: one radius for all measures, or ``{name: rho}``; default ``DEFAULT_RHO``.
        n_iters, seed, **options: passed to :func:`geosharp.sharpness`; unless
            ``options`` say otherwise, a radius where a perturbed loss is not finite
            gives ``inf`` (``nonfinite="inf"``), so that training goes on.
        prefix: prefix of the metric names.

    ``monitor(model, step)`` returns ``{prefix + name: value, prefix + "loss": loss}``
    and appends it, with the step, to ``monitor.history``.
    """

    def __init__(
        self,
        batches: Iterable,
        loss_fn: LossFunction | None = None,
        measures: Sequence[str] = ("adaptive", "geodesic-inv"),
        rho: float | Mapping[str, float] | None = None,
        n_iters: int = 10,
        seed: int = 0,
        prefix: str = "sharpness/",
        **options,
    ):
        if isinstance(measures, str):
            measures = [measures]
        self.measures = list(measures)
        if not self.measures:
            raise ValueError("measures is empty: name at least one, e.g. ['geodesic-inv']")
        for name in self.measures:
            measure_kwargs(name)  # unknown names fail here, not mid-training
        if rho is None or isinstance(rho, Mapping):
            given = dict(rho or {})
            unknown = set(given) - set(self.measures)
            if unknown:
                raise ValueError(f"rho names {sorted(unknown)}, which are not in measures")
            self.rho = {n: checked_rho(given.get(n, DEFAULT_RHO[n])) for n in self.measures}
        else:
            self.rho = {n: checked_rho(rho) for n in self.measures}
        if isinstance(n_iters, bool) or not isinstance(n_iters, int) or n_iters < 1:
            raise ValueError(f"n_iters must be a positive integer, got {n_iters!r}")
        unknown = sorted(set(options) - set(inspect.signature(sharpness).parameters))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)} for geosharp.sharpness")
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("batches is empty: give the training batches to measure on")
        self.loss_fn = loss_fn or _hf_loss
        # an estimator in options replaces n_iters
        self.estimator = options.pop("estimator", None) or WorstCase(n_iters=n_iters)
        self.n_iters, self.seed, self.prefix, self.options = n_iters, seed, prefix, options
        self.history: list[dict] = []

    def __call__(self, model: nn.Module, step: int | None = None) -> dict[str, float]:
        from ..symmetry import find_symmetries

        check_model(model)
        device = next(model.parameters()).device
        batches = [move_batch(b, device) for b in self.batches]
        symmetries = find_symmetries(model, batches[0], loss_fn=self.loss_fn, warn=False)
        metrics: dict[str, float] = {}
        for name in self.measures:
            result = sharpness(
                model,
                batches,
                self.loss_fn,
                rho=self.rho[name],
                estimator=self.estimator,
                seed=self.seed,
                symmetries=symmetries,
                measure=name,
                **{"nonfinite": "inf", **self.options},  # training goes on; inf is logged
            )
            metrics[self.prefix + name] = result.value
        metrics[self.prefix + "loss"] = result.loss
        self.history.append({"step": step, **metrics})
        return metrics
