"""Symmetric pairs ``(G, H)``: where their entries live in the model's parameters.

A pair is a building block ``f(G H^T)``, invariant under ``(G, H) -> (G A, H A^{-T})``
for ``A`` in ``GL(h)``, or in a subgroup of it where the block is not a function of
``G H^T`` alone (rotary position embeddings; MATH.md, section 1). Its blocks are
assembled from slices of the model's parameters; we record, for every entry of ``G``
and ``H``, *which* parameter entry it is. Handlers describe layouts with ordinary
tensor code applied to :func:`positions` (``arange`` shaped like the parameter), e.g.
the query block of head ``i`` of an ``nn.Linear`` weight ``W`` (``out x in``) is
``positions(W).view(heads, d_head, d_in).transpose(1, 2)``.
"""

from __future__ import annotations

import textwrap
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["GROUPS", "Block", "PairSpec", "Symmetries", "check_group", "positions"]

GROUPS = ("GL", "rotary")
"""Symmetry groups a pair may declare: the full ``GL(h)`` or the RoPE subgroup."""


def check_group(group: str, h: int) -> None:
    """Raise unless ``group`` is known and fits ``h`` columns."""
    if group not in GROUPS:
        raise ValueError(f"unknown symmetry group {group!r}: use one of {', '.join(GROUPS)}")
    if group == "rotary" and h % 2:
        raise ValueError(f"the rotary group needs an even head dimension, got h={h}")


def positions(param: Tensor) -> Tensor:
    """``arange(numel)`` with ``param``'s shape: slice it like the parameter to get the
    flat positions of the slice's entries."""
    return torch.arange(param.numel(), dtype=torch.long).view(param.shape)


class Block:
    """Rows of a stacked ``G`` or ``H`` taken from one parameter.

    ``index[k, r, c]`` is the flat position, in parameter ``param``, of row ``r``,
    column ``c`` of head ``k``'s block. An index that is affine in ``(k, r, c)`` (every
    slice of a linear layer's heads is) is kept as its offset and three strides and
    rebuilt when read: a block holds no int64 tensor for the measure's lifetime.
    """

    __slots__ = ("_affine", "_index", "param", "shape")

    def __init__(self, param: str, index: Tensor):
        if not isinstance(index, Tensor) or index.dim() != 3 or index.dtype != torch.long:
            desc = (
                f"{tuple(index.shape)} {index.dtype}"
                if isinstance(index, Tensor)
                else type(index).__name__
            )
            raise ValueError(
                f"Block index for {param!r} must be an int64 tensor (heads, rows, h), got {desc}"
            )
        object.__setattr__(self, "param", param)
        object.__setattr__(self, "shape", tuple(index.shape))
        affine = _affine(index)
        object.__setattr__(self, "_affine", affine)
        object.__setattr__(self, "_index", None if affine is not None else index)

    def __setattr__(self, name, value):
        raise AttributeError("Block is immutable")

    @property
    def index(self) -> Tensor:
        """The ``(heads, rows, h)`` int64 positions (rebuilt on each read when affine)."""
        if self._affine is None:
            return self._index
        return _affine_positions(self.shape, *self._affine)

    def __repr__(self) -> str:
        where = (
            f"offset={self._affine[0]}, strides={self._affine[1]}"
            if self._affine is not None
            else "explicit"
        )
        return f"Block(param={self.param!r}, shape={self.shape}, {where})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Block):
            return NotImplemented
        return (
            self.param == other.param
            and self.shape == other.shape
            and torch.equal(self.index, other.index)
        )

    __hash__ = object.__hash__


def _affine_positions(shape: Sequence[int], offset: int, strides: Sequence[int]) -> Tensor:
    """``out[k, r, c] = offset + k s0 + r s1 + c s2`` (int64)."""
    out = torch.full(tuple(shape), offset, dtype=torch.long)
    for dim, (size, stride) in enumerate(zip(shape, strides)):
        view = [1, 1, 1]
        view[dim] = size
        out += (torch.arange(size, dtype=torch.long) * stride).view(view)
    return out


