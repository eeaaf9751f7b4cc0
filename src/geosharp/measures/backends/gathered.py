"""A sharded model whose owners compute on the measure's slices, gathered."""

from __future__ import annotations

import contextlib

from ...params import UpCasts
from ..fsdp import ShardedGathered
from . import split as split_products
from .base import Backend
from .loss_grad import LossGrad, Widened
from .split import SplitLinears

__all__ = ["FsdpGathered"]


class FsdpGathered(Backend):
    """FSDP2 shards never written: each module that owns a perturbed parameter computes
    on it all-gathered from this process's slices of the point (in float32 beside
    half-precision shards, its products with perturbed matrices in half-precision parts
    where :func:`~geosharp.measures.backends.split.wanted` says so), the rest through
    FSDP as for training (:class:`~geosharp.measures.fsdp.ShardedGathered`); the loss
    and its gradient are the mean over processes."""

    def __init__(self, gathered: ShardedGathered, target):
        super().__init__(gathered.evaluate, Widened(target.theta, target.dtype))
        self.gathered, self.half, self.point = gathered, gathered.half, gathered.point
        gathered.products = _split_linears(gathered)
        self.split = gathered.products is not None

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


def _split_linears(gathered: ShardedGathered) -> SplitLinears | None:
    """The owners' products with their gathered half-precision matrices in parts, split
    around the point's own rounding (the model holds no whole weight); ``None`` for a
    model in its own precision, or where the device keeps them in float32."""
    half, held = gathered.half, dict(gathered.named)
    weights, matrix = {}, None
    for key, (_, attrs) in gathered.owners.items():
        names = {a: n for a, n in attrs if held[n].dim() == 2 and held[n].dtype == half}
        if names:
            weights[key] = dict.fromkeys(names)
            matrix = held[next(iter(names.values()))]
    if half is None or matrix is None or not split_products.wanted(matrix):
        return None
    return SplitLinears(weights, UpCasts())
