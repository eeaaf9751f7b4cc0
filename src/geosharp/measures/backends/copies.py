"""A half-precision model measured on float32 copies of its weights."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ...params import functional_loss
from .base import Backend
from .loss_grad import Widened

__all__ = ["Float32Copies", "float32_copies"]


class Float32Copies(Backend):
    """The whole model in float32: its other half-precision parameters and buffers as
    float32 copies beside the float32 point (where :class:`.Float32Owners` cannot
    apply: an owner with submodules, or under autocast)."""

    def __init__(self, model, loss_fn, target):
        base = float32_copies(model, target.named)
        theta = Widened(target.theta, target.dtype, target.narrow)
        super().__init__(functional_loss(model, loss_fn, base, target.narrow), theta)


def float32_copies(model: nn.Module, perturbed: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """float32 copies of the model's half-precision parameters and buffers that are not
    perturbed, swapped in beside the float32 perturbed point."""
    skip = {n for n, _ in perturbed}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {
        n: t.detach().float()
        for n, t in tensors
        if n not in skip and t.dtype in (torch.float16, torch.bfloat16)
    }