def _affine(index: Tensor) -> tuple[int, tuple[int, int, int]] | None:
    """``(offset, strides)`` with ``index[k, r, c] = offset + k s0 + r s1 + c s2``, or
    ``None`` when ``index`` is not of that form."""
    if index.numel() == 0:
        return None
    idx = index.detach().cpu()
    offset = int(idx[0, 0, 0])
    strides = []
    for dim in range(3):
        if idx.shape[dim] > 1:
            unit = [0, 0, 0]
            unit[dim] = 1
            strides.append(int(idx[tuple(unit)]) - offset)
        else:
            strides.append(0)
    rebuilt = _affine_positions(idx.shape, offset, strides)
    return (offset, tuple(strides)) if torch.equal(rebuilt, idx) else None


def _concat_rows(blocks: Sequence[Block]) -> tuple[int, int, int]:
    heads = {b.shape[0] for b in blocks}
    cols = {b.shape[2] for b in blocks}
    if len(heads) != 1 or len(cols) != 1:
        raise ValueError(
            "blocks of one side of a pair must agree in heads and columns, got "
            + ", ".join(f"{b.param}: {tuple(b.shape)}" for b in blocks)
        )
    return heads.pop(), sum(b.shape[1] for b in blocks), cols.pop()


@dataclass(frozen=True)
class PairSpec:
    """``heads`` pairs of one module, stacked: ``G`` is ``(heads, n, h)``, ``H`` is
    ``(heads, m, h)``; rows of ``G`` (``H``) are the rows of ``g_blocks`` (``h_blocks``)
    concatenated in order.

    ``kind`` names the role (``"query-key"``, ``"value-output"``, ``"lora"``, ...).
    ``group`` is the symmetry group acting as ``(G, H) -> (G A, H A^{-T})``: ``"GL"``
    (every invertible ``A``) or ``"rotary"`` (``A`` a complex scalar on each plane
    ``(j, j + h/2)``: the query/key symmetry left by rotary position embeddings,
    MATH.md section 1). ``note`` is free text for :meth:`Symmetries.summary`.
    """

    module: str
    kind: str
    g_blocks: tuple[Block, ...]
    h_blocks: tuple[Block, ...]
    group: str = "GL"
    note: str = ""

    def __post_init__(self) -> None:
        hg, _, cg = _concat_rows(self.g_blocks)
        hh, _, ch = _concat_rows(self.h_blocks)
        if hg != hh or cg != ch:
            raise ValueError(
                f"pair {self.name}: G is (heads={hg}, h={cg}) but H is (heads={hh}, h={ch})"
            )
        check_group(self.group, cg)

    @property
    def name(self) -> str:
        return f"{self.module}:{self.kind}"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(heads, n, m, h)``."""
        heads, n, h = _concat_rows(self.g_blocks)
        return heads, n, _concat_rows(self.h_blocks)[1], h

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.param for b in self.g_blocks + self.h_blocks))

    @property
    def group_label(self) -> str:
        """E.g. ``"GL(64) x 12 heads"`` or ``"rotary(128) x 8 heads"``."""
        heads, _, _, h = self.shape
        return f"{self.group}({h}) x {heads} head{'s' if heads != 1 else ''}"


@dataclass
class Symmetries:
    """The parameter symmetries of a model, as found by :func:`find_symmetries`.

    ``pairs``: every pair block (``GL(h)`` or a subgroup); ``elementwise``: parameters
    (or the parts of parameters) outside any pair, which keep the element-wise rescaling geometry;
    ``unrecognized``: attention-like modules that no handler understood (their
    parameters are treated element-wise, which is safe but ignores their symmetry).
    """

    pairs: list[PairSpec]
    parameters: dict[str, tuple[int, ...]]
    unrecognized: list[str] = field(default_factory=list)

    def coverage(self) -> dict[str, Tensor]:
        """For every parameter, how many pair entries use each of its entries."""
        counts = {
            n: torch.zeros(int(torch.Size(s).numel()), dtype=torch.long)
            for n, s in self.parameters.items()
        }
        for pair in self.pairs:
            for block in pair.g_blocks + pair.h_blocks:
                counts[block.param].index_add_(
                    0, block.index.reshape(-1), torch.ones(block.index.numel(), dtype=torch.long)
                )
        return counts

    @property
    def elementwise(self) -> list[str]:
        """Parameters with at least one entry outside every pair."""
        return [n for n, c in self.coverage().items() if bool((c == 0).any())]

    def validate(self) -> None:
        """Raise if an entry belongs to two pairs or a block points outside its parameter."""
        for pair in self.pairs:
            for block in pair.g_blocks + pair.h_blocks:
                if block.param not in self.parameters:
                    raise ValueError(f"pair {pair.name} uses unknown parameter {block.param!r}")
                size = torch.Size(self.parameters[block.param]).numel()
                if block.index.numel() and (block.index.min() < 0 or block.index.max() >= size):
                    raise ValueError(f"pair {pair.name}: index out of range for {block.param!r}")
        for name, count in self.coverage().items():
            if bool((count > 1).any()):
                raise ValueError(
                    f"parameter {name!r} has entries claimed by two symmetric pairs; "
                    "each entry may belong to one pair only"
                )

    def restrict(self, names: Sequence[str]) -> Symmetries:
        """Keep the pairs whose parameters are all in ``names``."""
        keep = set(names)
        return Symmetries(
            pairs=[p for p in self.pairs if set(p.params) <= keep],
            parameters={n: s for n, s in self.parameters.items() if n in keep},
            unrecognized=list(self.unrecognized),
        )

    def by_module(self) -> dict[str, list[PairSpec]]:
        grouped: dict[str, list[PairSpec]] = defaultdict(list)
        for pair in self.pairs:
            grouped[pair.module].append(pair)
        return dict(grouped)

    def with_pairs(self, *pairs: PairSpec) -> Symmetries:
        """A copy with ``pairs`` added (e.g. from :func:`~geosharp.symmetry.declare_pair`),
        validated; modules named by the new pairs leave ``unrecognized``."""
        modules = {p.module for p in pairs}
        out = Symmetries(
            pairs=[*self.pairs, *pairs],
            parameters=dict(self.parameters),
            unrecognized=[u for u in self.unrecognized if u not in modules],
        )
        out.validate()
        return out

    def summary(self) -> str:
        """Per module, the pairs and their groups; per layer, the parameters left to the
        element-wise (adaptive) geometry; then the attention-like modules not
        recognised."""
        lines = []
        heads_total = sum(p.shape[0] for p in self.pairs)
        groups = sorted({p.group for p in self.pairs})
        n_modules = len(self.by_module())
        lines.append(
            f"{len(self.pairs)} pair blocks ({heads_total} pairs; groups: "
            f"{', '.join(groups) or 'none'}) in {n_modules} module{'s' * (n_modules != 1)}"
        )
        for module, pairs in self.by_module().items():
            lines.append(f"{module or '<root>'}")
            for pair in pairs:
                _, n, m, h = pair.shape
                extra = f"  ({pair.note})" if pair.note else ""
                lines.append(
                    f"    {pair.kind:<14} {pair.group_label:<24} G {n}x{h}, H {m}x{h}{extra}"
                )
                lines.append(f"    {'':<14} uses {', '.join(pair.params)}")

        coverage = self.coverage()
        partial = {n for n, c in coverage.items() if bool((c == 0).any() and (c > 0).any())}
        rest = [n for n, c in coverage.items() if bool((c == 0).any())]
        lines.append(
            f"element-wise geometry: {len(rest)} of {len(self.parameters)} parameters"
            + (" ('*': partly, the rest in pairs)" if partial else "")
        )
        by_layer: dict[str, list[str]] = defaultdict(list)
        for name in rest:
            layer, local = _layer_of(name)
            by_layer[layer].append(local + ("*" if name in partial else ""))
        for layer, names in by_layer.items():
            lines.append(
                textwrap.fill(
                    f"{layer or '<root>'}: {', '.join(names)}",
                    width=100,
                    initial_indent="    ",
                    subsequent_indent="        ",
                    break_on_hyphens=False,
                )
            )
        if self.unrecognized:
            lines.append(
                "NOT RECOGNISED: attention-like modules whose symmetries are ignored "
                "(their parameters are element-wise); declare their pairs with "
                "geosharp.symmetry.declare_pair or register_handler:"
            )
            lines.extend(f"    {u}" for u in self.unrecognized)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _layer_of(name: str) -> tuple[str, str]:
    """Split a parameter name into its layer (up to the first numeric component, else
    the parent module) and the rest: ``("model.layers.0", "mlp.up_proj.weight")``."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1]), ".".join(parts[i + 1 :])
    return ".".join(parts[:-1]), parts[-1]
