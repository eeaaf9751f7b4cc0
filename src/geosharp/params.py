"""Parameters as one flat vector, and safe functional evaluation of a user's model.

Every measure works on a *flat* copy ``theta`` of the parameters it perturbs; the
model's own tensors are never written. A perturbed point is turned back into a
``{name: tensor}`` dict of views and evaluated with :func:`torch.func.functional_call`,
which swaps the tensors in for one call and restores them, also on error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["LossFunction", "ParameterLayout", "evaluation_mode", "functional_loss"]

LossFunction = Callable[[nn.Module, object], Tensor]


@dataclass(frozen=True)
class ParameterLayout:
    """Names, shapes and offsets of the parameters packed into one flat vector."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def from_named(cls, named: Iterable[tuple[str, Tensor]]) -> ParameterLayout:
        names, shapes, offsets, total = [], [], [], 0
        for name, tensor in named:
            names.append(name)
            shapes.append(tensor.shape)
            offsets.append(total)
            total += tensor.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), total)

    def offset(self, name: str) -> int:
        return self.offsets[self.names.index(name)]

    def flatten(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Concatenate ``tensors[name]`` for every name of the layout (a copy)."""
        return torch.cat([tensors[n].reshape(-1) for n in self.names])

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Views of ``flat`` with the parameters' shapes (no copy)."""
        sizes = [s.numel() for s in self.shapes]
        return {
            n: chunk.view(s)
            for n, s, chunk in zip(self.names, self.shapes, torch.split(flat, sizes))
        }


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
