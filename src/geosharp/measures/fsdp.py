"""Sharpness of a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Call :func:`geosharp.sharpness` on every process under ``torchrun`` with the sharded
model and the same batches: the value is the one a single process gets from the
unsharded model. Every vector of the measure (the point, the perturbation, its previous
and best iterates, the gradient) holds this process's slice of each parameter;
element-wise work is local, inner products and norms are all-reduced scalars, and the
attention pairs' ``h x h`` matrices are all-reduced sums over the rows each process
holds (:mod:`geosharp.geometry.sharded`). Every process takes the same Auto-PGD
decisions, and the model's shards are restored bit for bit at the end.

Any ``Shard(dim)`` plan is measured. The pair maths is cheapest with whole rows on
each process: query/key/value weights sharded along their input features (``Shard(1)``
of an ``nn.Linear`` weight), output weights along their output features
(``Shard(0)``); :func:`shard` applies such a plan. A row cut across processes (FSDP2's
default ``Shard(0)`` with more processes than heads cuts each query/key/value row of a
head) is kept by one process, its entries moved through an all-reduced buffer of the
cut rows at every read and write of the pair blocks (see
:mod:`geosharp.geometry.sharded`)::

    import geosharp
    from geosharp import distributed as gd, fsdp

    gd.init()
    symmetries = geosharp.find_symmetries(model, batch, loss_fn=loss_fn)  # before sharding
    fsdp.shard(model, symmetries)            # fully_shard on each layer, then the root
    result = geosharp.sharpness(model, batches, loss_fn, "geodesic-inv")
    del model
    gd.close()                               # see below

launched as ``OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 script.py``. Every process
runs the forward on the batch it is given: give all processes the same batches (the
one-process value), or each its own share of one batch, when the loss is a mean over
equal shares (FSDP averages the gradients and geosharp the losses).

Without ``symmetries`` (and not sharded by :func:`shard`), a sharded model's pairs are
found on its structure on the meta device and checked on the sharded model with the
first batch, each attention unit on its weights all-gathered, the verdicts agreed over
processes (:func:`sharded_symmetries`).

Random starts and directions are drawn block by block of ``2**20`` entries, each block
from its own seed, and each process draws the blocks its slices meet (the numbers of
a single process, without a whole vector anywhere).

Where every module that owns a perturbed parameter is a leaf (a ``Linear``, an
``Embedding``, a norm) and the loss reads those parameters nowhere else (checked at
set-up, :meth:`ShardedGathered.read_elsewhere`), the model's shards are never written:
each such module computes on its perturbed parameters all-gathered from the measure's
point (a layer's small parameters in one collective), the rest of the model runs
through FSDP (:class:`ShardedGathered`).
Half-precision (bfloat16/float16) shards are measured this way only: the measure's
vectors are float32 slices, and the owners compute in float32 on the float32 gathered
parameters. Other float32 models get the point written into their shards, and the base
point, kept as a flat copy, written back at the end (:class:`ShardedModel`).

Not available on a sharded model: ``entries=``, :func:`block_sharpness`,
``distributed=True`` (every process measures every batch), and the Hessian trace
(double backward through FSDP2 is not supported by torch).
:class:`geosharp.training.optim.GeodesicSAM` works on a sharded model of float32 parameters.
Under ``torchrun``, release the sharded model and call
:func:`geosharp.distributed.close` at the end: a process that exits while FSDP's
communication objects live can abort after its work is done.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed import all_reduce_max, all_reduce_sum
from ..errors import UsageError
from ..geometry.sharded import Shards
from ..layout import ParameterLayout
from ..params import (
    checkpoint_holders,
    computing_in_float32,
    evaluation_mode,
    frozen_except,
    loss_value,
    owning_modules,
    plain_copy,
    require_grad,
    scalar_loss,
)
from ..symmetry.pairs import Symmetries
from .apgd import PointOverwritten

__all__ = ["is_sharded", "placements", "shard"]

_SYMMETRIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded: FSDP2 modules, or ``DTensor`` parameters."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters FSDP2 keeps after a forward without backward (the
    root's, by default), so that the model holds its shards again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def symmetries_of(model: nn.Module) -> Symmetries | None:
    """The symmetries :func:`shard` recorded for ``model`` (``None`` if it did not)."""
    return _SYMMETRIES.get(model)


def meta_replica(model: nn.Module) -> nn.Module | None:
    """The unsharded structure of a sharded Hugging Face model, built from its config on
    the ``meta`` device (no memory, no weights), its parameters named as the sharded
    model's; ``None`` for a model geosharp cannot rebuild (no config, other names)."""
    from torch.distributed.fsdp import FSDPModule

    config = getattr(model, "config", None)
    cls = next((c for c in type(model).__mro__ if not issubclass(c, FSDPModule)), None)
    if config is None or cls is None or not hasattr(cls, "_from_config"):
        return None
    try:
        with torch.device("meta"):
            replica = cls._from_config(config)
    except Exception:  # a model whose class cannot be built from its config alone
        return None
    names = {n for n, _ in model.named_parameters()}
    return replica if {n for n, _ in replica.named_parameters()} == names else None


