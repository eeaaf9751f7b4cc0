"""A sharded model whose owners compute on the measure's slices, gathered."""

from __future__ import annotations

import contextlib

from ..fsdp import ShardedGathered
from .base import Backend
from .loss_grad import LossGrad, Widened

__all__ = ["FsdpGathered"]


class FsdpGathered(Backend):
    """FSDP2 shards never written: each module that owns a perturbed parameter computes
    on it all-gathered from this process's slices of the point (in float32 beside
    half-precision shards), the rest through FSDP as for training
    (:class:`~geosharp.measures.fsdp.ShardedGathered`); the loss and its gradient are
    the mean over processes."""

    def __init__(self, gathered: ShardedGathered, target):
        super().__init__(gathered.evaluate, Widened(target.theta, target.dtype))
        self.gathered, self.half, self.point = gathered, gathered.half, gathered.point

    def trained(self, target) -> list[str]:
        return []  # the point's slices get the gradients, not the model's parameters

    @contextlib.contextmanager
    def active(self):
        try:
            yield
        finally:
            self.gathered.restore(None)

    def objective(self, layout, batch, autocast, mask):
        gathered = self.gathered
        return LossGrad(gathered, layout, batch, autocast, mean=gathered.mean)
