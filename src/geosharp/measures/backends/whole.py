"""The whole model in its own dtypes."""

from __future__ import annotations

from ...params import functional_loss
from .base import Backend
from .loss_grad import Widened

__all__ = ["WholeModel"]


class WholeModel(Backend):
    """The model as it is, the perturbed point swapped in; a parameter narrower than
    the perturbation (a float32 router beside float64 weights) is read in its own
    dtype, as its module computes."""

    def __init__(self, model, loss_fn, target):
        theta = target.theta
        if target.narrow:
            theta = Widened(theta, target.dtype, target.narrow)
        super().__init__(functional_loss(model, loss_fn, None, target.narrow), theta)
