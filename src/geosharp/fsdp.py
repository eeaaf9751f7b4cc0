"""Sharpness of a model sharded with FSDP2: :func:`shard` applies a sharding plan that
keeps every attention pair's rows whole on each process; :func:`geosharp.sharpness` on
the sharded model, called on every process under ``torchrun``, returns the value of the
unsharded model in one process. See :mod:`geosharp.measures.fsdp`."""

from .measures.fsdp import is_sharded, placements, shard, symmetries_of

__all__ = ["is_sharded", "placements", "shard", "symmetries_of"]
