"""Sharpness in a Hugging Face ``Trainer``: :class:`SharpnessCallback` measures it,
:class:`GeodesicSAMTrainer` trains against it (:class:`~geosharp.training.optim.GeodesicSAM`).

It measures chosen sharpness measures on fixed training batches every
``every_n_steps`` optimiser steps and/or at each evaluation, and logs them with the
Trainer's own metrics, so that they reach the loggers already configured
(TensorBoard, W&B, CSV, ...). The measuring is :class:`geosharp.training.monitor.SharpnessMonitor`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..errors import MissingDependencyError
from ..params import LossFunction
from .monitor import SharpnessMonitor

try:
    from transformers import Trainer, TrainerCallback
except ImportError:  # pragma: no cover - depends on the install
    raise MissingDependencyError(
        "SharpnessCallback needs transformers: pip install 'geosharp[hf]'"
    ) from None

__all__ = ["GeodesicSAMTrainer", "SharpnessCallback"]


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
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        self.monitor = SharpnessMonitor(
            batches, loss_fn, measures, rho=rho, n_iters=n_iters, seed=seed, **options
        )
        self.every_n_steps, self.at_evaluate = every_n_steps, at_evaluate
        self.trainer = None
        self._last: tuple[int, dict[str, float]] | None = None  # (step, metrics)

    @property
    def history(self) -> list[dict]:
        return self.monitor.history

    def attach(self, trainer) -> SharpnessCallback:
        """Register with ``trainer`` and log through ``trainer.log``."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def _measure(self, state, model) -> dict[str, float]:
        if self._last is not None and self._last[0] == state.global_step:
            return self._last[1]  # an evaluation on a measuring step: measured once
        metrics = self.monitor(model, step=state.global_step)
        self._last = (state.global_step, metrics)
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


class GeodesicSAMTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with :class:`~geosharp.training.optim.GeodesicSAM`.

    Use it as a ``Trainer``, with two more arguments::

        trainer = GeodesicSAMTrainer(model=model, args=args, train_dataset=train,
                                     sam_rho=0.05, sam_measure="geodesic-inv")
        trainer.train()

    The optimizer the Trainer would build (``args.optim``, learning rate, weight-decay
    groups, schedule) becomes the base optimizer; one given as ``optimizers=(opt,
    scheduler)`` may be a ``GeodesicSAM`` already. Each training step is two forward+
    backward passes: at ``w`` (the loss reported) and, after
    :meth:`~geosharp.training.optim.GeodesicSAM.first_step`, at the ascent point; the Trainer then
    clips that gradient (``max_grad_norm``) and calls ``optimizer.step()``, which goes
    back to ``w`` and takes the base step. Gradient accumulation is refused: the ascent
    needs the whole batch's gradient.
    """

    def __init__(self, *args, sam_rho: float = 0.05, sam_measure: str = "geodesic-inv", **kwargs):
        from ..errors import real_number
        from ..measures import measure_kwargs

        rho = real_number(sam_rho, "sam_rho")
        if not (rho >= 0 and rho < float("inf")):
            raise ValueError(f"sam_rho must be a finite number >= 0, got {sam_rho!r}")
        measure_kwargs(sam_measure)  # an unknown name fails here, not at train()
        super().__init__(*args, **kwargs)
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                "GeodesicSAMTrainer needs gradient_accumulation_steps=1 (the ascent point "
                "needs the whole batch's gradient): use a larger per-device batch instead"
            )
        self.sam_rho, self.sam_measure = rho, sam_measure

    def create_optimizer(self, model=None):
        from .optim import GeodesicSAM

        base = super().create_optimizer(model)
        if not isinstance(base, GeodesicSAM):
            self.optimizer = GeodesicSAM(
                self.model, base, rho=self.sam_rho, measure=self.sam_measure
            )
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        from .optim import GeodesicSAM

        sam = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        if not isinstance(sam, GeodesicSAM):
            raise TypeError(f"GeodesicSAMTrainer's optimizer is a {type(sam).__name__}")
        loss = super().training_step(model, inputs, num_items_in_batch)
        sam.first_step(zero_grad=True)
        try:
            super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            sam.restore()
            raise
        return loss