def sharded_symmetries(model: nn.Module, probe: tuple[object, Callable] | None) -> Symmetries:
    """The symmetries of a sharded model passed none, found without an unsharded copy:
    on its structure on the ``meta`` device (a Hugging Face model rebuilt from its
    config, :func:`meta_replica`; any other model traced on its
    :func:`structural_replica` with the batch of ``probe = (batch, loss_fn)`` on the
    meta device), then checked on the sharded model with that batch, the verdicts agreed
    over processes (:func:`~geosharp.symmetry.discovery.verify_symmetries`)."""
    from ..symmetry.discovery import find_symmetries, verify_symmetries

    batch, loss_fn = probe if probe is not None else (None, None)
    replica = meta_replica(model)
    if replica is not None:
        symmetries = find_symmetries(replica, warn=False)
    else:
        how = "no batch to trace it with"
        if batch is not None:
            how = "its forward does not run on the meta device"
            try:
                with warnings.catch_warnings():  # torch's, on shapes without values
                    warnings.simplefilter("ignore")
                    symmetries = find_symmetries(
                        structural_replica(model), _on_meta(batch), loss_fn=loss_fn, warn=False
                    )
                cause = symmetries.trace_error
            except Exception as e:  # a loss that needs values (e.g. through NumPy)
                symmetries, cause = None, f"{type(e).__name__}: {e}".splitlines()[0]
            if symmetries is not None and symmetries.discovery == "trace":
                how = None
            elif cause:  # the trace's own reason
                how += f" ({cause})"
        if how is not None:
            raise UsageError(
                f"the symmetries of this sharded model cannot be found on its structure "
                f"({how}): pass symmetries=geosharp.find_symmetries(model, "
                "batch, loss_fn=...) found before sharding, or shard it with "
                "geosharp.fsdp.shard(model, symmetries)"
            )
    if batch is not None:
        symmetries = verify_symmetries(
            model, symmetries, batch, loss_fn=loss_fn, agree=all_reduce_max()
        )
        reshard(model)  # the root keeps its parameters gathered after a forward
    return symmetries


def _on_meta(batch: object) -> object:
    """``batch`` with its tensors on the meta device (shapes and dtypes only)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to("meta") if isinstance(x, Tensor) else x, batch)


def structural_replica(model: nn.Module) -> nn.Module:
    """The unsharded structure of any sharded model on the ``meta`` device, for tracing
    (:func:`~geosharp.params.plain_copy`): each module of its own class, meta parameters
    of the global shapes (a tied weight stays one), the user's hooks but not FSDP's. Its
    forward computes shapes, never values."""
    return plain_copy(model, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))


def placements(model: nn.Module, symmetries: Symmetries) -> dict[str, int]:
    """``{parameter name: dim}``: the dimension to shard each pair parameter along so
    that every row of its blocks stays on one process (other parameters: any).

    A row of a block is the entries of one input (query/key/value) or output feature;
    its ``h`` entries (and its heads) must run along the other dimensions."""
    shapes = {n: p.shape for n, p in model.named_parameters()}
    dims: dict[str, int] = {}
    for pair in symmetries.pairs:
        for block in (*pair.g_blocks, *pair.h_blocks):
            shape = shapes[block.param]
            if len(shape) < 2:
                continue
            index = block.index
            rows = index[0, :, 0] if index.shape[1] > 1 else None
            if rows is None:
                continue
            strides = torch.empty(shape, device="meta").stride()
            step = int(rows[1] - rows[0])
            dim = next((d for d, s in enumerate(strides) if s == abs(step)), None)
            if dim is None or dims.get(block.param, dim) != dim:
                raise UsageError(
                    f"{block.param}: its pair rows do not run along one dimension; shard it "
                    "by hand so that each row of its blocks stays on one process"
                )
            dims[block.param] = dim
    return dims


def shard(
    model: nn.Module,
    symmetries: Symmetries,
    modules: list[nn.Module] | None = None,
    **kwargs,
) -> nn.Module:
    """``fully_shard`` ``modules`` (default: each block of the model's longest
    ``nn.ModuleList``, the transformer layers) and then ``model``, with every pair
    weight sharded along the dimension of its rows (:func:`placements`); returns the
    model (sharded in place, as ``fully_shard`` does). ``kwargs`` go to
    ``fully_shard`` (``mesh``, ``mp_policy``, ...). The symmetries are recorded, so
    that :func:`geosharp.sharpness` needs none on the sharded model.

    Raises :class:`~geosharp.errors.UsageError` when a pair dimension other than the
    first does not divide by the number of processes (FSDP2 shards other dimensions
    evenly only)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    dims = placements(model, symmetries)
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_id = {}
    for name, p in model.named_parameters():
        dim = dims.get(name, 0)
        if dim and p.shape[dim] % world:
            raise UsageError(
                f"{name} {tuple(p.shape)} must be sharded along dimension {dim} (the rows of "
                f"its attention blocks), whose {p.shape[dim]} entries do not divide by the "
                f"{world} processes: use a number of processes that divides it"
            )
        by_id[id(p)] = dim

    def placement(param: nn.Parameter):
        return Shard(by_id.get(id(param), 0))

    if modules is None:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        modules = list(max(lists, key=len)) if lists else []
    for module in modules:
        fully_shard(module, shard_placement_fn=placement, **kwargs)
    fully_shard(model, shard_placement_fn=placement, **kwargs)
    _SYMMETRIES[model] = symmetries
    return model


