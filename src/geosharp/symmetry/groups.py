r"""The symmetry groups of pairs, their elements, and acting with them on a model.

A pair ``(G, H)`` is invariant under ``(G, H) -> (G A, H A^{-T})`` for ``A`` in
``GL(h)``, or in a subgroup of it (MATH.md section 1): under rotary position embeddings,
matrices acting on each plane ``(j, j')`` as a complex scalar ``[[a, -b], [b, a]]``,
``j' = j + h/2`` ("rotary") or ``(2j, 2j + 1)`` ("rotary-interleaved"); under queries
and keys normalised without a weight, the orthogonal group ("orthogonal", ``A^{-T} =
A``), and with rotary embeddings too a rotation on each plane ("rotary-orthogonal",
"rotary-interleaved-orthogonal"). Their Lie algebras have the sparse bases

.. math:: A_j = e_j e_j^T + e_{j'} e_{j'}^T, \quad B_j = e_{j'} e_j^T - e_j e_{j'}^T
          \quad\text{(rotary)}, \qquad E_{ij} = e_i e_j^T - e_j e_i^T, \ i < j
          \quad\text{(orthogonal)},

and ``B_j`` alone for a rotation per plane.

>>> A = random_group_elements("rotary", 3, 4, cond=10.0)  # complex scalars per plane
>>> bool(torch.allclose(A[:, :2, :2], A[:, 2:, 2:]))  # the "a" parts of both planes
True
>>> R = random_group_elements("orthogonal", 2, 3, cond=10.0)
>>> bool(torch.allclose(R @ R.mT, torch.eye(3, dtype=torch.float64).expand(2, 3, 3)))
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
    "CHECKS",
    "GROUPS",
    "check_group",
    "lie_algebra_basis",
    "random_group_elements",
    "random_transforms",
    "transform_parameters",
]

_F64 = torch.float64

CHECKS = ("scalar", "scalar-shared")
"""Transforms that verification tries beside the groups (never a pair's group): a
scale per head, ``A = c_k I``, and one scale for every head. Where only they leave the
output unchanged, the element-wise geometry, which rescales every entry, already
respects the symmetry."""


def lie_algebra_basis(group: str, h: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse basis of the Lie algebra ``k``: ``rows, cols`` (int64) and ``signs``
    (float64), each ``(dim k, 2)``; basis element ``a`` is
    ``sum_s signs[a, s] e_{rows[a, s]} e_{cols[a, s]}^T``. The elements are mutually
    Frobenius-orthogonal, each of squared norm 2."""
    check_group(group, h)
    if group == "GL":
        raise ValueError(f"group {group!r} is the full group: it needs no sparse basis")
    if group == "orthogonal":
        i, j = torch.triu_indices(h, h, 1)
        rows, cols = torch.stack([i, j], 1), torch.stack([j, i], 1)
        return rows, cols, torch.tensor([[1.0, -1.0]], dtype=_F64).expand(len(i), 2).clone()
    half = h // 2
    j, jp = rotary_planes(group, h)
    rotations = (torch.stack([jp, j], 1), torch.stack([j, jp], 1))
    minus = torch.tensor([[1.0, -1.0]], dtype=_F64).expand(half, 2)
    if group.endswith("orthogonal"):
        return rotations[0], rotations[1], minus.clone()
    rows = torch.cat([torch.stack([j, jp], 1), rotations[0]])
    cols = torch.cat([torch.stack([j, jp], 1), rotations[1]])
    signs = torch.cat([torch.ones(half, 2, dtype=_F64), minus])
    return rows, cols, signs


def random_group_elements(
    group: str, heads: int, h: int, cond: float, generator: torch.Generator | None = None
) -> Tensor:
    """``heads`` random elements of ``group`` with condition number ``cond`` (float64).

    Rotary groups: on each plane ``(j, j')`` the complex scalar ``r_j e^{i phi_j}``,
    ``r_j`` log-spaced in ``[cond^{-1/2}, cond^{1/2}]`` (shuffled), ``phi_j`` uniform
    (``r_j = 1`` for a rotation per plane); orthogonal: uniform (Haar) on ``O(h)``;
    the checks of :data:`CHECKS`: scales log-spaced in the same range.
    """
    if group in CHECKS:
        log_half = 0.5 * math.log(float(cond))
        count = 1 if group == "scalar-shared" else heads
        c = torch.exp((2 * torch.rand(count, generator=generator, dtype=_F64) - 1) * log_half)
        return c.expand(heads)[:, None, None] * torch.eye(h, dtype=_F64)
    check_group(group, h)
    if group == "GL":
        return random_matrices(heads, h, cond, generator)
    if group == "orthogonal":
        return _orthogonal(heads, h, generator)
    half = h // 2
    if group.endswith("orthogonal"):
        r = torch.ones(heads, half, dtype=_F64)
    else:
        log_half = 0.5 * torch.log(torch.tensor(float(cond), dtype=_F64))
        r = torch.exp(torch.linspace(-1.0, 1.0, half, dtype=_F64) * log_half)
        r = r[torch.stack([torch.randperm(half, generator=generator) for _ in range(heads)])]
    phi = 2 * torch.pi * torch.rand(heads, half, generator=generator, dtype=_F64)
    a, b = torch.diag_embed(r * torch.cos(phi)), torch.diag_embed(r * torch.sin(phi))
    half_layout = torch.cat([torch.cat([a, -b], -1), torch.cat([b, a], -1)], -2)
    if group in ("rotary", "rotary-orthogonal"):
        return half_layout
    j, jp = rotary_planes(group, h)
    order = torch.cat([j, jp])  # column k of the half layout is column order[k] here
    out = torch.empty_like(half_layout)
    out[:, order[:, None], order[None, :]] = half_layout
    return out


def _orthogonal(heads: int, h: int, generator: torch.Generator | None) -> Tensor:
    q, r = torch.linalg.qr(torch.randn(heads, h, h, generator=generator, dtype=_F64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)


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
        return _orthogonal(heads, h, generator)

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
    """One random ``A`` per head of every pair, in the pair's group (``GL(h)``, complex
    scalars per frequency plane for ``"rotary"``, ...), keyed by pair name."""
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
