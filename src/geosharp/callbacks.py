"""Sharpness in a Hugging Face ``Trainer``: :class:`SharpnessCallback`.

It measures chosen sharpness measures on fixed training batches every
``every_n_steps`` optimiser steps and/or at each evaluation, and logs them with the
Trainer's own metrics, so that they reach the loggers already configured
(TensorBoard, W&B, CSV, ...). The measuring is :class:`geosharp.monitor.SharpnessMonitor`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from .errors import MissingDependencyError
from .monitor import SharpnessMonitor
from .params import LossFunction

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on the install
    raise MissingDependencyError(
        "SharpnessCallback needs transformers: pip install 'geosharp[hf]'"
    ) from None

__all__ = ["SharpnessCallback"]


class SharpnessCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that measures sharpness while training.

    Use::

        trainer = Trainer(model=model, args=args, train_dataset=train)
        SharpnessCallback(batches, measures=["geodesic-inv"], every_n_steps=100).attach(trainer)
        trainer.train()

    Measures every ``every_n_steps`` optimiser steps (``None``: never) and, with
    ``at_evaluate``, at each evaluation (the values are then also added to the
    evaluation's metrics). ``attach(trainer)`` registers the callback and logs through
    ``trainer.log``, which reaches every logger the Trainer reports to and
    ``trainer.state.log_history``. Passed as ``Trainer(callbacks=[...])`` without
    ``attach``, the callback cannot reach the loggers (callbacks do not see the
    Trainer): the values then go to ``state.log_history`` and ``callback.history``.
    The other arguments are those of :class:`SharpnessMonitor`.
    """

    def __init__(
        self,
        batches: Iterable,
        loss_fn: LossFunction | None = None,
        measures: Sequence[str] = ("adaptive", "geodesic-inv"),
        every_n_steps: int | None = None,
        at_evaluate: bool = True,
        rho: float | Mapping[str, float] | None = None,
        n_iters: int = 10,
        seed: int = 0,
        **options,
    ):
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps}")
        self.monitor = SharpnessMonitor(
            batches, loss_fn, measures, rho=rho, n_iters=n_iters, seed=seed, **options
        )
        self.every_n_steps, self.at_evaluate = every_n_steps, at_evaluate
        self.trainer = None

    @property
    def history(self) -> list[dict]:
        return self.monitor.history

    def attach(self, trainer) -> SharpnessCallback:
        """Register with ``trainer`` and log through ``trainer.log``."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def _measure(self, state, model) -> dict[str, float]:
        metrics = self.monitor(model, step=state.global_step)
        if self.trainer is not None:
            self.trainer.log(dict(metrics))
        else:
            state.log_history.append({**metrics, "step": state.global_step})
        return metrics

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._measure(state, model)
        return control

    def on_evaluate(self, args, state, control, model=None, metrics=None, **kwargs):
        if self.at_evaluate:
            values = self._measure(state, model)
            if metrics is not None:
                metrics.update(values)
        return control
