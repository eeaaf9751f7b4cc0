r"""The symmetry groups of pairs, their elements, and acting with them on a model.

A pair ``(G, H)`` is invariant under ``(G, H) -> (G A, H A^{-T})`` for ``A`` in
``GL(h)``, or in the subgroup left by rotary position embeddings (MATH.md section 1):
matrices acting on each plane ``(j, j')`` as a complex scalar ``[[a, -b], [b, a]]``,
``j' = j + h/2`` ("rotary") or ``(2j, 2j + 1)`` ("rotary-interleaved"), whose Lie
algebra has the basis

.. math:: A_j = e_j e_j^T + e_{j'} e_{j'}^T, \qquad B_j = e_{j'} e_j^T - e_j e_{j'}^T.

>>> A = random_group_elements("rotary", 3, 4, cond=10.0)  # complex scalars per plane
>>> bool(torch.allclose(A[:, :2, :2], A[:, 2:, 2:]))  # the "a" parts of both planes
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..errors import real_number
from .pairs import GROUPS, Block, PairSpec, Symmetries, check_group, rotary_planes

__all__ = [
    "GROUPS",
    "check_group",
    "lie_algebra_basis",
    "random_group_elements",
    "random_transforms",
    "transform_parameters",
]

_F64 = torch.float64


def lie_algebra_basis(group: str, h: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse basis of the Lie algebra ``k``: ``rows, cols`` (int64) and ``signs``
    (float64), each ``(dim k, 2)``; basis element ``a`` is
    ``sum_s signs[a, s] e_{rows[a, s]} e_{cols[a, s]}^T``. The elements are mutually
    Frobenius-orthogonal, each of squared norm 2."""
    check_group(group, h)
    if group == "GL":
        raise ValueError(f"group {group!r} is the full group: it needs no sparse basis")
    half = h // 2
    j, jp = rotary_planes(group, h)
    rows = torch.cat([torch.stack([j, jp], 1), torch.stack([jp, j], 1)])
    cols = torch.cat([torch.stack([j, jp], 1), torch.stack([j, jp], 1)])
    signs = torch.cat(
        [torch.ones(half, 2, dtype=_F64), torch.tensor([[1.0, -1.0]], dtype=_F64).expand(half, 2)]
    )
    return rows, cols, signs


def random_group_elements(
    group: str, heads: int, h: int, cond: float, generator: torch.Generator | None = None
) -> Tensor:
    """``heads`` random elements of ``group`` with condition number ``cond`` (float64).

    Rotary groups: on each plane ``(j, j')`` the complex scalar ``r_j e^{i phi_j}``,
    ``r_j`` log-spaced in ``[cond^{-1/2}, cond^{1/2}]`` (shuffled), ``phi_j`` uniform.
    """
    check_group(group, h)
    if group == "GL":
        return random_matrices(heads, h, cond, generator)
    half = h // 2
    log_half = 0.5 * torch.log(torch.tensor(float(cond), dtype=_F64))
    r = torch.exp(torch.linspace(-1.0, 1.0, half, dtype=_F64) * log_half)
    r = r[torch.stack([torch.randperm(half, generator=generator) for _ in range(heads)])]
    phi = 2 * torch.pi * torch.rand(heads, half, generator=generator, dtype=_F64)
    a, b = torch.diag_embed(r * torch.cos(phi)), torch.diag_embed(r * torch.sin(phi))
    half_layout = torch.cat([torch.cat([a, -b], -1), torch.cat([b, a], -1)], -2)
    if group == "rotary":
        return half_layout
    j, jp = rotary_planes(group, h)
    order = torch.cat([j, jp])  # column k of the half layout is column order[k] here
    out = torch.empty_like(half_layout)
    out[:, order[:, None], order[None, :]] = half_layout
    return out


def read_block(params: Mapping[str, Tensor], block: Block) -> Tensor:
    """The entries of ``block`` in ``params[block.param]``: ``(heads, rows, h)``, new."""
    param = params[block.param]
    view = block.view(param)
    if view is not None:
        return view.clone()
    return param.reshape(-1)[block.index.to(param.device)]


def write_block(params: Mapping[str, Tensor], block: Block, values: Tensor) -> None:
    """Write ``values`` (``(heads, rows, h)``) into ``block``'s entries, in place."""
    param = params[block.param]
    view = block.view(param)
    if view is not None:
        view.copy_(values)
        return
    flat = param.view(-1)
    flat[block.index.reshape(-1).to(flat.device)] = values.reshape(-1).to(flat.dtype)


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
    out = {n: t.detach().clone() for n, t in params.items()}
    for pair in pairs:
        A = transforms[pair.name].to(device=params[pair.params[0]].device, dtype=torch.float64)
        Ait = torch.linalg.inv(A).transpose(-1, -2)
        for blocks, M in ((pair.g_blocks, A), (pair.h_blocks, Ait)):
            X = torch.cat([read_block(params, b) for b in blocks], dim=1).to(torch.float64)
            X = X @ M
            row = 0
            for b in blocks:
                rows = b.shape[1]
                write_block(out, b, X[:, row : row + rows])
                row += rows
    return out
