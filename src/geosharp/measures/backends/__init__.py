"""How a measure runs the model: one backend per way, chosen in one place.

==========================  ==================================================
backend                     when
==========================  ==================================================
:class:`WholeModel`         the model in its own dtypes (float32, float64, a
                            float32 router beside float64 weights)
:class:`Float32Owners`      a half-precision model: the modules that own
                            perturbed parameters in float32 (their products
                            with perturbed matrices in half-precision parts,
                            :mod:`.split`), the rest in its own precision
:class:`Float32Copies`      a half-precision model where that cannot apply (an
                            owner with submodules; autocast; the Hessian traces):
                            float32 copies of its weights
:class:`FsdpGathered`       FSDP2 shards, the owners computing on the point's
                            slices gathered (the shards never written)
:class:`FsdpShards`         FSDP2 shards written with each point (a float32 model
                            whose weight is read outside its module)
==========================  ==================================================

Each gives the loss at a point (``evaluate``, ``theta``) and its gradient
(``objective``), says what holds while it measures (``active``) and what the result
records (``half``, ``point``). :func:`choose_backend` is the only place that chooses;
:func:`~geosharp.measures.sharpness` (and through it ``block_sharpness``, the
monitor and the ``Trainer`` callback) and :func:`~geosharp.measures.hessian_trace`
call it. ``GeodesicSAM`` steps the model's own parameters in training and needs none.
"""

from __future__ import annotations

from ...errors import UsageError, warn_user
from ..fsdp import ShardedGathered, leaf_owners
from .base import Backend
from .copies import Float32Copies, float32_copies
from .gathered import FsdpGathered
from .loss_grad import LossGrad, Widened
from .owners import Float32Owners, MixedPrecision
from .shards import FsdpShards
from .whole import WholeModel

__all__ = [
    "Backend",
    "Float32Copies",
    "Float32Owners",
    "FsdpGathered",
    "FsdpShards",
    "LossGrad",
    "MixedPrecision",
    "WholeModel",
    "Widened",
    "choose_backend",
    "float32_copies",
]


def choose_backend(model, target, loss_fn, batch, autocast_dtype=None, owners=True) -> Backend:
    """The backend for ``target`` on ``model`` (see the module's table); ``batch`` is
    the one a sharded model's reads outside its owners are checked on; ``owners=False``
    keeps a half-precision model whole in float32 (a double backward)."""
    if target.shards is not None:
        return _sharded(model, target, loss_fn, batch)
    if not target.upcast:
        return WholeModel(model, loss_fn, target)
    plan = None
    if owners and autocast_dtype is None:
        plan = MixedPrecision.plan(model, target.halves, target.half)
    if plan is None:
        return Float32Copies(model, loss_fn, target)
    return Float32Owners(model, loss_fn, target, plan)


def _sharded(model, target, loss_fn, batch) -> Backend:
    """Gathered from the measure's slices where the owners of the perturbed parameters
    are leaf modules (in float32 beside half-precision shards) and the loss reads
    those parameters nowhere else (checked on ``batch``; a float32 model whose check
    cannot run is written into, a half-precision one measured with a warning), else
    written into its shards (refused for half-precision shards)."""
    if target.upcast or leaf_owners(model, target.named) is None:
        gathered = ShardedGathered(model, target.named, target.shards, loss_fn, target.half)
        if gathered.checkable:
            elsewhere = gathered.read_elsewhere(Widened(target.theta, target.dtype), batch)
            if elsewhere is None:
                return FsdpGathered(gathered, target)
            if target.upcast:
                raise UsageError(
                    f"{elsewhere} is read outside the forward of the module that holds it "
                    "(by a module above it, or by the loss), where a half-precision sharded "
                    "model cannot be given its float32 perturbation; compute with it through "
                    "its module, leave it out (parameters=...), or shard float32 parameters"
                )
        elif target.upcast:  # no other way to measure half-precision shards: said so
            warn_user(
                "this torch's FSDP2 keeps its parameter groups where geosharp cannot read "
                "them: a perturbed weight read outside its module's forward (a tied head "
                "written by hand) is not checked for, and would be read unperturbed"
            )
            gathered.point = "gathered, reads outside the owners not checked"
            return FsdpGathered(gathered, target)
    return FsdpShards(model, loss_fn, target)
