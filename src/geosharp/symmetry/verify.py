r"""Verify pairs numerically on the user's model, where the answer is true for the model.

A pair is a symmetry when ``(G, H) -> (G A, H A^{-T})`` leaves the model's function
unchanged for every ``A`` in its group. Each pair is checked on its *unit*: the
smallest module that holds every use of its parameters (every name a parameter or
its module is registered under, and every module in which the traced forward pass
used it: a weight tied to the output head, a projection shared by two layers, a
branch outside the attention widen the unit, up to the whole model; a use outside
the model's forward, in ``loss_fn``, makes the unit the loss itself, ``"<loss>"``).
The unit runs on the inputs it received in a forward pass of the model, once
untransformed, once with the pair transformed by a random element of condition number
``cond``, and once with ``G -> G A`` alone, which is not a symmetry: the *control*.
The unit runs in float64 where it can (else in its own precision).

The change is measured entry by entry over the finite entries of every output
(masked logits, ``-inf`` or ``-1e9``, say nothing): ``|y' - y| / (|y| + s)``, with
``s`` the largest change the control makes, its largest value the change. The
tolerance is what the precision resolves on that unit and that pair:
``c * max(eps * cond * kappa, floor)``, ``eps`` of the lowest precision the unit
computes in (GPT-Neo computes part of its attention in float32 inside a float64
model), ``kappa`` the pair's own cancellation ``max_head |G|_F |H|_F / |G H^T|_F``
(large on a badly balanced, re-parameterised copy), ``floor`` the change made by
multiplying the pair's entries by ``1 +- eps cond`` (random signs): the unit's own
round-off, which the transformed entries carry too and the first term can miss. A
check is *conclusive* only when the control moves the output by 100 times the
tolerance or more; a pair whose check is not conclusive is not called verified.

The model is never changed: the unit computes with copies swapped in for the
duration (:func:`~geosharp.params.swapped`), and every object is put back.

On a model sharded with FSDP2, a unit is checked on a copy of it without FSDP's hooks
(the user's kept) whose parameters are all-gathered (:func:`~geosharp.params.plain_copy`;
every process gathers the same units in the same order): one layer's weights at a
time. A unit that holds FSDP modules below it (the model itself, where a weight is tied
across layers) or is the loss is not checked (:func:`sharded_unit`): it would gather
the whole model.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ..params import evaluation_mode, plain_copy, swapped
from ..rng import seeded
from .groups import random_group_elements, read_block, write_block
from .pairs import PairSpec, Verification

__all__ = [
    "LOSS",
    "TOLERANCE_FACTOR",
    "capture_inputs",
    "sharded_unit",
    "unit_of",
    "verify_pairs",
]

LOSS = "<loss>"
"""The unit of a pair whose parameters are used outside the model's forward."""

TOLERANCE_FACTOR = 4.0
"""``c`` in the tolerance ``c * max(eps * cond * kappa, floor)`` (module docstring)."""

_CACHE_KEYS = ("past_key_value", "past_key_values", "layer_past", "cache_params", "cache")


def unit_of(
    pair: PairSpec,
    modules: Sequence[str] | None = None,
    uses: Mapping[str, set[str]] | None = None,
    ran: set[str] | None = None,
) -> str:
    """The smallest module that holds ``pair.module`` and every use of the pair's
    parameters; ``""``: the model, :data:`LOSS`: the loss (a use outside the model's
    forward). ``uses``: per parameter name, every module that holds or used it (its
    aliases' modules and the trace's uses). With ``modules`` (the model's module
    names), the nearest of them at or above; with ``ran``, the nearest whose forward
    ran (a ``ModuleList`` holds layers but is never called)."""
    places = [pair.module]
    for name in pair.params:
        places.append(name.rsplit(".", 1)[0] if "." in name else "")
        places.extend((uses or {}).get(name, ()))
    if LOSS in places:
        return LOSS
    parts = [p.split(".") if p else [] for p in places]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if modules is not None:
        known = set(modules) if ran is None else set(modules) & set(ran)
        while common and ".".join(common) not in known:
            common.pop()
    return ".".join(common)