def local_shards(named: list[tuple[str, Tensor]]) -> tuple[Shards, list[Tensor]]:
    """Where this process's slices of the ``DTensor`` parameters ``named`` lie, and the
    slices themselves (the model's own local tensors)."""
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    dims, locals_, global_named, local_named = {}, [], [], []
    for name, p in named:
        if not isinstance(p, DTensor):
            raise UsageError(
                f"{name} is not sharded while other parameters are: shard every perturbed "
                "parameter with fully_shard (or measure the parameters that are)"
            )
        if p.device_mesh.ndim != 1 or len(p.placements) != 1:
            raise UsageError(
                f"{name} is sharded on a {p.device_mesh.ndim}-D mesh: geosharp measures "
                "models sharded on one dimension of processes (FSDP2), not HSDP or tensor "
                "parallel layouts"
            )
        placement = p.placements[0]
        if not isinstance(placement, Shard):
            raise UsageError(f"{name} is {placement}, not sharded: use FSDP2's Shard(dim)")
        if p.device_mesh.size() != world:
            raise UsageError(f"{name} is sharded over a mesh that is not the whole world")
        local = p.to_local()
        dim, size = placement.dim, p.shape[placement.dim]
        chunk = -(-size // world)
        start = min(rank * chunk, size)
        length = max(0, min(size - start, chunk))
        if tuple(local.shape) != (*tuple(p.shape[:dim]), length, *tuple(p.shape[dim + 1 :])):
            raise UsageError(f"{name}: its local shard {tuple(local.shape)} is not FSDP2's")
        dims[name] = (dim, start, length)
        locals_.append(local)
        global_named.append((name, p))
        local_named.append((name, local))

    shards = Shards(
        ParameterLayout.from_named(global_named),
        ParameterLayout.from_named(local_named),
        dims,
        all_reduce_sum(),
        all_reduce_max(),
        rank,
    )
    return shards, locals_


class ShardedModel:
    """The loss of a sharded model at a point: the point's slices are written into the
    model's own local shards (``theta``, a copy, is written back by :meth:`restore`),
    the forward and backward run through FSDP, the loss is averaged over processes."""

    point = "written into the shards"  # how the point reaches the model (``settings``)

    def __init__(self, model: nn.Module, named, locals_: list[Tensor], layout, loss_fn):
        self.model, self.layout, self.loss_fn = model, layout, loss_fn
        self.params = [p for _, p in named]
        self.locals = locals_
        self.grads = [p.grad for p in model.parameters()]
        self.world = dist.get_world_size()

    def _write(self, views: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for local, view in zip(self.locals, views.values()):
                local.copy_(view.view_as(local))

    def _mean(self, loss: Tensor) -> Tensor:
        return _mean(loss, self.world)

    def evaluate(self, params: dict[str, Tensor], batch) -> Tensor:
        """The loss at ``params`` (local views), averaged over processes."""
        self._write(params)
        with torch.no_grad():
            loss = self.loss_fn(self.model, batch)
        reshard(self.model)
        return self._mean(loss)

    def loss_grad(self, batch, autocast) -> Callable:
        """``objective(point, out)`` for Auto-PGD: the averaged loss at ``point``, its
        gradient's local slices written into ``out`` (FSDP averages the gradients over
        processes); every gradient the backward made is freed."""
        layout = self.layout

        def objective(point: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
            self._write(layout.unflatten(point))
            for p in self.model.parameters():
                p.grad = None
            with autocast():
                loss = scalar_loss(self.loss_fn(self.model, batch))
            require_grad(loss)
            loss.backward()
            for p, target in zip(self.params, layout.unflatten(out).values()):
                if p.grad is None:
                    target.zero_()
                else:
                    target.copy_(p.grad.to_local().view_as(target))
            for p in self.model.parameters():  # also those of parameters not perturbed
                p.grad = None
            return self._mean(loss), out

        return objective

    def restore(self, theta: Tensor) -> None:
        """Write ``theta`` back into the model's shards and restore its gradients."""
        self._write(self.layout.unflatten(theta))
        for p, g in zip(self.model.parameters(), self.grads):
            p.grad = g


class _Slice:
    """How one parameter of ``shape`` is cut: ``Shard(dim)`` into chunks of ``chunk``
    rows over ``world`` processes (the last ones may hold fewer, or none); in a
    collective's buffer each process's rows take ``chunk`` rows (``numel`` entries),
    padded with zeros."""

    def __init__(self, dim: int, shape: tuple[int, ...], world: int):
        self.dim, self.size, self.world = dim, shape[dim], world
        self.chunk = -(-self.size // world)
        self.rest = tuple(shape[:dim]) + tuple(shape[dim + 1 :])
        self.numel = self.chunk * math.prod(self.rest)
        self.shape = tuple(shape)
        self.lengths = [max(0, min(self.size - r * self.chunk, self.chunk)) for r in range(world)]

    def gather(self, local: Tensor) -> Tensor:
        """The whole parameter from every process's ``local`` slice (a collective),
        contiguous as the model's own (so that it computes with the same kernels), in
        memory of its own."""
        rows = local.movedim(self.dim, 0)
        if rows.shape[0] < self.chunk:  # FSDP2's uneven Shard(0): padded here
            padded = rows.new_zeros((self.chunk, *rows.shape[1:]))
            padded.narrow(0, 0, rows.shape[0]).copy_(rows)
            rows = padded
        whole = rows.new_empty((self.world * self.chunk, *rows.shape[1:]))
        dist.all_gather_single(whole, rows.contiguous())
        out = whole.narrow(0, 0, self.size)
        return out if self.dim == 0 else out.movedim(0, self.dim).contiguous()

    def scatter(self, grad: Tensor, length: int) -> Tensor:
        """This process's ``length`` rows of the mean over processes of ``grad`` (a
        collective: FSDP's reduce-scatter)."""
        rows = grad.movedim(self.dim, 0)
        if self.size == self.world * self.chunk:  # an even cut: nothing to pad
            padded = rows.contiguous()
        else:
            padded = rows.new_zeros((self.world * self.chunk, *rows.shape[1:]))
            padded.narrow(0, 0, self.size).copy_(rows)
        mine = rows.new_empty((self.chunk, *rows.shape[1:]))
        dist.reduce_scatter_single(mine, padded)
        return mine.narrow(0, 0, length).div_(self.world).movedim(0, self.dim)

    def padded(self, part: Tensor) -> Tensor:
        """``part`` (``world x numel``, one process's entries per row) as ``world x chunk
        x rest``."""
        return part.view(self.world, self.chunk, *self.rest)

    def to_rows(self, padded: Tensor, rows: Tensor) -> None:
        """Copy every process's rows of ``padded`` into ``rows`` (``size x rest``)."""
        if self.world * self.chunk == self.size:
            rows.unflatten(0, (self.world, self.chunk)).copy_(padded)
            return
        for r, n in enumerate(self.lengths):
            if n:
                rows.narrow(0, r * self.chunk, n).copy_(padded[r, :n])

    def to_padded(self, rows: Tensor, padded: Tensor) -> None:
        """Copy ``rows`` (``size x rest``) into every process's rows of ``padded``, the
        padding zero."""
        if self.world * self.chunk == self.size:
            padded.copy_(rows.unflatten(0, (self.world, self.chunk)))
            return
        for r, n in enumerate(self.lengths):
            if n:
                padded[r, :n].copy_(rows.narrow(0, r * self.chunk, n))
            padded[r, n:].zero_()


def _gather(locals_: list[Tensor], cuts: list[_Slice]) -> list[Tensor]:
    """The whole parameters from every process's slices ``locals_``, in one all-gather,
    each contiguous as the model's own (so that it computes with the same kernels); one
    parameter without a shared buffer."""
    if len(cuts) == 1:
        return [cuts[0].gather(locals_[0])]
    total = sum(cut.numel for cut in cuts)
    every = locals_[0].new_empty(cuts[0].world * total)
    dist.all_gather_single(every, _packed(locals_, cuts, total))  # freed before the copies
    every = every.view(cuts[0].world, total)
    out = []
    for part, cut in zip(every.split([c.numel for c in cuts], dim=1), cuts):
        whole = every.new_empty(cut.shape)
        cut.to_rows(cut.padded(part), whole.movedim(cut.dim, 0))
        out.append(whole)
    return out


def _packed(locals_: list[Tensor], cuts: list[_Slice], total: int) -> Tensor:
    """This process's rows of each parameter, padded to its chunk, in one buffer."""
    mine = locals_[0].new_empty(total)
    for part, local, cut in zip(mine.split([c.numel for c in cuts]), locals_, cuts):
        rows, held = part.view(cut.chunk, *cut.rest), local.movedim(cut.dim, 0)
        rows[: held.shape[0]].copy_(held)
        rows[held.shape[0] :].zero_()  # an uneven cut's padding
    return mine


def _scatter(grads: tuple[Tensor, ...], cuts: list[_Slice], lengths: list[int]) -> list[Tensor]:
    """This process's ``lengths`` rows of the mean over processes of each of ``grads``, in
    one reduce-scatter (FSDP's); one parameter without a shared buffer."""
    if len(cuts) == 1:
        return [cuts[0].scatter(grads[0], lengths[0])]
    sizes = [cut.numel for cut in cuts]
    mine = grads[0].new_empty(sum(sizes))
    dist.reduce_scatter_single(mine, _spread(grads, cuts, sum(sizes)))
    mine.div_(cuts[0].world)
    return [
        part.view(cut.chunk, *cut.rest).narrow(0, 0, n).movedim(0, cut.dim)
        for part, cut, n in zip(mine.split(sizes), cuts, lengths)
    ]


def _spread(grads: tuple[Tensor, ...], cuts: list[_Slice], total: int) -> Tensor:
    """Each of ``grads`` cut into every process's rows, padded, in one buffer
    (``world x total``: process by process)."""
    every = grads[0].new_empty(cuts[0].world * total)
    for part, grad, cut in zip(
        every.view(cuts[0].world, total).split([c.numel for c in cuts], dim=1), grads, cuts
    ):
        cut.to_padded(grad.movedim(cut.dim, 0), cut.padded(part))
    return every


class _Gathering:
    """One all-gather of a group of perturbed parameters (consecutive owners in one
    FSDP2 module, :func:`buckets`) in a forward: the whole parameters (``wholes``, held
    until every owner of the group has computed, ``pending``), and what backward needs
    to gather again the ones autograd saved: all of them in one all-gather at the first
    read, each freed after its last."""

    def __init__(self, leaves: dict[str, Tensor], cuts: Mapping[str, _Slice], owners: list[int]):
        self.leaves, self.pending = leaves, set(owners)  # ids of the owners yet to compute
        self.cuts = {n: cuts[n] for n in leaves}
        self.saved: dict[str, list[int]] = {}  # {name: [its leaf's version, reads left]}
        self.again: dict[str, Tensor] | None = None
        self.grad = torch.is_grad_enabled()
        wholes = _Gathered.apply(self, *leaves.values())  # a collective
        self.wholes = dict(zip(leaves, wholes))
        self.storages = {w.untyped_storage().data_ptr(): n for n, w in self.wholes.items()}

    def drop(self) -> None:
        """Free the whole parameters (autograd's graph keeps this object)."""
        self.wholes, self.storages = {}, {}

    def pack(self, t: Tensor) -> object:
        """What autograd saves of ``t``: a view of a whole parameter as :class:`_Again`."""
        if t.device.type == "meta" or not t.untyped_storage().nbytes():
            return t
        name = self.storages.get(t.untyped_storage().data_ptr())
        if name is None:
            return t
        self.saved.setdefault(name, [self.leaves[name]._version, 0])[1] += 1
        return _Again(self, name, t)

    def whole_again(self, name: str) -> Tensor:
        """The whole parameter ``name`` for backward: at the first read the group's saved
        parameters gathered again (one collective), each freed after its last read."""
        version, left = self.saved[name]
        if self.leaves[name]._version != version:  # its gradient was written over it
            raise PointOverwritten("a weight gathered again after its point was overwritten")
        if self.again is None or name not in self.again:
            names = [n for n, (_, k) in self.saved.items() if k > 0 or n == name]
            leaves = [self.leaves[n].detach() for n in names]
            cuts = [self.cuts[n] for n in names]
            self.again = dict(zip(names, _gather(leaves, cuts)))
        whole = self.again[name]
        self.saved[name][1] = left - 1
        if left == 1:  # read for the last time (autograd reads each saved tensor once)
            del self.again[name]
        return whole


class _Gathered(torch.autograd.Function):
    """``locals -> wholes``: the all-gather of a group's slices; backward: their
    gradients' means over processes, reduce-scattered (the gradients of this process's
    slices), after which the group's weights gathered again for backward are freed."""

    @staticmethod
    def forward(ctx, gathering: _Gathering, *locals_: Tensor) -> tuple[Tensor, ...]:
        cuts = list(gathering.cuts.values())
        ctx.gathering, ctx.lengths = gathering, [t.shape[c.dim] for t, c in zip(locals_, cuts)]
        return tuple(_gather(list(locals_), cuts))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        gathering = ctx.gathering
        gathering.again = None
        return (None, *_scatter(grads, list(gathering.cuts.values()), ctx.lengths))


class _Again:
    """A saved view of a gathered weight, kept as how to gather it again."""

    __slots__ = ("gathering", "name", "offset", "size", "stride")

    def __init__(self, gathering: _Gathering, name: str, view: Tensor):
        self.gathering, self.name = gathering, name
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def unpack(self) -> Tensor:
        whole = self.gathering.whole_again(self.name)
        return whole.as_strided(self.size, self.stride, self.offset)


def leaf_owners(model: nn.Module, named) -> str | None:
    """The first name under which a parameter of ``named`` belongs to a module that has
    submodules (``None``: every owner is a leaf, and :class:`ShardedGathered` applies)."""
    return _non_leaf(owning_modules(model, named))


def _non_leaf(owners: dict[str, tuple[nn.Module, list[tuple[str, str]]]]) -> str | None:
    """:func:`leaf_owners` of :func:`~geosharp.params.owning_modules`' answer."""
    for owner, (module, attrs) in owners.items():
        if next(module.children(), None) is not None:
            return f"{owner}.{attrs[0][0]}" if owner else attrs[0][0]
    return None


class ShardedGathered:
    """The loss of a sharded model at a point that stays in the measure's own slices
    (the model's shards are never written): each module that owns a perturbed
    parameter computes on that parameter all-gathered from the point, the rest of the
    model on its own shards through FSDP. The perturbed parameters of consecutive
    owners in one FSDP2 module below the root (a layer) are gathered in one collective,
    up to :data:`BUCKET` entries (:func:`buckets`; an owner outside such modules gathers
    its own), when the first of them computes, and freed when all have. As FSDP does
    for its own parameters, they are not kept from the forward to the backward: what
    autograd saved of them is gathered again there (one collective per group, each
    freed after its last read), and their gradients are reduce-scattered to the slices
    (one collective per group, the mean over processes). Possible where every owner is
    a leaf module (a ``Linear``, an ``Embedding``, a norm: :func:`leaf_owners`).

    A half-precision model (``half``) is measured with float32 only where the
    perturbation lives: the point's slices are float32, and the owners compute in
    float32 (their other weights and their inputs cast up, their outputs cast back);
    ``products``, if set (a backend's
    :class:`~geosharp.measures.backends.split.SplitLinears`), takes their products with
    the gathered points in half-precision parts.

    An FSDP2 module whose parameters are all perturbed never reads FSDP's own gathered
    copies of them: inside :meth:`holding` FSDP does not gather them, neither for the
    forward nor for the backward (its parameter group's ``unshard`` is a no-op there,
    and its ``unshard_in_backward`` off, both restored on leaving), which a training
    step would."""

    point = "gathered"  # how the point reaches the model (``settings``)
    products = None  # the owners' products with the gathered points, if split

    def __init__(self, model: nn.Module, named, shards: Shards, loss_fn, half=None):
        self.model, self.loss_fn, self.half = model, loss_fn, half
        self.named = list(named)
        self.world = dist.get_world_size()
        found = owning_modules(model, named)
        outside = _non_leaf(found)
        if outside is not None:
            owner = outside.rpartition(".")[0] or "the model"
            raise UsageError(
                f"{outside}: a half-precision sharded model is measured with float32 "
                f"perturbations in the modules that own them, and {owner} has submodules; "
                "perturb the parameters of leaf modules (Linear, Embedding, norms), or "
                "shard float32 parameters"
            )
        # each module once, each of its perturbed attributes once (a module registered
        # under two names is swapped in and back once)
        self.owners: dict[int, tuple[nn.Module, list[tuple[str, str]]]] = {}
        for module, attrs in found.values():
            kept = self.owners.setdefault(id(module), (module, []))[1]
            kept.extend(a for a in attrs if a not in kept)
        g = shards.global_layout
        self.cuts = {
            n: _Slice(shards.dims[n][0], tuple(shape), self.world)
            for n, shape in zip(g.names, g.shapes)
        }
        sizes = {n: math.prod(s) for n, s in zip(g.names, g.shapes)}
        self.groups = {i: group for group in _groups(model, found, sizes) for i in group[0]}
        self.shapes = dict(zip(shards.local.names, shards.local.shapes))
        self.unread = _groups_within(model, {id(p) for _, p in named})

    def mean(self, loss: Tensor) -> Tensor:
        return _mean(loss, self.world)

    @contextlib.contextmanager
    def holding(self, tensors: Mapping[str, Tensor], as_training: bool = False):
        """Inside, the owners compute on ``tensors`` (``{name: local slice}``, read on
        each forward) all-gathered (in float32 for a half-precision model); FSDP gathers
        only what the owners do not replace (``as_training``: every layer, as for a
        training step)."""
        half, open_, products = self.half, [], self.products
        live: dict[int, _Gathering] = {}  # {id(a group's owners): its gathering}

        def before(module) -> None:
            owners, names = self.groups[id(module)]
            group = live.get(id(owners))
            if (
                group is None
                or id(module) not in group.pending  # an owner computing again
                or group.grad != torch.is_grad_enabled()  # an owner computed without grad
            ):
                if group is not None:
                    group.drop()
                group = live[id(owners)] = _Gathering(
                    {n: tensors[n].view(self.shapes[n]) for n in names}, self.cuts, owners
                )
            saved = {}
            for attr, name in self.owners[id(module)][1]:
                saved[attr] = module._parameters[attr]
                module._parameters[attr] = group.wholes[name]
            for table in (module._parameters, module._buffers):
                for attr, t in table.items():
                    if attr not in saved and isinstance(t, Tensor) and t.dtype == half:
                        saved[attr] = t
                        table[attr] = t.float()
            hooks = torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack)
            hooks.__enter__()
            open_.append((module, saved, hooks))
            if products is not None:
                products.before(module)

        def after(module) -> None:
            if products is not None:
                products.after(module)
            _close(open_.pop())
            owners = self.groups[id(module)][0]
            group = live.get(id(owners))
            if group is not None:
                group.pending.discard(id(module))
                if not group.pending:  # every owner of the group has computed
                    live.pop(id(owners)).drop()

        owners = [module for module, _ in self.owners.values()]
        unread = [] if as_training else self.unread
        was = [group.unshard_in_backward for group in unread]
        try:
            for group in unread:
                group.unshard_in_backward = False
                group.unshard = _no_gather  # shadows the method for this group only
            copies = None if products is None else products.copies
            with computing_in_float32(owners, half, before, after, copies):
                yield
        finally:
            while open_:  # a forward that raised
                _close(open_.pop())
            for gathering in live.values():
                gathering.drop()
            for group, flag in zip(unread, was):
                group.unshard_in_backward = flag
                group.__dict__.pop("unshard", None)

    def loss(self, batch) -> Tensor:
        return self.loss_fn(self.model, batch)

    @property
    def checkable(self) -> bool:
        """Whether :meth:`read_elsewhere` can see FSDP2's gathered copies (it reads
        FSDP2's parameter groups, private to FSDP2)."""
        return bool(_param_groups(self.model))

    def read_elsewhere(self, base: Mapping[str, Tensor], batch) -> str | None:
        """A perturbed parameter that the loss reads outside the forward of the modules
        that hold it (a module above them computing with its weight, or the loss), where
        the model's own weight is read instead of the perturbed one; ``None`` if there is
        none. Found on one forward at ``base`` (local slices that do not require grad,
        read as :meth:`holding` reads a point), FSDP gathering every layer as for
        training: the owners compute on gathers of ``base``, so where the loss's
        autograd graph reaches the model's own tensor for a perturbed parameter (its
        shard, or FSDP's gathered copy), it was read elsewhere. A read that autograd does
        not see (under ``no_grad``, through ``.detach()``) is not found. The model is
        left as it was."""
        with evaluation_mode(self.model), frozen_except(self.model, [n for n, _ in self.named]):
            # Hugging Face's checkpointing as the measure keeps it (unverified here: only
            # which tensors the graph reaches counts); a reentrant one would hide them
            for module in checkpoint_holders(self.model) or []:
                module.training = True
            try:
                with self.holding(base, as_training=True):
                    loss = scalar_loss(self.loss(batch))
                reached = _leaves(loss)
                del loss  # the graph, and FSDP's hooks in it, never run
            finally:
                reshard(self.model)
        stand_ins = _stand_ins(self.model, self.named)
        found = {stand_ins[i] for i in reached if i in stand_ins}
        index = next((i for i, (n, _) in enumerate(self.named) if n in found), -1)
        index = int(all_reduce_max()(torch.tensor(float(index))))  # one verdict everywhere
        return None if index < 0 else self.named[index][0]

    def evaluate(self, params: Mapping[str, Tensor], batch) -> Tensor:
        """The loss at ``params`` (local float32 slices), averaged over processes."""
        with torch.no_grad(), self.holding(params):
            loss = self.loss_fn(self.model, batch)
        reshard(self.model)
        return self.mean(loss)

    def restore(self, theta) -> None:
        """Nothing to restore: the model's shards are never written."""
        reshard(self.model)


BUCKET = 1 << 22
"""Entries that owners of one FSDP2 module gather in one collective at most: parameters
smaller than this share a collective (whose fixed cost, a round trip, weighs on small
ones), larger ones are gathered alone, into their own memory (no copies through a
shared buffer)."""


def _groups(model: nn.Module, owners: dict, sizes: Mapping[str, int]) -> list[tuple]:
    """``[(ids of owners, names)]``: the perturbed parameters gathered in one collective
    when the first of those owners computes: those of consecutive owners within one
    FSDP2 module below the root (a layer, which FSDP2 gathers at once), :func:`buckets`
    of at most :data:`BUCKET` entries (``sizes``); an owner elsewhere gathers its own."""
    from torch.distributed.fsdp import FSDPModule

    units = [n for n, m in model.named_modules() if n and isinstance(m, FSDPModule)]
    by_unit: dict[str, dict[int, list[str]]] = {}
    unit_of: dict[int, str] = {}
    for owner, (module, attrs) in owners.items():
        if id(module) not in unit_of:  # a module under two names: in its first's group
            within = [u for u in units if owner == u or owner.startswith(u + ".")]
            unit_of[id(module)] = max(within, key=len) if within else f"\0{owner}"
        names = by_unit.setdefault(unit_of[id(module)], {}).setdefault(id(module), [])
        names.extend(n for _, n in attrs if n not in names)
    return [
        group
        for members in by_unit.values()
        for group in buckets(list(members.items()), sizes, BUCKET)
    ]


def buckets(members: list, sizes: Mapping[str, int], cap: int) -> list[tuple[list, tuple]]:
    """``members`` (``[(owner, names)]``, in order) cut into runs whose parameters
    number at most ``cap`` entries together: ``[(owners, names)]``. An owner larger than
    ``cap`` is a run of its own; one that shares a parameter with the open run joins it.

    >>> sizes = {"a": 3, "b": 1, "c": 4, "d": 9}
    >>> members = [(0, ["a", "b"]), (1, ["c"]), (2, ["d"]), (3, ["b"])]
    >>> buckets(members, sizes, cap=8)
    [([0, 1], ('a', 'b', 'c')), ([2], ('d',)), ([3], ('b',))]
    """
    runs: list[tuple[list, list]] = []
    count = 0
    for owner, names in members:
        new = [n for n in names if not runs or n not in runs[-1][1]]
        size = sum(sizes[n] for n in new)
        if not runs or (count + size > cap and len(new) == len(names)):
            runs.append(([], []))
            new, size, count = list(names), sum(sizes[n] for n in names), 0
        runs[-1][0].append(owner)
        runs[-1][1].extend(new)
        count += size
    return [(owners, tuple(names)) for owners, names in runs]


def _unpack(x: object) -> Tensor:
    return x.unpack() if isinstance(x, _Again) else x


def _param_groups(model: nn.Module) -> list:
    """FSDP2's parameter groups of ``model`` (private to FSDP2: ``[]`` where this
    torch's FSDP2 keeps them otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    try:
        return [
            group
            for module in model.modules()
            if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups
        ]
    except AttributeError:
        return []


def _groups_within(model: nn.Module, ids: set[int]) -> list:
    """FSDP2's parameter groups of ``model`` whose parameters all have their ``id`` in
    ``ids`` (none where this torch's FSDP2 keeps its groups otherwise: its gathers are
    then left as they are, which costs memory only)."""
    return [
        group
        for group in _param_groups(model)
        if isinstance(getattr(group, "unshard_in_backward", None), bool)
        and callable(getattr(group, "unshard", None))
        and all(id(getattr(fp, "sharded_param", None)) in ids for fp in group.fsdp_params)
    ]


def _stand_ins(model: nn.Module, named) -> dict[int, str]:
    """``{id: name}`` of the tensors that stand for each parameter of ``named`` in the
    model: the parameter (its shard) and FSDP2's gathered copy of it, once made."""
    out = {id(p): n for n, p in named}
    for group in _param_groups(model):
        for fp in group.fsdp_params:
            name = out.get(id(getattr(fp, "sharded_param", None)))
            gathered = getattr(fp, "_unsharded_param", None)
            if name is not None and gathered is not None:
                out[id(gathered)] = name
    return out


def _leaves(loss: Tensor) -> set[int]:
    """The ``id`` of every leaf tensor that ``loss``'s autograd graph reaches."""
    out: set[int] = set()
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if variable is not None:
            out.add(id(variable))
        stack.extend(f for f, _ in node.next_functions)
    return out


def _no_gather(async_op: bool = False) -> None:
    """A parameter group's ``unshard`` while none of its gathered parameters is read: its
    modules stay on their shards, and FSDP's ``wait_for_unshard`` finds nothing to wait
    for (no all-gather result)."""


def _mean(loss: Tensor, world: int) -> Tensor:
    """A process's loss averaged over the ``world`` processes (float32 if half)."""
    return all_reduce_sum()(loss_value(loss).reshape(())) / world


def _close(entry) -> None:
    module, saved, hooks = entry
    hooks.__exit__(None, None, None)
    for attr, t in saved.items():
        table = module._parameters if attr in module._parameters else module._buffers
        table[attr] = t


def check_shardable(entries, distributed: bool) -> None:
    """One-line errors for what a sharded model cannot be measured with."""
    if entries is not None:
        raise UsageError("entries= is not available on a sharded model")
    if distributed:
        raise UsageError(
            "distributed=True splits batches over processes; a sharded model is measured "
            "by every process on every batch: drop distributed=True"
        )
