"""Declaring a pair by hand: point at the tensors (and slices) that form ``G`` and ``H``.

Every side of a pair is a list of *pieces*, stacked row-wise. A piece is a parameter
(by name, or the tensor itself), optionally with a function that cuts it into shape:
the function receives ``positions(param)`` (``arange`` shaped like the parameter,
see :func:`~geosharp.symmetry.positions`) and applies the same slicing, transposing
and reshaping you would apply to the parameter to get the block, either
``(rows, h)`` (one pair) or ``(heads, rows, h)`` (a stack of pairs).

A low-rank bilinear layer ``y = U (V x)`` (``U``: ``out x r``, ``V``: ``r x in``) is
invariant under ``(U, V^T) -> (U A, V^T A^{-T})``:

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(6, 3, bias=False), nn.Linear(3, 5, bias=False))
>>> pair = declare_pair(model, G=["1.weight"], H=[("0.weight", lambda w: w.T)],
...                     module="0-1", kind="low-rank")
>>> pair.shape  # (heads, n, m, h)
(1, 5, 6, 3)

Fused per-head layouts are one reshape away: for a ``(3 * heads * d, d_in)`` weight
holding (q | k | v), the keys of every head are
``lambda w: w[heads * d : 2 * heads * d].reshape(heads, d, d_in).transpose(1, 2)``.

Use the pairs either directly, ``find_symmetries(model).with_pairs(pair)`` passed as
``sharpness(..., symmetries=...)``, or for every instance of a class through
:func:`~geosharp.symmetry.register_handler`, with a handler that calls
``declare_pair(name_of, ...)`` on the module's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from .pairs import Block, PairSpec, positions

__all__ = ["Piece", "declare_pair"]

Piece = str | Tensor | tuple[str | Tensor, Callable[[Tensor], Tensor]]
"""A parameter (name or tensor), optionally with a function applied to its positions."""


def declare_pair(
    model: nn.Module | Callable[[Tensor], str],
    G: Sequence[Piece],
    H: Sequence[Piece],
    *,
    module: str = "",
    kind: str = "custom",
    group: str = "GL",
    note: str = "",
) -> PairSpec:
    """A :class:`PairSpec` whose ``G`` and ``H`` stack the given pieces row-wise.

    ``model`` resolves parameter names and tensors: the model (names are those of
    ``model.named_parameters()``) or, inside a handler, its ``name_of`` function. A
    bare piece must already be ``(rows, h)`` or ``(heads, rows, h)`` shaped (an
    ``nn.Linear`` weight ``out x in`` is ``G = W`` with ``h = in``, or ``H = W.T`` with
    ``h = out``). ``group`` is ``"GL"`` or ``"rotary"``.

    The pair must really be a symmetry: check it with
    :func:`~geosharp.symmetry.check_symmetries`.
    """
    tensor_of, name_of = _resolvers(model)

    def blocks(pieces: Sequence[Piece], side: str) -> tuple[Block, ...]:
        if not pieces:
            raise ValueError(f"{side} needs at least one piece")
        out = []
        for piece in pieces:
            target, cut = piece if isinstance(piece, tuple) else (piece, None)
            tensor = tensor_of(target)
            index = positions(tensor)
            if cut is not None:
                index = cut(index)
            if not isinstance(index, Tensor) or index.dim() not in (2, 3):
                raise ValueError(
                    f"{side}: a piece of {name_of(tensor)!r} must give a (rows, h) or "
                    f"(heads, rows, h) block, got "
                    f"{tuple(index.shape) if isinstance(index, Tensor) else type(index)}"
                )
            out.append(Block(name_of(tensor), index.reshape((-1, *index.shape[-2:]))))
        return tuple(out)

    return PairSpec(module, kind, blocks(G, "G"), blocks(H, "H"), group=group, note=note)


def _resolvers(
    model: nn.Module | Callable[[Tensor], str],
) -> tuple[Callable[[str | Tensor], Tensor], Callable[[Tensor], str]]:
    if isinstance(model, nn.Module):
        named = dict(model.named_parameters())
        names = {id(t): n for n, t in named.items()}

        def name_of(tensor: Tensor) -> str:
            try:
                return names[id(tensor)]
            except KeyError:
                raise ValueError("a piece is not a parameter of the model") from None

        def tensor_of(target: str | Tensor) -> Tensor:
            if isinstance(target, str):
                if target not in named:
                    raise ValueError(f"unknown parameter {target!r}; see model.named_parameters()")
                return named[target]
            name_of(target)
            return target

        return tensor_of, name_of

    def tensor_of_in_handler(target: str | Tensor) -> Tensor:
        if isinstance(target, str):
            raise TypeError("inside a handler, give the tensors themselves (module.weight)")
        return target

    return tensor_of_in_handler, model