def sharded_unit(model: nn.Module, unit: str) -> bool:
    """Whether ``unit`` of a model sharded with FSDP2 is too large to check: it holds
    FSDP modules below it, or is the loss of a sharded model."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    if unit == LOSS:
        return any(isinstance(m, FSDPModule) for m in model.modules())
    module = dict(model.named_modules())[unit]
    return any(isinstance(m, FSDPModule) for m in module.modules() if m is not module)


def capture_inputs(
    model: nn.Module, run: Callable[[], object], units: Sequence[str]
) -> dict[str, tuple[tuple, dict]]:
    """The ``(args, kwargs)`` of the first call of each module named in ``units`` during
    ``run()`` (the model in eval mode, without gradients); :data:`LOSS` is captured as
    ``run`` itself."""
    modules = dict(model.named_modules())
    captured: dict[str, tuple[tuple, dict]] = {}
    handles = []

    def hook_for(name: str):
        def hook(_module, args, kwargs):
            if name not in captured:
                captured[name] = (args, dict(kwargs))

        return hook

    for name in dict.fromkeys(units):
        if name == LOSS:
            captured[LOSS] = ((), {})
            continue
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
    uses: Mapping[str, set[str]] | None = None,
    run: Callable[[], object] | None = None,
    ran: set[str] | None = None,
    groups: Sequence[str] | None = None,
) -> list[Verification | None]:
    """Check every pair whose unit's inputs were captured (see the module docstring);
    returns the checks in the order of ``pairs`` (``None``: its unit did not run).
    ``run``: the forward pass, for pairs whose unit is :data:`LOSS`; ``groups``: per
    pair, the group whose elements to try instead of its own (a subgroup, or a check of
    :data:`~geosharp.symmetry.groups.CHECKS`)."""
    modules = dict(model.named_modules())
    by_unit: dict[str, list[int]] = defaultdict(list)
    for i, pair in enumerate(pairs):
        by_unit[unit_of(pair, modules, uses, ran)].append(i)
    generator = torch.Generator().manual_seed(seed)
    out: list[Verification | None] = [None] * len(pairs)
    with evaluation_mode(model), torch.no_grad():
        for unit, indices in by_unit.items():
            if unit not in inputs or (unit == LOSS and run is None) or sharded_unit(model, unit):
                continue
            args, kwargs = inputs[unit]
            unit_pairs = [pairs[i] for i in indices]
            elements = [
                random_group_elements(
                    p.group if groups is None else groups[i],
                    p.shape[0],
                    p.shape[3],
                    cond,
                    generator,
                )
                for i, p in zip(indices, unit_pairs)
            ]
            if unit == LOSS:
                target, prefix = model, ""
            else:
                target, prefix = modules[unit], f"{unit}." if unit else ""
            check = _UnitCheck(target, unit, prefix, args, kwargs, run if unit == LOSS else None)
            checks = check.pairs(unit_pairs, elements, cond)
            for i, c in zip(indices, checks):
                out[i] = c
    return out


class _UnitCheck:
    """One unit, run on its captured inputs with tensors swapped in."""

    def __init__(self, module, unit, prefix, args, kwargs, run):
        self.module, self.unit, self.prefix, self.run = module, unit, prefix, run
        if any(hasattr(p, "full_tensor") for p in module.parameters()):  # sharded
            module = self.module = plain_copy(module, _whole)
        own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        native = _dtype(own)
        if run is None:
            try:  # float64 where the unit runs in it
                self._prepare(own, args, kwargs, torch.float64)
                self.reference = self.output(self.tensors)
                return
            except Exception:
                pass
        self._prepare(own, args, kwargs, native)
        self.reference = self.output(self.tensors)

    def _prepare(self, own, args, kwargs, dtype):
        self.dtype = dtype
        self.tensors = {n: _cast(t, dtype) for n, t in own.items()}
        self.args, self.kwargs = _inputs(args, kwargs, dtype)
        self.lowest = dtype

    def output(self, values: dict[str, Tensor]) -> list[Tensor]:
        # the same random numbers in every call: a module that draws some in eval mode
        # (ViT-MAE's masking) is compared with itself
        with seeded(0, (t.device for t in values.values())), _Precision() as precision:
            with swapped(self.module, values):
                result = (
                    self.run() if self.run is not None else self.module(*self.args, **self.kwargs)
                )
        self.lowest = max([self.lowest, *precision.dtypes], key=_eps)
        tensors = [
            t.detach()
            for t in tree_flatten(result)[0]
            if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())
        ]
        if not tensors:
            raise TypeError(f"{self.unit or 'the model'} returns no floating-point tensor")
        return tensors

    def pairs(self, pairs, elements, cond: float) -> list[Verification]:
        checks = []
        for pair, A in zip(pairs, elements):
            A = A.to(dtype=torch.float64)
            B = torch.linalg.inv(A).transpose(-1, -2)
            moved = self.output({**self.tensors, **_acted(self.tensors, pair, self.prefix, A, B)})
            control = self.output({**self.tensors, **_acted(self.tensors, pair, self.prefix, A)})
            change, power = _changes(self.reference, moved, control)
            kappa = _cancellation(self.tensors, pair, self.prefix)
            # the unit's own round-off: the change made by rounding-sized noise on the
            # pair's entries, which the transformed entries carry too
            noise = _eps(self.dtype) * cond
            jittered = self.output(
                {**self.tensors, **_jittered(self.tensors, pair, self.prefix, noise)}
            )
            floor, _ = _changes(self.reference, jittered, control)
            tolerance = TOLERANCE_FACTOR * max(_eps(self.lowest) * cond * kappa, floor)
            tolerance = min(tolerance, 1e-2)
            checks.append(
                Verification(
                    pair.name,
                    self.unit,
                    change,
                    power,
                    tolerance,
                    str(self.dtype).removeprefix("torch."),
                )
            )
        return checks


def _changes(reference, moved, control) -> tuple[float, float]:
    """The pair's change and the control's, entry by entry relative to
    ``|y| + s`` over finite entries, ``s`` the control's largest change (``inf``: the
    transform changed which entries are finite)."""
    if len(moved) != len(reference) or any(a.shape != b.shape for a, b in zip(moved, reference)):
        return math.inf, math.inf
    deltas, power_inf = [], False
    for r, c in zip(reference, control):
        finite = torch.isfinite(r)
        if c.shape != r.shape or not torch.equal(torch.isfinite(c), finite):
            power_inf = True
            continue
        deltas.append(((c - r).abs()[finite], r.abs()[finite]))
    s = max((float(d.max()) for d, _ in deltas if d.numel()), default=0.0)
    s = s if s > 0 else 1e-300

    def relative(outputs) -> float:
        worst = 0.0
        for r, y in zip(reference, outputs):
            finite = torch.isfinite(r)
            if not torch.equal(torch.isfinite(y), finite):
                return math.inf
            if bool(finite.any()):
                d = (y - r).abs()[finite] / (r.abs()[finite] + s)
                worst = max(worst, float(d.max()))
        return worst

    return relative(moved), (math.inf if power_inf else relative(control))


def _cancellation(tensors: dict[str, Tensor], pair: PairSpec, prefix: str) -> float:
    """``max_head |G|_F |H|_F / |G H^T|_F``: how much the pair's product cancels (at
    least 1; large for a badly balanced pair)."""
    blocks = pair.g_blocks + pair.h_blocks
    local = {b.param: tensors[b.param.removeprefix(prefix)].reshape(-1) for b in blocks}
    G = torch.cat([read_block(local, b) for b in pair.g_blocks], dim=-2).to(torch.float64)
    H = torch.cat([read_block(local, b) for b in pair.h_blocks], dim=-2).to(torch.float64)
    norms = torch.linalg.matrix_norm(G) * torch.linalg.matrix_norm(H)
    # |G H^T|_F^2 = <G^T G, H^T H>: h x h Gram matrices instead of the n x m product,
    # exact to about eps |G|^2 |H|^2 (a relative 10^-8 of it at a ratio of 10^4); at a
    # larger ratio, the product itself
    square = (G.transpose(-1, -2) @ G * (H.transpose(-1, -2) @ H)).sum((-2, -1))
    ratio = norms / square.clamp_min(0).sqrt().clamp_min(1e-300)
    if float(ratio.max()) > 1e4:
        product = torch.linalg.matrix_norm(G @ H.transpose(-1, -2))
        ratio = norms / product.clamp_min(1e-300)
    return max(1.0, float(ratio.max()))


def _acted(
    tensors: dict[str, Tensor], pair: PairSpec, prefix: str, A: Tensor, B: Tensor | None = None
) -> dict[str, Tensor]:
    """New copies of the pair's tensors with ``G -> G A`` and ``H -> H B`` (``B = None``:
    ``H`` unchanged), keyed by the unit's local names."""

    def act(view: dict[str, Tensor]) -> None:
        for blocks, M in ((pair.g_blocks, A), (pair.h_blocks, B)):
            if M is None:
                continue
            X = torch.cat([read_block(view, b) for b in blocks], dim=1).to(torch.float64)
            X = X @ M.to(X.device)
            row = 0
            for b in blocks:
                write_block(view, b, X[:, row : row + b.shape[1]])
                row += b.shape[1]

    return _changed_copies(tensors, pair, prefix, act)


