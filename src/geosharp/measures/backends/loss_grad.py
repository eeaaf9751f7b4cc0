"""The loss and its gradient at a perturbed point, written into a buffer: what every
backend hands Auto-PGD (:class:`LossGrad`), and the base point read wider where a
backend evaluates in a wider dtype than the model holds (:class:`Widened`)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import Tensor

from ...layout import ParameterLayout
from ...params import checkpoint_errors, loss_value, require_grad, scalar_loss
from ..apgd import PointOverwritten

__all__ = ["LossGrad", "Widened"]


class LossGrad:
    """Loss and gradient at a perturbed point for Auto-PGD, without parameter-sized
    temporaries: views of the point are swapped into the model as leaves, and each
    leaf's gradient is copied into its view of the output buffer as soon as backward
    has accumulated it, then freed: the gradients of a training step, never held twice.

    ``out`` may be ``point`` itself: the point and the gradient then share one buffer.
    Each leaf (its own version counter over the point's memory) gets its gradient
    written over its values once backward has accumulated it, when no gradient needs
    them any more; a saved tensor read after that fails autograd's version check, and a
    second accumulation is refused, both as :class:`~geosharp.measures.apgd.PointOverwritten`,
    for the caller to evaluate again with separate buffers."""

    def __init__(self, evaluate, layout: ParameterLayout, batch, autocast, mask=None, mean=None):
        self.evaluate, self.layout = evaluate, layout
        self.batch, self.autocast, self.mask = batch, autocast, mask
        self.mean = mean  # the loss's mean over processes (a sharded model)

    def __call__(self, point: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
        leaves, targets, filled = {}, {}, set()
        in_place = out is point

        def hook(leaf: Tensor) -> None:
            if id(leaf) in filled:  # a second accumulation: add it
                if in_place:
                    raise PointOverwritten("a leaf accumulated twice")
                targets[id(leaf)].add_(leaf.grad)
            else:  # in place: through the leaf, whose version this advances
                (leaf.detach() if in_place else targets[id(leaf)]).copy_(leaf.grad)
            leaf.grad = None
            filled.add(id(leaf))

        for (name, view), target in zip(
            self.layout.unflatten(point).items(), self.layout.unflatten(out).values()
        ):
            leaf = _own_version(view) if in_place else view.detach()
            leaf.requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(hook)
            targets[id(leaf)] = target
            leaves[name] = leaf
        # forward and backward with the point swapped in: a backward through activation
        # checkpointing recomputes the forward, which must see the point too
        holding = getattr(self.evaluate, "holding", None)
        with holding(leaves) if holding is not None else contextlib.nullcontext():
            with checkpoint_errors() as checkpoints:
                with self.autocast():
                    if holding is not None:
                        loss = self.evaluate.loss(self.batch)
                    else:
                        loss = self.evaluate(leaves, self.batch)
                loss = scalar_loss(loss)
                require_grad(loss)
                with _overwritten(in_place):
                    loss.backward(inputs=list(leaves.values()))
        unreached = [name for name, leaf in leaves.items() if id(leaf) not in filled]
        checkpoints.refuse_unreached(unreached)
        for name in unreached:  # parameters the loss does not reach
            targets[id(leaves[name])].zero_()
        if self.mask is not None:  # the entries measured; the rest stay fixed
            out.mul_(self.mask)
        return (loss_value(loss) if self.mean is None else self.mean(loss)), out


def _own_version(view: Tensor) -> Tensor:
    """A tensor over ``view``'s memory with a version counter of its own (writing it
    advances no other view's)."""
    alias = torch.empty(0, dtype=view.dtype, device=view.device)
    return alias.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())


@contextlib.contextmanager
def _overwritten(in_place: bool):
    """Backward's version error for a point replaced by its gradient too early, as
    :class:`PointOverwritten`."""
    try:
        yield
    except RuntimeError as err:
        if in_place and "modified by an inplace operation" in str(err):
            raise PointOverwritten(str(err)) from err
        raise


class Widened(Mapping):
    """``{name: tensor}`` whose tensors are read in ``dtype`` on each access (the
    unperturbed point of a half-precision model, for a float32 forward: a copy only
    while it is used); those named in ``narrow`` in their own."""

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        dtype: torch.dtype,
        narrow: Mapping[str, torch.dtype] | None = None,
    ):
        self.tensors, self.dtype, self.narrow = tensors, dtype, dict(narrow or {})

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name].to(self.narrow.get(name, self.dtype))

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
