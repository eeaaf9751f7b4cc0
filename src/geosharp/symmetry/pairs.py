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
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..layout import column_starts

__all__ = [
    "GROUPS",
    "Block",
    "Dropped",
    "PairSpec",
    "Symmetries",
    "Verification",
    "check_group",
    "positions",
]

GROUPS = (
    "GL",
    "rotary",
    "rotary-interleaved",
    "orthogonal",
    "rotary-orthogonal",
    "rotary-interleaved-orthogonal",
)
"""Symmetry groups a pair may declare: the full ``GL(h)``; the subgroup left by rotary
position embeddings, complex scalars on planes ``(j, j + h/2)`` ("rotate half", LLaMA,
GPT-NeoX) or ``(2j, 2j + 1)`` (interleaved, GPT-J, CodeGen); the orthogonal group
``O(h)``, left by queries and keys normalised without a learned weight (cosine
attention); and its intersection with a rotary group, a rotation on each plane (a
normalisation and rotary embeddings)."""


def rotary_planes(group: str, h: int) -> tuple[Tensor, Tensor]:
    """The planes ``(j, j')`` on which a rotary group acts: two int64 vectors of ``h/2``."""
    half = torch.arange(h // 2)
    if group.startswith("rotary-interleaved"):
        return 2 * half, 2 * half + 1
    return half, half + h // 2


def is_rotary(group: str) -> bool:
    """Whether ``group`` acts on rotary planes."""
    return group.startswith("rotary")


def orthogonal_part(group: str) -> str:
    """The intersection of ``group`` with the orthogonal group."""
    if group.endswith("orthogonal"):
        return group
    return "orthogonal" if group == "GL" else f"{group}-orthogonal"


def check_group(group: str, h: int) -> None:
    """Raise unless ``group`` is known and fits ``h`` columns."""
    if group not in GROUPS:
        raise ValueError(f"unknown symmetry group {group!r}: use one of {', '.join(GROUPS)}")
    if is_rotary(group) and h % 2:
        raise ValueError(f"the rotary group needs an even head dimension, got h={h}")


def positions(param: Tensor) -> Tensor:
    """``arange(numel)`` with ``param``'s shape: slice it like the parameter to get the
    flat positions of the slice's entries."""
    return torch.arange(param.numel(), dtype=torch.long).view(param.shape)


class Block:
    """Rows of a stacked ``G`` or ``H`` taken from one parameter.

    ``index[k, r, c]`` is the flat position, in parameter ``param``, of row ``r``,
    column ``c`` of head ``k``'s block. An index that is *separable*,
    ``index[k, r, c] = heads[k] + rows[r] + cols[c]`` (every slice of a linear layer's
    heads is, also with grouped-query stacking or permuted columns), is kept as those
    three vectors and rebuilt when read: a block holds no parameter-sized int64 tensor
    for the measure's lifetime. :meth:`separable` builds one without listing positions.

    >>> block = Block.separable("w", torch.tensor([0, 8]), torch.arange(2), torch.tensor([0, 4]))
    >>> block.index.tolist()  # 2 heads, 2 rows, 2 columns
    [[[0, 4], [1, 5]], [[8, 12], [9, 13]]]
    """

    __slots__ = ("_index", "_parts", "_strides", "param", "shape")

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
        parts = _separable(index)
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_index", None if parts is not None else index)

    @classmethod
    def separable(cls, param: str, heads: Tensor, rows: Tensor, cols: Tensor) -> Block:
        """The block ``index[k, r, c] = heads[k] + rows[r] + cols[c]`` (1-D int64 vectors)."""
        block = cls.__new__(cls)
        parts = tuple(t.detach().to("cpu", torch.long).reshape(-1) for t in (heads, rows, cols))
        object.__setattr__(block, "param", param)
        object.__setattr__(block, "shape", tuple(len(t) for t in parts))
        object.__setattr__(block, "_parts", parts)
        object.__setattr__(block, "_index", None)
        return block

    def renamed(self, param: str) -> Block:
        """The same positions in a parameter named ``param``."""
        if self._parts is not None:
            return Block.separable(param, *self._parts)
        return Block(param, self._index)

    def take_heads(self, start: int, stop: int) -> Block:
        """The block of heads ``start:stop`` only."""
        if self._parts is not None:
            k, r, c = self._parts
            return Block.separable(self.param, k[start:stop], r, c)
        return Block(self.param, self._index[start:stop])

    def __setattr__(self, name, value):
        raise AttributeError("Block is immutable")

    @property
    def index(self) -> Tensor:
        """The ``(heads, rows, h)`` int64 positions (rebuilt on each read when separable)."""
        if self._parts is None:
            return self._index
        k, r, c = self._parts
        return k[:, None, None] + r[None, :, None] + c[None, None, :]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    def starts(self) -> tuple[Tensor, Tensor] | None:
        """``(start, step)``, ``(heads, rows)`` int64 each, with ``index[k, r, c] =
        start[k, r] + c step[k, r]`` (``step`` 1 for one column), or ``None`` when a
        row's columns do not step evenly: the block without its column axis.

        >>> heads, rows, cols = torch.tensor([0, 8]), torch.arange(2), torch.tensor([0, 4])
        >>> block = Block.separable("w", heads, rows, cols)
        >>> block.starts()[0].tolist(), block.starts()[1].tolist()
        ([[0, 1], [8, 9]], [[4, 4], [4, 4]])
        """
        if self._parts is None:
            return column_starts(self._index)
        k, r, c = self._parts
        step = _step(c)
        if step is None:
            return None
        start = k[:, None] + r[None, :] + c[0]
        return start, torch.full_like(start, step if self.shape[2] > 1 else 1)

    def view(self, tensor: Tensor) -> Tensor | None:
        """The block as a strided view of the contiguous ``tensor`` (writes reach it), or
        ``None`` where heads, rows or columns do not step evenly, step backwards or may
        overlap (an axis not stepping past all the smaller ones): the caller then indexes.

        >>> heads, rows, cols = torch.tensor([0, 8]), torch.arange(2), torch.tensor([0, 4])
        >>> Block.separable("w", heads, rows, cols).view(torch.arange(16.0))
        tensor([[[ 0.,  4.],
                 [ 1.,  5.]],
        <BLANKLINE>
                [[ 8., 12.],
                 [ 9., 13.]]])
        """
        if not tensor.is_contiguous():
            return None
        strides = self._strided()
        if strides is None:
            return None
        steps, offset, covered = strides
        if offset + covered >= tensor.numel():
            return None
        return tensor.as_strided(self.shape, steps, tensor.storage_offset() + offset)

    def _strided(self) -> tuple[tuple[int, ...], int, int] | None:
        """``(steps, offset, last position - offset)`` of a separable block whose axes
        step evenly forward without overlap, else ``None``; worked out on first use."""
        try:
            return self._strides
        except AttributeError:  # not worked out yet
            pass
        strides = None
        if self._parts is not None:
            strides = _even_strides(self._parts, self.shape)
        object.__setattr__(self, "_strides", strides)
        return strides

    def bounds(self) -> tuple[int, int]:
        """Smallest and largest position (without listing the positions)."""
        if self._parts is None:
            return int(self._index.min()), int(self._index.max())
        lo = sum(int(t.min()) for t in self._parts)
        hi = sum(int(t.max()) for t in self._parts)
        return lo, hi

    def __repr__(self) -> str:
        where = "separable" if self._parts is not None else "explicit"
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


def _even_strides(parts, shape) -> tuple[tuple[int, ...], int, int] | None:
    """:meth:`Block._strided` of the vectors ``parts``."""
    steps = tuple(_step(t) for t in parts)
    if any(s is None or s < 0 for s in steps):
        return None
    # distinct positions: each axis steps past everything the smaller ones cover
    covered = 0
    for size, step in sorted(zip(shape, steps), key=lambda a: a[1]):
        if size > 1:
            if step <= covered:
                return None
            covered += (size - 1) * step
    offset = sum(int(t[0]) for t in parts)
    return (steps, offset, covered) if offset >= 0 else None


def _step(values: Tensor) -> int | None:
    """The even step of a 1-D int64 vector (0 for one value), or ``None``."""
    if len(values) < 2:
        return 0
    step = int(values[1] - values[0])
    even = values[0] + torch.arange(len(values)) * step
    return step if torch.equal(values, even) else None


def _separable(index: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(heads, rows, cols)`` with ``index[k, r, c] = heads[k] + rows[r] + cols[c]``, or
    ``None`` when ``index`` is not of that form."""
    if index.numel() == 0:
        return None
    idx = index.detach().cpu()
    origin = idx[0, 0, 0]
    parts = (idx[:, 0, 0].clone(), idx[0, :, 0] - origin, idx[0, 0, :] - origin)
    k, r, c = parts
    rebuilt = k[:, None, None] + r[None, :, None] + c[None, None, :]
    return parts if torch.equal(rebuilt, idx) else None


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
    (every invertible ``A``), ``"rotary"`` (``A`` a complex scalar on each plane
    ``(j, j + h/2)``: the query/key symmetry left by rotary position embeddings,
    MATH.md section 1), ``"orthogonal"`` (``A`` orthogonal: queries and keys normalised
    without a weight) or another of :data:`GROUPS`. ``note`` is free text for
    :meth:`Symmetries.summary`.
    ``query_heads``: the query heads each stacked block holds (grouped-query attention
    stacks several on one key/value head; 1 otherwise).
    """

    module: str
    kind: str
    g_blocks: tuple[Block, ...]
    h_blocks: tuple[Block, ...]
    group: str = "GL"
    note: str = ""
    query_heads: int = 1

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

    def take_heads(self, start: int, stop: int) -> PairSpec:
        """The pairs of heads ``start:stop`` only (the same module and kind)."""
        return replace(
            self,
            g_blocks=tuple(b.take_heads(start, stop) for b in self.g_blocks),
            h_blocks=tuple(b.take_heads(start, stop) for b in self.h_blocks),
        )

    @property
    def group_label(self) -> str:
        """E.g. ``"GL(64) x 12 heads"`` or ``"rotary(128) x 8 heads"``."""
        heads, _, _, h = self.shape
        return f"{self.group}({h}) x {heads} head{'s' if heads != 1 else ''}"


@dataclass(frozen=True)
class Dropped:
    """A pair of an attention module that is not used, and why.

    ``exact``: the module has no such symmetry (its queries are normalised, its values
    clipped, ...), so measuring those parameters element-wise is exactly right;
    ``False``: geosharp could not establish the pair (a layout it does not understand,
    a failed verification), so a symmetry may exist and is ignored.
    """

    module: str
    kind: str
    reason: str
    exact: bool


@dataclass(frozen=True)
class Verification:
    """A pair checked on the model: a random transform in its group changed the output
    of module ``unit`` by ``change`` (relative to its size), a transform of ``G`` alone
    (not a symmetry) by ``power``, both computed in ``dtype``."""

    pair: str
    unit: str
    change: float
    power: float
    tolerance: float
    dtype: str

    @property
    def ok(self) -> bool:
        return self.change <= self.tolerance

    @property
    def conclusive(self) -> bool:
        """Whether the module's output depends on the pair enough for the check to tell."""
        return self.power > 100 * self.tolerance


@dataclass
class Symmetries:
    """The parameter symmetries of a model, as found by :func:`find_symmetries`.

    ``pairs``: every pair block (``GL(h)`` or a subgroup); ``elementwise``: parameters
    (or the parts of parameters) outside any pair, which keep the element-wise rescaling
    geometry. ``attention``: the attention modules found; ``dropped``: the pairs of those
    modules that are not used, with the reason (:class:`Dropped`); ``unrecognized``:
    modules whose symmetry is ignored because geosharp did not understand it (their
    parameters are measured element-wise: safe, but not symmetry-correct).
    ``verified``: per pair name, its numerical check (:class:`Verification`); empty
    when discovery had no input to run (``discovery="structure"``) or no weights (a
    model on the ``meta`` device). ``trace_error``: why the forward pass could not be
    traced (the error's first line; ``None`` where it was, or none was run).
    """

    pairs: list[PairSpec]
    parameters: dict[str, tuple[int, ...]]
    unrecognized: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    verified: dict[str, Verification] = field(default_factory=dict)
    discovery: str = "structure"
    trace_error: str | None = None
    idle: list[str] = field(default_factory=list)
    """Parameters the traced forward pass did not use (a decoder's cross-attention
    without encoder states, an unused head): they take no part in that batch's loss, and
    their symmetries, if any, are unknown; pass a batch that uses them."""

    def coverage(self) -> dict[str, Tensor]:
        """For every parameter, how many pair entries use each of its entries."""
        counts = {
            n: torch.zeros(int(torch.Size(s).numel()), dtype=torch.long)
            for n, s in self.parameters.items()
        }
        for pair in self.pairs:
            for block in pair.g_blocks + pair.h_blocks:
                counts[block.param].index_add_(
                    0, block.index.reshape(-1), torch.ones(block.numel, dtype=torch.long)
                )
        return counts

    def _claimed(self) -> dict[str, int]:
        """Entries in pairs per parameter (blocks do not overlap: :meth:`validate`)."""
        claimed = dict.fromkeys(self.parameters, 0)
        for pair in self.pairs:
            for block in pair.g_blocks + pair.h_blocks:
                claimed[block.param] += block.numel
        return claimed

    @property
    def elementwise(self) -> list[str]:
        """Parameters with at least one entry outside every pair."""
        return [
            n for n, c in self._claimed().items() if c < int(torch.Size(self.parameters[n]).numel())
        ]

    def validate(self, max_entries: int = 1 << 26) -> None:
        """Raise if a block points outside its parameter or an entry belongs to two pairs
        (the second check only where pairs hold at most ``max_entries`` entries: it lists
        them)."""
        for pair in self.pairs:
            for block in pair.g_blocks + pair.h_blocks:
                if block.param not in self.parameters:
                    raise ValueError(f"pair {pair.name} uses unknown parameter {block.param!r}")
                size = torch.Size(self.parameters[block.param]).numel()
                lo, hi = block.bounds() if block.numel else (0, 0)
                if block.numel and (lo < 0 or hi >= size):
                    raise ValueError(f"pair {pair.name}: index out of range for {block.param!r}")
        if sum(self._claimed().values()) > max_entries:
            return
        seen: dict[str, Tensor] = {}  # one byte per entry of the parameters in pairs
        for pair in self.pairs:
            for block in pair.g_blocks + pair.h_blocks:
                if block.param not in seen:
                    size = torch.Size(self.parameters[block.param]).numel()
                    seen[block.param] = torch.zeros(size, dtype=torch.bool)
                mask = seen[block.param]
                view = block.view(mask)  # distinct positions, when not None
                if view is not None:
                    twice = bool(view.any())
                else:
                    index = block.index.reshape(-1)
                    twice = bool(mask[index].any()) or index.unique().numel() < index.numel()
                if twice:
                    raise ValueError(
                        f"parameter {block.param!r} has entries claimed by two symmetric "
                        "pairs; each entry may belong to one pair only"
                    )
                if view is not None:
                    view.fill_(True)
                else:
                    mask[index] = True

    def restrict(self, names: Sequence[str]) -> Symmetries:
        """Keep the pairs whose parameters are all in ``names``."""
        keep = set(names)
        return replace(
            self,
            pairs=[p for p in self.pairs if set(p.params) <= keep],
            parameters={n: s for n, s in self.parameters.items() if n in keep},
        )

    def by_module(self) -> dict[str, list[PairSpec]]:
        grouped: dict[str, list[PairSpec]] = defaultdict(list)
        for pair in self.pairs:
            grouped[pair.module].append(pair)
        return dict(grouped)

    def with_pairs(self, *pairs: PairSpec) -> Symmetries:
        """A copy with ``pairs`` added (e.g. from :func:`~geosharp.symmetry.declare_pair`),
        validated; modules named by the new pairs leave ``unrecognized`` and drop their
        unexplained ``dropped`` entries."""
        modules = {p.module for p in pairs}
        out = replace(
            self,
            pairs=[*self.pairs, *pairs],
            parameters=dict(self.parameters),
            unrecognized=[u for u in self.unrecognized if u not in modules],
            dropped=[d for d in self.dropped if d.exact or d.module not in modules],
        )
        out.validate()
        return out

    @property
    def ignored(self) -> dict[str, list[Dropped]]:
        """Per module, the symmetries not used because geosharp did not understand them
        (the modules of :attr:`unrecognized` with their reasons)."""
        out: dict[str, list[Dropped]] = defaultdict(list)
        for d in self.dropped:
            if not d.exact:
                out[d.module].append(d)
        for name in self.unrecognized:
            if name not in out:
                out[name].append(Dropped(name, "all", "module not understood", False))
        return dict(out)

    @property
    def unverified(self) -> list[str]:
        """The pairs used without a numerical check on the model (declared by hand, or
        found without a batch to run): they may not be symmetries."""
        return [p.name for p in self.pairs if p.name not in self.verified]

    def gaps(self) -> list[str]:
        """What keeps a geodesic measure from being symmetry-correct, one phrase each:
        the modules :attr:`ignored` (the first named, with its reason) and the pair
        blocks :attr:`unverified` (the first named); empty where :attr:`complete`."""
        out = []
        ignored, unverified = self.ignored, self.unverified
        if ignored:
            first, drops = next(iter(ignored.items()))
            drop = drops[0]
            reason = drop.reason if drop.kind == "all" else f"{drop.kind}: {drop.reason}"
            out.append(
                f"{len(ignored)} module{'s' * (len(ignored) != 1)} measured element-wise "
                f"because geosharp does not understand their symmetry "
                f"({first or '<root>'}: {reason})"
            )
        if unverified:
            out.append(
                f"{len(unverified)} pair block{'s' * (len(unverified) != 1)} used without "
                f"a numerical check on the model ({unverified[0]})"
            )
        return out

    @property
    def complete(self) -> bool:
        """Whether every symmetry found is used (nothing :attr:`ignored`) and every pair
        used was verified on the model (nothing :attr:`unverified`)."""
        return not self.ignored and not self.unverified

    def summary(self) -> str:
        """Per module, the pairs, their groups and checks, and the pairs dropped with
        their reasons; per layer, the parameters left to the element-wise (adaptive)
        geometry; then the modules whose symmetry is ignored."""
        lines = []
        heads_total = sum(p.shape[0] for p in self.pairs)
        groups = sorted({p.group for p in self.pairs})
        modules = list(dict.fromkeys([*self.attention, *self.by_module()]))
        how = {
            "trace": "found from what a forward pass computes",
            "structure": "found from the modules' structure (no forward pass)",
        }.get(self.discovery, self.discovery)
        checked = sum(1 for p in self.pairs if p.name in self.verified)
        lines.append(
            f"{len(self.pairs)} pair blocks ({heads_total} pairs; groups: "
            f"{', '.join(groups) or 'none'}) in {len(modules)} module"
            f"{'s' * (len(modules) != 1)}; {how}; {checked} of {len(self.pairs)} verified"
        )
        by_module = self.by_module()
        dropped: dict[str, list[Dropped]] = defaultdict(list)
        for d in self.dropped:
            dropped[d.module].append(d)
        for module in modules:
            lines.append(f"{module or '<root>'}")
            for pair in by_module.get(module, []):
                _, n, m, h = pair.shape
                extra = f"  ({pair.note})" if pair.note else ""
                check = self.verified.get(pair.name)
                mark = (
                    "unverified"
                    if check is None
                    else (
                        f"verified {check.change:.0e}" if check.ok else f"FAILED {check.change:.1e}"
                    )
                )
                lines.append(
                    f"    {pair.kind:<14} {pair.group_label:<24} G {n}x{h}, H {m}x{h}  "
                    f"{mark}{extra}"
                )
                lines.append(f"    {'':<14} uses {', '.join(pair.params)}")
            for d in dropped.get(module, []):
                verdict = "no such symmetry" if d.exact else "NOT UNDERSTOOD, ignored"
                lines.append(
                    textwrap.fill(
                        f"{d.kind:<14} dropped ({verdict}): {d.reason}",
                        width=100,
                        initial_indent="    ",
                        subsequent_indent="        ",
                        break_on_hyphens=False,
                    )
                )

        claimed = self._claimed()
        sizes = {n: int(torch.Size(s).numel()) for n, s in self.parameters.items()}
        partial = {n for n, c in claimed.items() if 0 < c < sizes[n]}
        rest = [n for n, c in claimed.items() if c < sizes[n]]
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
        if self.idle:
            lines.append(
                f"not used by the traced batch (their symmetries are unknown; they take no part "
                f"in its loss): {len(self.idle)} parameters, first {self.idle[0]}"
            )
        if self.unrecognized:
            lines.append(
                "NOT RECOGNISED: modules whose symmetries are ignored (their parameters are "
                "element-wise); declare their pairs with geosharp.symmetry.declare_pair or "
                "register_handler:"
            )
            ignored = self.ignored
            for u in self.unrecognized:
                reasons = "; ".join(
                    f"{d.kind}: {d.reason}" if d.kind != "all" else d.reason
                    for d in ignored.get(u, [])
                    if u not in modules or d.kind == "all"
                )
                lines.append(f"    {u}" + (f": {reasons}" if reasons else ""))
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