def _jittered(
    tensors: dict[str, Tensor], pair: PairSpec, prefix: str, noise: float
) -> dict[str, Tensor]:
    """New copies of the pair's tensors with every ``G`` and ``H`` entry multiplied by
    ``1 +- noise`` (random signs, the same on every call), keyed by the unit's local names."""

    def jitter(view: dict[str, Tensor]) -> None:
        for b in pair.g_blocks + pair.h_blocks:
            X = read_block(view, b)
            generator = torch.Generator(device=X.device).manual_seed(0)
            factor = torch.randint(0, 2, X.shape, generator=generator, device=X.device)
            factor = factor.to(X.dtype).mul_(2 * noise).add_(1 - noise)  # 1 +- noise
            write_block(view, b, X.mul_(factor))

    return _changed_copies(tensors, pair, prefix, jitter)


def _changed_copies(
    tensors: dict[str, Tensor], pair: PairSpec, prefix: str, change
) -> dict[str, Tensor]:
    """New copies of the pair's tensors, keyed by the unit's local names, after
    ``change(view)`` wrote into them (``view``: flat views keyed by the pair's names)."""
    names = [n.removeprefix(prefix) for n in pair.params]
    flat = {n: tensors[n].detach().clone().reshape(-1) for n in names}
    change({b.param: flat[b.param.removeprefix(prefix)] for b in pair.g_blocks + pair.h_blocks})
    return {n: flat[n].view(tensors[n].shape) for n in names}


class _Precision(TorchFunctionMode):
    """Records the floating dtypes of every result computed inside."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.is_floating_point():
                self.dtypes.add(t.dtype)
        return out


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _dtype(tensors: dict[str, Tensor]) -> torch.dtype:
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    return floats[0] if floats else torch.float32


def _whole(t: Tensor) -> Tensor:
    """A sharded parameter (a ``DTensor``) all-gathered, anything else as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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
