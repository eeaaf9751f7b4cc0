"""A sharded model measured with the point written into its shards."""

from __future__ import annotations

import contextlib

from ..fsdp import ShardedModel
from .base import Backend

__all__ = ["FsdpShards"]


class FsdpShards(Backend):
    """FSDP2 shards written with each point and restored at the end (a float32 model
    whose weight is read outside its module's forward, or whose parameter groups cannot
    be read): correct for any read, one flat copy of the base point more
    (:class:`~geosharp.measures.fsdp.ShardedModel`)."""

    point = ShardedModel.point

    def __init__(self, model, loss_fn, target):
        target.theta = target.local_flat()  # the base point, kept to write back
        sharded = ShardedModel(model, target.named, target.local, target.layout, loss_fn)
        super().__init__(sharded.evaluate, target.layout.unflatten(target.theta))
        self.sharded, self.base = sharded, target.theta

    @contextlib.contextmanager
    def active(self):
        try:
            yield
        finally:
            self.sharded.restore(self.base)

    def objective(self, layout, batch, autocast, mask):
        return self.sharded.loss_grad(batch, autocast)
