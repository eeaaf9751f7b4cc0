"""Safe functional evaluation of a user's model.

A perturbed point is a ``{name: tensor}`` dict (views of a flat vector, see
:mod:`geosharp.layout`), evaluated with :func:`torch.func.functional_call`, which
swaps the tensors in for one call and restores them, also on error: the model's own
tensors are never written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

__all__ = ["LossFunction", "evaluation_mode", "functional_loss", "require_grad", "scalar_loss"]

LossFunction = Callable[[nn.Module, object], Tensor]


class _LossModule(nn.Module):
    """Wraps ``loss_fn(model, batch)`` so that ``functional_call`` can swap parameters."""

    def __init__(self, model: nn.Module, loss_fn: LossFunction):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: object) -> Tensor:
        return self.loss_fn(self.model, batch)


def functional_loss(
    model: nn.Module, loss_fn: LossFunction, base: Mapping[str, Tensor] | None = None
) -> Callable[[Mapping[str, Tensor], object], Tensor]:
    """Return ``f(params, batch)``: the loss with ``params`` swapped into ``model``.

    ``params`` maps parameter names of ``model`` to tensors; parameters not named keep
    their values, or take the ones in ``base`` (parameters and buffers, e.g. float32
    copies). The model is left untouched, also when ``loss_fn`` raises.
    """
    wrapper = _LossModule(model, loss_fn)
    fixed = {f"model.{k}": v for k, v in (base or {}).items()}

    def evaluate(params: Mapping[str, Tensor], batch: object) -> Tensor:
        prefixed = {**fixed, **{f"model.{k}": v for k, v in params.items()}}
        return torch.func.functional_call(wrapper, prefixed, (batch,), strict=False)

    return evaluate


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode (dropout off, normalisation statistics frozen) and
    restore every submodule's ``training`` flag on exit, also on error."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def scalar_loss(loss: object) -> Tensor:
    """``loss`` as a 0-d tensor; an error unless ``loss_fn`` returned a one-element tensor."""
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError("loss_fn must return a scalar")
    return loss.reshape(())


def require_grad(loss: Tensor) -> None:
    """An error unless ``loss`` depends on the parameters (a backward can reach them)."""
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on the perturbed parameters (it does not require "
            "grad): compute it from the model's output inside loss_fn, without "
            "torch.no_grad(), .detach() or .item()"
        )
