"""A half-precision model measured in float32 only where the perturbation lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...params import UpCasts, computing_in_float32, functional_loss, owning_modules
from . import split as split_products
from .base import Backend
from .loss_grad import Widened
from .split import SplitLinears

__all__ = ["Float32Owners", "MixedPrecision"]


class Float32Owners(Backend):
    """The modules that own perturbed parameters compute in float32 (their products
    with perturbed matrices in half-precision parts), the rest of the model in its own
    precision on its own weights (:class:`MixedPrecision`)."""

    def __init__(self, model, loss_fn, target, plan: MixedPrecision):
        theta = Widened(target.theta, target.dtype, target.narrow)
        super().__init__(functional_loss(model, loss_fn, plan.base, target.narrow), theta)
        self.plan, self.half = plan, plan.half
        self.split = plan.split

    def active(self):
        return self.plan.active()


@dataclass
class MixedPrecision:
    """A half-precision model measured with float32 only where the perturbation lives:
    the modules that own perturbed parameters compute in float32 (their other
    parameters and buffers as float32 copies, ``base``; their floating inputs cast up,
    their outputs cast back to ``half``); the rest of the model computes in ``half``
    on its own weights. Possible where every such module is a leaf (holds no
    submodules): a ``Linear``, an ``Embedding``, a norm.

    Their linear products with a perturbed matrix (``weights``: each owner's
    ``{attribute: the half-precision matrix}``) run in ``half`` instead, as the
    weight's product plus the perturbation's in half-precision parts, each
    accumulated in float32 (:mod:`~geosharp.measures.backends.split`). ``split``, decided
    when the plan is made: there is such a matrix and
    :func:`~geosharp.measures.backends.split.wanted` says so (on devices that multiply
    half precision into float32); else they stay in float32."""

    owners: list[nn.Module]
    base: dict[str, Tensor]
    half: torch.dtype
    weights: dict[int, dict[str, Tensor]]
    split: bool = True

    @classmethod
    def plan(cls, model: nn.Module, perturbed: list[tuple[str, Tensor]], half):
        owners = owning_modules(model, perturbed)  # under each name (a tied head too)
        if any(next(m.children(), None) is not None for m, _ in owners.values()):
            return None  # a module with submodules: the whole model in float32 instead
        base, weights, held = {}, {}, dict(perturbed)
        for owner, (module, attrs) in owners.items():
            prefix = f"{owner}." if owner else ""
            mine = {attr for attr, _ in attrs}
            matrices = {
                a: held[n] for a, n in attrs if held[n].dim() == 2 and held[n].dtype == half
            }
            if matrices:
                weights[id(module)] = matrices
            for local, t in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]:
                if local not in mine and t.dtype == half:
                    base[prefix + local] = t.detach().float()
        modules = list({id(m): m for m, _ in owners.values()}.values())
        matrix = next((t for held in weights.values() for t in held.values()), None)
        split = matrix is not None and split_products.wanted(matrix)
        return cls(modules, base, half, weights, split)

    def active(self):
        """Inside, the owners compute in float32 (:func:`~geosharp.params.computing_in_float32`),
        their products with perturbed matrices split (:class:`SplitLinears`)."""
        if not self.split:
            return computing_in_float32(self.owners, self.half)
        copies = UpCasts()
        mode = SplitLinears(self.weights, copies)
        return computing_in_float32(self.owners, self.half, mode.before, mode.after, copies)
