"""Acting with the symmetry group: random transforms, re-parameterisation, self-check."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import real_number
from ..params import ParameterLayout, evaluation_mode
from .discovery import find_symmetries
from .pairs import PairSpec, Symmetries

__all__ = [
    "SymmetryCheck",
    "check_symmetries",
    "random_transforms",
    "reparameterize",
    "transform_parameters",
]


def random_matrices(
    heads: int, h: int, cond: float, generator: torch.Generator | None = None
) -> Tensor:
    """``heads`` random ``h x h`` matrices ``U diag(s) V^T`` with condition number ``cond``
    (``s`` log-spaced between ``cond^{-1/2}`` and ``cond^{1/2}``), float64."""

    def orthogonal() -> Tensor:
        q, r = torch.linalg.qr(torch.randn(heads, h, h, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)

    half = 0.5 * torch.log(torch.tensor(float(cond), dtype=torch.float64))
    s = torch.exp(torch.linspace(-1.0, 1.0, h, dtype=torch.float64) * half)
    s = s[torch.stack([torch.randperm(h, generator=generator) for _ in range(heads)])]
    return orthogonal() @ torch.diag_embed(s) @ orthogonal().transpose(-1, -2)


def checked_cond(cond: object) -> float:
    """``cond`` as a float, or an error: a condition number is a finite number >= 1."""
    value = real_number(cond, "cond")
    if not (math.isfinite(value) and value >= 1.0):
        raise ValueError(
            f"cond must be a finite condition number >= 1 (1: orthogonal transforms), got {cond!r}"
        )
    return value


def random_transforms(
    symmetries: Symmetries, cond: float = 10.0, seed: int = 0
) -> dict[str, Tensor]:
    """One random ``A`` per head of every pair, in the pair's group (``GL(h)``, or
    complex scalars per frequency plane for ``"rotary"``), keyed by pair name."""
    from ..geometry.subgroup import random_group_elements

    cond = checked_cond(cond)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for pair in symmetries.pairs:
        heads, _, _, h = pair.shape
        out[pair.name] = random_group_elements(pair.group, heads, h, cond, generator)
    return out


def transform_parameters(
    params: Mapping[str, Tensor],
    pairs: Sequence[PairSpec],
    transforms: Mapping[str, Tensor],
) -> dict[str, Tensor]:
    """New tensors with ``(G, H) -> (G A, H A^{-T})`` applied to every pair (float64 math)."""
    layout = ParameterLayout.from_named(params.items())
    flat = layout.flatten(params).detach()
    from ..geometry.space import stack_pairs

    out = flat.clone()
    for pair in pairs:
        (block,) = stack_pairs([pair], layout, flat.device)
        A = transforms[pair.name].to(device=flat.device, dtype=torch.float64)
        G, H = (x.to(torch.float64) for x in block.gather(flat))
        G2, H2 = G @ A, H @ torch.linalg.inv(A).transpose(-1, -2)
        out = block.scatter(out, (G2.to(flat.dtype), H2.to(flat.dtype)))
    return {n: t.clone() for n, t in layout.unflatten(out).items()}


@torch.no_grad()
def reparameterize(
    model: nn.Module,
    symmetries: Symmetries | None = None,
    cond: float = 10.0,
    seed: int = 0,
    transforms: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Apply a random (or given) symmetry transform to ``model`` **in place**.

    The function computed by the model does not change (up to round-off); every
    pair's blocks become ``(G A, H A^{-T})``. Returns the transforms used.
    Copy the model first (``copy.deepcopy``) to keep the original.
    """
    if transforms is None:
        cond = checked_cond(cond)  # before anything is touched
    symmetries = symmetries or find_symmetries(model)
    transforms = dict(transforms or random_transforms(symmetries, cond, seed))
    named = dict(model.named_parameters())
    new = transform_parameters(
        {n: p.detach() for n, p in named.items()}, symmetries.pairs, transforms
    )
    for name in {n for pair in symmetries.pairs for n in pair.params}:
        named[name].copy_(new[name])
    return transforms


@dataclass
class SymmetryCheck:
    """Largest change of the model's outputs under a random symmetry transform."""

    max_abs_change: float
    max_rel_change: float
    tolerance: float
    per_pair: dict[str, float]

    @property
    def ok(self) -> bool:
        return self.max_rel_change <= self.tolerance

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        lines = [
            f"symmetry self-check {verdict}: largest output change {self.max_abs_change:.3g} "
            f"(relative {self.max_rel_change:.3g}, tolerance {self.tolerance:.3g})"
        ]
        for name, change in self.per_pair.items():
            if change > self.tolerance:
                lines.append(f"  pair {name} changes the output by {change:.3g} (relative)")
        return "\n".join(lines)


@torch.no_grad()
def check_symmetries(
    model: nn.Module,
    batch: object,
    symmetries: Symmetries | None = None,
    cond: float = 10.0,
    seed: int = 0,
    tolerance: float | None = None,
) -> SymmetryCheck:
    """Transform every discovered pair by a random well-conditioned ``A`` and report the
    largest change of the model's output on ``batch`` (it must be at round-off).

    ``batch`` is passed as ``model(**batch)`` for a mapping, ``model(*batch)`` for a
    tuple and ``model(batch)`` otherwise. If the check fails, each pair is also tried
    alone so that the culprit is named. The model is not modified.
    """
    symmetries = symmetries or find_symmetries(model, warn=False)
    params = {n: p.detach() for n, p in model.named_parameters()}
    dtype = next(iter(params.values())).dtype
    if tolerance is None:
        tolerance = {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)
    transforms = random_transforms(symmetries, cond, seed)

    with evaluation_mode(model):
        reference = _outputs(model, batch, params)
        scale = max(float(r.abs().max()) for r in reference) or 1.0

        def change(pairs: Sequence[PairSpec]) -> float:
            moved = _outputs(model, batch, transform_parameters(params, pairs, transforms))
            return max(float((a - b).abs().max()) for a, b in zip(moved, reference))

        abs_change = change(symmetries.pairs)
        per_pair = {}
        if abs_change / scale > tolerance:
            per_pair = {p.name: change([p]) / scale for p in symmetries.pairs}
    return SymmetryCheck(abs_change, abs_change / scale, tolerance, per_pair)


def _outputs(model: nn.Module, batch: object, params: Mapping[str, Tensor]) -> list[Tensor]:
    if isinstance(batch, Mapping):
        args, kwargs = (), dict(batch)
    elif isinstance(batch, tuple):
        args, kwargs = batch, {}
    else:
        args, kwargs = (batch,), {}
    out = torch.func.functional_call(model, dict(params), args, kwargs)
    tensors = _floating_tensors(out)
    if not tensors:
        raise TypeError("the model's output holds no floating-point tensor to compare")
    return tensors


def _floating_tensors(out: object) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out.detach()] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        return []
    return [t for v in values for t in _floating_tensors(v)]
