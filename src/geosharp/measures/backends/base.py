"""What a backend is: one way of running a model for a measure."""

from __future__ import annotations

import contextlib

from torch import Tensor

from ...layout import ParameterLayout
from .loss_grad import LossGrad

__all__ = ["Backend"]


class Backend:
    """The loss of the model at a point, and its gradient, one way of running it.

    ``evaluate(params, batch)``: the loss with ``params`` (``{name: tensor}``) swapped in;
    ``theta``: the base point as ``evaluate`` reads it. A backend also says what it
    records (``half``: the precision the rest of the model computes in, ``None`` where
    it is the model's own; ``split``: the perturbed matrices' products in its parts;
    ``point``: how the point reaches a sharded model), which
    parameters keep their gradients during the measure (:meth:`trained`), what holds
    while it measures (:meth:`active`), and its objective for Auto-PGD
    (:meth:`objective`)."""

    half = None
    point: str | None = None  # sharded backends: how the point reaches the model
    split = False  # the perturbed matrices' products in half-precision parts

    def __init__(self, evaluate, theta):
        self.evaluate, self.theta = evaluate, theta

    def trained(self, target) -> list[str]:
        """The parameters that keep ``requires_grad`` (the perturbed ones)."""
        return [n for n, _ in target.named]

    def active(self):
        """What holds while the measure runs (nothing here)."""
        return contextlib.nullcontext()

    def objective(self, layout: ParameterLayout, batch, autocast, mask: Tensor | None):
        """``(point, out) -> (loss, gradient written into out)`` on ``batch``."""
        return LossGrad(self.evaluate, layout, batch, autocast, mask)
