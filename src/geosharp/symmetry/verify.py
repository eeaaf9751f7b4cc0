r"""Verify pairs numerically on the user's model, module by module.

A pair is a symmetry when ``(G, H) -> (G A, H A^{-T})`` leaves the model's function
unchanged for every ``A`` in its group. Each pair is checked on the smallest module
holding all its parameters (its *unit*, e.g. one attention layer), with the inputs
that module received in a forward pass of the model: one forward of the unit with
the pair transformed by a random element of condition number ``cond``, compared with
one forward untransformed (shared by the unit's pairs), in float64 where the unit
runs in it (else in its own precision). A second transform, ``G -> G A`` alone, which
is not a symmetry, measures whether the unit's output depends on the pair enough for
the check to tell (:attr:`~geosharp.symmetry.pairs.Verification.conclusive`).

The model is never changed: the unit runs functionally (``torch.func.functional_call``)
on float64 copies of its own tensors only, so no copy of the whole model is made.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from ..params import evaluation_mode
from .groups import random_group_elements, read_block, write_block
from .pairs import PairSpec, Verification

__all__ = ["TOLERANCE", "capture_inputs", "unit_of", "verify_pairs"]

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
"""Largest relative output change of a symmetry, per precision (others: 3e-2). In
float64 it leaves room for modules that compute part of their attention in float32
(transformers does for GPT-Neo, GPT-J, CodeGen, Cohere, ModernBERT: 1e-7); a pair that
is not a symmetry moves the output by as much as a transform of ``G`` alone."""

_CACHE_KEYS = ("past_key_value", "past_key_values", "layer_past", "cache_params", "cache")


def unit_of(pair: PairSpec, modules: Sequence[str] | None = None) -> str:
    """The smallest module that holds every parameter of ``pair`` and the module the
    pair belongs to (``pair.module``: a fused ``qkv`` projection alone is not invariant,
    its attention is); ``""``: the model. With ``modules`` (the model's module names),
    the nearest of them at or above."""
    parts = [p.split(".")[:-1] for p in pair.params]
    parts.append(pair.module.split(".") if pair.module else [])
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if modules is not None:
        known = set(modules)
        while common and ".".join(common) not in known:
            common.pop()
    return ".".join(common)


def capture_inputs(
    model: nn.Module, run: Callable[[], object], units: Sequence[str]
) -> dict[str, tuple[tuple, dict]]:
    """The ``(args, kwargs)`` of the first call of each module named in ``units`` during
    ``run()`` (the model in eval mode, without gradients)."""
    modules = dict(model.named_modules())
    captured: dict[str, tuple[tuple, dict]] = {}
    handles = []

    def hook_for(name: str):
        def hook(_module, args, kwargs):
            if name not in captured:
                captured[name] = (args, dict(kwargs))

        return hook

    for name in dict.fromkeys(units):
        handles.append(modules[name].register_forward_pre_hook(hook_for(name), with_kwargs=True))
    try:
        with evaluation_mode(model), torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return captured


def verify_pairs(
    model: nn.Module,
    pairs: Sequence[PairSpec],
    inputs: Mapping[str, tuple[tuple, dict]],
    cond: float = 10.0,
    seed: int = 0,
) -> list[Verification | None]:
    """Check every pair whose unit's inputs were captured (see the module docstring);
    returns the checks in the order of ``pairs`` (``None``: its unit did not run)."""
    modules = dict(model.named_modules())
    by_unit: dict[str, list[int]] = defaultdict(list)
    for i, pair in enumerate(pairs):
        by_unit[unit_of(pair, modules)].append(i)
    generator = torch.Generator().manual_seed(seed)
    out: list[Verification | None] = [None] * len(pairs)
    with evaluation_mode(model), torch.no_grad():
        for unit, indices in by_unit.items():
            if unit not in inputs:
                continue
            args, kwargs = inputs[unit]
            unit_pairs = [pairs[i] for i in indices]
            elements = [
                random_group_elements(p.group, p.shape[0], p.shape[3], cond, generator)
                for p in unit_pairs
            ]
            try:
                checks = _check_unit(modules[unit], unit, unit_pairs, args, kwargs, elements, True)
            except Exception:  # the unit does not run in float64: its own precision
                checks = _check_unit(modules[unit], unit, unit_pairs, args, kwargs, elements, False)
            for i, check in zip(indices, checks):
                out[i] = check
    return out


def _check_unit(module, unit, pairs, args, kwargs, elements, float64: bool) -> dict:
    prefix = f"{unit}." if unit else ""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    dtype = _dtype(tensors)
    if float64:
        dtype = torch.float64
    tensors = {n: _cast(t, dtype) for n, t in tensors.items()}
    args, kwargs = _inputs(args, kwargs, dtype)
    tolerance = TOLERANCE.get(dtype, 3e-2)

    def output(values: dict[str, Tensor]) -> list[Tensor]:
        # the same random numbers in every call: a module that draws some in eval mode
        # (ViT-MAE's masking) is compared with itself
        devices = [t.device for t in values.values() if t.device.type == "cuda"][:1]
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            result = torch.func.functional_call(module, values, tuple(args), dict(kwargs))
        return [
            t for t in tree_flatten(result)[0] if isinstance(t, Tensor) and t.is_floating_point()
        ]

    reference = output(tensors)
    if not reference:
        raise TypeError(f"{unit or 'the model'} returns no floating-point tensor to compare")
    scale = max(float(r.abs().max()) for r in reference) or 1.0

    def change(values: dict[str, Tensor]) -> float:
        moved = output(values)
        return max(float((a - b).abs().max()) for a, b in zip(moved, reference)) / scale

    checks = []
    for pair, A in zip(pairs, elements):
        A = A.to(dtype=torch.float64)
        symmetric = _acted(tensors, pair, prefix, A, torch.linalg.inv(A).transpose(-1, -2))
        control = _acted(tensors, pair, prefix, A, None)
        checks.append(
            Verification(
                pair.name,
                unit,
                change({**tensors, **symmetric}),
                change({**tensors, **control}),
                tolerance,
                str(dtype).removeprefix("torch."),
            )
        )
    return checks


def _acted(
    tensors: dict[str, Tensor], pair: PairSpec, prefix: str, A: Tensor, B: Tensor | None
) -> dict[str, Tensor]:
    """New copies of the pair's tensors with ``G -> G A`` and ``H -> H B`` (``B = None``:
    ``H`` unchanged), keyed by the unit's local names."""
    names = [n.removeprefix(prefix) for n in pair.params]
    flat = {n: tensors[n].detach().clone().reshape(-1) for n in names}
    local = {b.param: b.param.removeprefix(prefix) for b in pair.g_blocks + pair.h_blocks}
    view = {p: flat[local[p]] for p in local}
    for blocks, M in ((pair.g_blocks, A), (pair.h_blocks, B)):
        if M is None:
            continue
        X = torch.cat([read_block(view, b) for b in blocks], dim=1).to(torch.float64)
        X = X @ M.to(X.device)
        row = 0
        for b in blocks:
            write_block(view, b, X[:, row : row + b.shape[1]])
            row += b.shape[1]
    return {n: flat[n].view(tensors[n].shape) for n in names}


def _dtype(tensors: dict[str, Tensor]) -> torch.dtype:
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    return floats[0] if floats else torch.float32


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.detach().to(dtype) if t.is_floating_point() else t.detach()


def _inputs(args, kwargs, dtype: torch.dtype):
    """The captured inputs in ``dtype`` (floating tensors only), caches dropped: a cache
    filled by the first call would be filled again."""

    def cast(x):
        if isinstance(x, Tensor) and x.is_floating_point():
            return x.detach().to(dtype)
        if _is_cache(x):
            return None
        return x

    kwargs = {k: (None if k in _CACHE_KEYS or _is_cache(v) else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    args = tuple(None if _is_cache(a) else a for a in args)
    return tree_map(cast, args, is_leaf=_is_cache), tree_map(cast, kwargs, is_leaf=_is_cache)


def _is_cache(x: object) -> bool:
    return "Cache" in type(x).__name__ and hasattr(x, "update")
