"""``find_symmetries``: the GL(h) pairs of a model, from what it computes, verified.

Three sources, in order:

1. **Handlers** (:mod:`.registry`): modules whose layout is declared by class or
   structure (``torch.nn.MultiheadAttention``, whose fused kernel hides its
   computation; timm-style attention; peft's LoRA adapters; anything registered with
   :func:`~geosharp.symmetry.register_handler`). They need no forward pass.
2. **The trace** (:mod:`.trace`, :mod:`.assemble`): one forward pass on the user's
   batch (or, for a Hugging Face model, on random inputs that fit its config) shows
   which projections meet in attention scores and which weights read the mixed values,
   whatever the modules and attributes are called, fused or not, with rotary
   embeddings, grouped-query heads, cross-attention, shared layers or position terms.
   A ``meta``-device model is traced on fake tensors: no weights are needed.
3. **Verification** (:mod:`.verify`): every pair, from either source, is transformed by
   a random element of its group on the module that holds it, with the inputs that
   module received; a pair that changes the output is dropped, with a warning naming
   the module.

Attention modules whose symmetry is not used get a reason (:class:`Dropped`): either
the symmetry does not exist (``exact``: normalised queries, clipped values) or
geosharp could not establish it (listed in ``Symmetries.unrecognized``: their
parameters are measured element-wise, so a geodesic measure there is not
symmetry-correct, and the measures say so).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import SymmetryWarning, UsageError, warn_user
from ..params import aliases, swapped
from . import handlers, peft_handlers  # noqa: F401  (register the built-ins)
from .assemble import Assembly, assemble
from .groups import CHECKS
from .inputs import example_inputs
from .pairs import Block, Dropped, PairSpec, Symmetries, orthogonal_part
from .registry import handler_for
from .trace import Tracer
from .verify import LOSS, capture_inputs, sharded_unit, unit_of, verify_pairs

__all__ = ["find_symmetries", "verify_symmetries"]


def find_symmetries(
    model: nn.Module,
    inputs: object = None,
    *,
    loss_fn: Callable[[nn.Module, object], Tensor] | None = None,
    verify: bool = True,
    warn: bool = True,
    cond: float = 10.0,
    seed: int = 0,
) -> Symmetries:
    """Find the parameter symmetries of ``model`` (see the module docstring).

    ``inputs``: one batch, passed as ``model(**inputs)`` (a mapping), ``model(*inputs)``
    (a tuple) or ``model(inputs)``, or as ``loss_fn(model, inputs)`` when ``loss_fn`` is
    given; default: random inputs from the config of a Hugging Face model (without
    them, only handlers apply). ``verify``: check each pair numerically on this batch
    (``cond``: condition number of the random transforms, ``seed``: their generator).
    ``warn``: warn about modules whose symmetry is ignored and about pairs that fail.

    Per attention head a query/key and a value/output pair with biases absorbed (MATH.md
    section 1), of group ``GL(d_head)`` or, under rotary embeddings, the rotary
    subgroup (and ``GL`` on the dimensions a partial rotary embedding leaves alone);
    grouped-query heads stack the query (output) blocks that share a key (value) head;
    LoRA adapters give ``GL(r)`` pairs ``(B, A^T)``. Everything else keeps the
    element-wise (adaptive) geometry. The model is left unchanged.

    >>> import torch
    >>> layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16)
    >>> sym = find_symmetries(layer)
    >>> [(p.kind, p.shape) for p in sym.pairs]  # (heads, n, m, h)
    [('query-key', (2, 9, 9, 4)), ('value-output', (2, 9, 8, 4))]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    named = list(model.named_parameters())
    if not named:
        raise ValueError("the model has no parameters: there is nothing to measure")
    found = _Found(*_handled_pairs(model, _namer(named)))
    meta = any(p.is_meta for _, p in named)
    run = _traced_phase(model, inputs, loss_fn, meta, warn, found)
    candidates = _merged_phase(found)
    checked = run is not None and verify and not meta and bool(candidates)
    if checked:
        _verified_phase(model, run, candidates, found, cond, seed, warn)
    else:  # kept unverified (checked later, on a sharded model); clashes said
        candidates = _structural_phase(candidates, found)
        for i, pair in enumerate(candidates):
            if i < len(found.declared) or not _copy_of_declared(pair, found.declared):
                _kept(pair, found)
    _classified_phase(model, named, found)
    symmetries = _reported_phase(named, found)
    if warn and symmetries.unrecognized:
        warn_user(
            "geosharp does not understand the symmetries of these modules; "
            "their parameters are measured element-wise: "
            + ", ".join(u or "<root>" for u in symmetries.unrecognized)
            + ". See find_symmetries(model).summary(); declare their pairs with "
            "geosharp.symmetry.declare_pair or register_handler if they have any.",
            SymmetryWarning,
        )
    return symmetries


@dataclass
class _Found:
    """What discovery has found so far, phase by phase."""

    declared: list[PairSpec]
    handled: list[str]
    assembly: Assembly | None = None
    discovery: str = "structure"
    failures: list[str] = field(default_factory=list)  # why a trace did not run
    pairs: list[PairSpec] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)
    verified: dict = field(default_factory=dict)
    clashes: dict[str, str] = field(default_factory=dict)
    """Traced pairs that claim entries of another of a different layout, by name: the
    module of the other."""

    @property
    def attention(self) -> list[str]:
        traced = self.assembly.attention if self.assembly is not None else []
        return list(dict.fromkeys([*self.handled, *traced]))


def _namer(named: list[tuple[str, Tensor]]):
    names = {id(p): n for n, p in named}

    def name_of(tensor: Tensor) -> str:
        try:
            return names[id(tensor)]
        except KeyError:
            raise ValueError(
                "a handler pointed at a tensor that is not a parameter of the model"
            ) from None

    return name_of


def _traced_phase(model, inputs, loss_fn, meta: bool, warn: bool, found: _Found):
    """Trace one forward pass (on the batch's first examples where that runs) and
    assemble its events; returns the forward pass to verify on (``None``: none ran)."""
    run = _forward(model, inputs, loss_fn, meta)
    assembly = None
    if run is not None:
        head = _head(inputs) if inputs is not None else None
        small = _forward(model, head, loss_fn, meta) if head is not None else None
        if small is not None:  # the layout does not depend on the batch size
            assembly = _traced(model, small, meta, True, warn=False, failures=found.failures)
        if assembly is None:
            assembly = _traced(
                model, run, meta, inputs is None, warn and inputs is not None, found.failures
            )
    if assembly is None and inputs is None:  # no batch: the Hugging Face models inside
        assembly, run = _traced_parts(model, meta)
    if assembly is not None:
        found.assembly, found.discovery = assembly, "trace"
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        adapters = found.handled + [p.module for p in found.declared]
        found.dropped += [_adapted(d, adapters, trainable) for d in assembly.dropped]
    return run


def _merged_phase(found: _Found) -> list[PairSpec]:
    """The candidates: declared layouts first, then the traced pairs, those that claim
    common entries joined or dropped."""
    traced, found.clashes = _merged(found.assembly.pairs if found.assembly is not None else [])
    return found.declared + traced


def _structural_phase(candidates: list[PairSpec], found: _Found) -> list[PairSpec]:
    """Where no check can run (no weights): the candidates left once those whose
    features went through a function of each element (an activation, a clamp) are
    dropped, exactly: no continuous symmetry survives it."""
    traced = candidates[len(found.declared) :]
    nonlinear = [p for p in traced if _nonlinear(p, found)]
    for pair in nonlinear:
        reason = f"{_subject(pair)} {found.assembly.tainted[pair.name][0]}: not linear in "
        found.dropped.append(Dropped(pair.module, pair.kind, reason + "their projections", True))
    return found.declared + [p for p in traced if p not in nonlinear]


def _nonlinear(pair: PairSpec, found: _Found) -> bool:
    """Whether a traced pair's features went through a function of each element."""
    tainted = found.assembly.tainted if found.assembly is not None else {}
    return tainted.get(pair.name, ("", False, False))[2]


def _copy_of_declared(pair: PairSpec, declared: list[PairSpec]) -> bool:
    return any(_overlap(pair, d) for d in declared)


def _beside_declared(model, pair: PairSpec, declared: list[PairSpec], found: _Found) -> bool:
    """A traced pair that claims entries of a declared one: the trace's copy of it
    (the same entries) is left out silently; a larger one through projections that
    carry adapters (modules a handler declares inside its module) is left out and said,
    as adapters' modules are; ``False`` for any other, which its check decides."""
    if any(_same_entries(pair, d) for d in declared):
        return True
    adapters = found.handled + [p.module for p in found.declared]
    if not any(h.startswith(pair.module + ".") for h in adapters):
        return False  # not through adapters: a candidate like any other
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    reason = "it claims entries of a pair declared for the module (its handler's)"
    found.dropped.append(
        _adapted(Dropped(pair.module, pair.kind, reason, False), adapters, trainable)
    )
    return True


def _same_entries(a: PairSpec, b: PairSpec) -> bool:
    """Whether two pairs hold the same entries on each side (in any blocks)."""

    def entries(blocks):
        return sorted((x.param, tuple(x.index.reshape(-1).sort().values.tolist())) for x in blocks)

    return entries(a.g_blocks) == entries(b.g_blocks) and entries(a.h_blocks) == entries(b.h_blocks)


def _verified_phase(model, run, candidates, found: _Found, cond, seed, warn: bool) -> None:
    """Check every candidate on the model; one that its group refutes is tried in the
    group's orthogonal part, and, failing that, against scalings alone, which decide
    what its drop says."""
    assembly = found.assembly
    uses = _uses(model, assembly.uses if assembly is not None else {})
    ran = assembly.ran if assembly is not None else None
    tainted = assembly.tainted if assembly is not None else {}
    checks = _verify(model, run, candidates, cond, seed, uses, ran)
    # features through a function of each element keep no continuous symmetry: such a
    # candidate is checked for what its drop says, never kept
    nonlinear = {i for i, p in enumerate(candidates) if i >= len(found.declared)
                 and _nonlinear(p, found)}  # fmt: skip
    retry = [i for i, c in enumerate(checks) if c is not None and not c.ok and i not in nonlinear
             and orthogonal_part(candidates[i].group) != candidates[i].group]  # fmt: skip
    smaller = [replace(candidates[i], group=orthogonal_part(candidates[i].group)) for i in retry]
    for i, pair, check in zip(retry, smaller, _verify(model, run, smaller, cond, seed, uses, ran)):
        if check is not None and check.ok and check.conclusive:
            candidates[i], checks[i] = pair, check
            tainted.setdefault(pair.name, ("", True, False))
    failed = [i for i, c in enumerate(checks) if c is not None and not c.ok]
    scalings = _scalings(model, run, [candidates[i] for i in failed], cond, seed, uses, ran)
    kept_declared: list[PairSpec] = []
    for i, (pair, check) in enumerate(zip(candidates, checks)):
        if check is not None and not check.ok:
            continue
        if i in nonlinear:  # the op's nonlinear range is not reached by this batch
            reason = (
                f"{_subject(pair)} {tainted[pair.name][0]}: not linear in their projections "
                "(a check on this batch did not see it: the batch does not reach where the "
                "op bends)"
            )
            found.dropped.append(Dropped(pair.module, pair.kind, reason, exact=True))
            continue
        if i >= len(found.declared) and _copy_of_declared(pair, kept_declared):
            if _beside_declared(model, pair, kept_declared, found):
                continue
        if check is None or not check.conclusive:
            found.dropped.append(Dropped(pair.module, pair.kind, _unverified(check), exact=False))
            if warn:
                warn_user(f"{pair.name}: not used, {_unverified(check)}", SymmetryWarning)
            continue
        if _kept(pair, found):
            if i < len(found.declared):
                kept_declared.append(pair)
            found.verified[pair.name] = check
    for i, scaled in zip(failed, scalings):
        if i >= len(found.declared) and _copy_of_declared(candidates[i], kept_declared):
            if _beside_declared(model, candidates[i], kept_declared, found):
                continue
        if i in nonlinear:
            pair = candidates[i]
            reason = (
                f"{_subject(pair)} {tainted[pair.name][0]}: not linear in their projections, "
                f"so no continuous symmetry survives ({_refuted(checks[i])} of "
                f"{pair.group}({pair.shape[3]}))"
            )
            found.dropped.append(Dropped(pair.module, pair.kind, reason, exact=True))
            continue
        _refuted_candidate(candidates[i], checks[i], tainted.get(candidates[i].name), scaled,
                           found, warn, declared=i < len(found.declared))  # fmt: skip


def _kept(pair: PairSpec, found: _Found) -> bool:
    """Keep a verified pair, unless a verified pair of another layout claims some of its
    entries: then neither is used, and both say why."""
    clash = next((p for p in found.pairs if _overlap(pair, p)), None)
    if clash is None:
        found.pairs.append(pair)
        return True
    found.pairs.remove(clash)
    found.verified.pop(clash.name, None)
    reason = (
        f"{clash.module} and {pair.module} use one parameter in pairs of different "
        "layouts: no joint pair"
    )
    found.dropped += [Dropped(p.module, p.kind, reason, exact=False) for p in (clash, pair)]
    return False


def _scalings(model, run, pairs, cond, seed, uses, ran) -> list[str | None]:
    """Per pair, which scaling leaves the output unchanged (a scale per head, one for
    every head), if one does."""
    out: list[str | None] = [None] * len(pairs)
    for check_group in CHECKS:
        todo = [i for i, s in enumerate(out) if s is None]
        if not todo:
            break
        todo_pairs = [pairs[i] for i in todo]
        modules = dict(model.named_modules())
        inputs = capture_inputs(model, run, [unit_of(p, modules, uses, ran) for p in todo_pairs])
        checks = verify_pairs(model, todo_pairs, inputs, cond=cond, seed=seed, uses=uses,
                              run=run, ran=ran, groups=[check_group] * len(todo))  # fmt: skip
        for i, c in zip(todo, checks):
            if c is not None and c.ok and c.conclusive:
                out[i] = check_group
    return out


def _subject(pair: PairSpec) -> str:
    """What a pair's features are, in a reason."""
    if pair.kind.startswith("value-output"):
        return "values"
    return "its operands" if pair.kind.startswith("product") else "queries and keys"


def _refuted_candidate(pair, check, tainted, scaled, found: _Found, warn, declared) -> None:
    """The drop of a candidate that its group refutes: where its features went through
    an op that is not linear (certain), no symmetry of the known groups exists, which
    the drop says exactly; otherwise one may exist that geosharp does not represent."""
    if declared and any(_overlap(pair, p) for p in found.pairs):
        if warn:
            warn_user(
                f"{pair.name}: dropped, {_refuted(check)}; the layout traced from the forward "
                "pass is used instead",
                SymmetryWarning,
            )
        return
    reason = _refuted(check)
    partner = found.clashes.get(pair.name)
    if partner is not None and not any(p.module == partner for p in found.pairs):
        # both refuted: each may be a part of one symmetry, not said to be none
        reason = (
            f"{pair.module} and {partner} use one parameter in pairs of "
            f"different layouts: no joint pair ({reason})"
        )
    elif tainted is not None and tainted[1] and tainted[0]:
        h = pair.shape[3]
        groups = f"{pair.group}({h}) or {orthogonal_part(pair.group)}({h})"
        rest = (
            f"only {'one scale for all heads' if scaled == 'scalar-shared' else 'a scale per head'}"
            " keeps it, which the element-wise geometry respects"
            if scaled
            else "no scaling keeps it either"
        )
        reason = f"{_subject(pair)} {tainted[0]}: {reason} of {groups}; {rest}"
        found.dropped.append(Dropped(pair.module, pair.kind, reason, exact=True))
        return
    found.dropped.append(Dropped(pair.module, pair.kind, reason, exact=False))
    if warn:
        warn_user(f"{pair.name}: dropped, {reason}", SymmetryWarning)


def _classified_phase(model, named, found: _Found) -> None:
    """Drops for what no verified pair accounts for: features or weight matrices that
    entered an op the trace cannot read, outside every module a handler declared and
    every module already said to be not understood; and, where no forward pass ran,
    every parameter no handler declares."""
    unknown = found.assembly.unknown if found.assembly is not None else []
    features = found.assembly.features if found.assembly is not None else {}
    covered = _runs_union([features[p.name] for p in found.pairs if p.name in features])
    declared = {n for p in found.pairs if p.name not in features for n in p.params}
    paired = {n for p in found.pairs for n in p.params}
    for module, op, params, runs, matrices in unknown:
        said = {d.module for d in found.dropped if not d.exact}
        if any(_inside(module, h) for h in found.handled) or any(_related(module, m) for m in said):
            continue
        projections = params - matrices
        if (_runs_within(runs, covered) or projections <= declared) and matrices <= paired:
            continue
        what = "projection features" if projections else "weight matrices"
        reason = (
            f"{what} of {', '.join(sorted(params)[:2])}"
            f"{' ...' if len(params) > 2 else ''} enter {op}, which the trace cannot look into "
            "(discover with eager or sdpa attention, or declare the pairs)"
        )
        found.dropped.append(Dropped(module, "all", reason, exact=False))
    if found.discovery == "structure":  # nothing ran: what no handler declares is unknown
        outside = [n for n, _ in named if not any(_inside(n, h) for h in found.handled)]
        if outside:
            reason = (
                f"no forward pass ran, so {outside[0]}"
                f"{f' and {len(outside) - 1} more parameters' if len(outside) > 1 else ''} "
                "could not be traced: pass a batch, find_symmetries(model, batch)"
            )
            found.dropped.append(Dropped("", "all", reason, exact=False))


def _reported_phase(named, found: _Found) -> Symmetries:
    """The symmetries found, with what is left out and why."""
    assembly = found.assembly
    unrecognized = list(dict.fromkeys(d.module for d in found.dropped if not d.exact))
    symmetries = Symmetries(
        pairs=found.pairs,
        parameters={n: tuple(p.shape) for n, p in named},
        unrecognized=unrecognized,
        attention=found.attention,
        dropped=found.dropped,
        verified=found.verified,
        discovery=found.discovery,
        trace_error=found.failures[-1] if assembly is None and found.failures else None,
        idle=[]
        if assembly is None
        else [
            n for n, _ in named
            if n not in assembly.uses and not any(_inside(n, h) for h in found.handled)
        ],
    )  # fmt: skip
    symmetries.validate()
    return symmetries


def _runs_union(runs: list[Tensor]) -> Tensor:
    if not runs:
        return torch.zeros(0, 2, dtype=torch.long)
    joined = torch.cat(runs)
    return joined[torch.argsort(joined[:, 0])]


def _runs_within(runs: Tensor, covered: Tensor) -> bool:
    """Whether every id of ``runs`` lies in a run of ``covered`` (sorted by start)."""
    if not len(runs):
        return True
    if not len(covered):
        return False
    reach = torch.cummax(covered[:, 1], 0).values
    for start, stop in runs.tolist():
        i = int(torch.searchsorted(covered[:, 0], torch.tensor(start), right=True)) - 1
        if i < 0 or int(reach[i]) < stop:
            return False
        # every id of [start, stop) covered: walk the runs that start inside it
        position = start
        for a, b in covered[: i + 1].tolist()[::-1]:
            if a <= position < b:
                position = b
                break
        while position < stop:
            j = int(torch.searchsorted(covered[:, 0], torch.tensor(position), right=True)) - 1
            if j < 0 or int(reach[j]) <= position:
                return False
            position = max(position + 1, int(reach[j]))
    return True


def verify_symmetries(
    model: nn.Module,
    symmetries: Symmetries,
    inputs: object,
    *,
    loss_fn: Callable[[nn.Module, object], Tensor] | None = None,
    cond: float = 10.0,
    seed: int = 0,
    agree: Callable[[Tensor], Tensor] | None = None,
) -> Symmetries:
    """``symmetries`` with every :attr:`~Symmetries.unverified` pair (declared by hand,
    or found without a batch) checked on ``inputs`` (passed as in
    :func:`find_symmetries`): a pair that a transform refutes, or whose check is not
    conclusive, is dropped with the reason. The model is left unchanged.

    A model sharded with FSDP2 (every process calls this, ``agree`` the element-wise
    maximum over processes, e.g. :func:`geosharp.distributed.all_reduce_max`): the
    verdicts are agreed, a pair verified where every process verified it and dropped
    where any did not; a pair whose unit holds FSDP modules below it (the whole model)
    is not checked and stays unverified (:func:`~geosharp.symmetry.verify.sharded_unit`)."""
    todo = [p for p in symmetries.pairs if p.name in set(symmetries.unverified)]
    uses = _uses(model, {})
    if agree is not None:
        modules = dict(model.named_modules())
        todo = [p for p in todo if not sharded_unit(model, unit_of(p, modules, uses))]
    if not todo:
        return symmetries
    run = _forward(model, inputs, loss_fn)
    checks = _verify(model, run, todo, cond, seed, uses)
    good = [c is not None and c.ok and c.conclusive for c in checks]
    if agree is not None:  # the same pairs on every process
        failed = agree(torch.tensor([not g for g in good], dtype=torch.float64)) > 0
        good = [g and not f for g, f in zip(good, failed.tolist())]
    verified, dropped, bad = dict(symmetries.verified), list(symmetries.dropped), set()
    for pair, check, ok in zip(todo, checks, good):
        if ok:
            verified[pair.name] = check
            continue
        if check is not None and check.ok and check.conclusive:
            reason = "not verified: its check failed on another process"
        else:
            reason = _unverified(check) if check is None or check.ok else _refuted(check)
        dropped.append(Dropped(pair.module, pair.kind, reason, exact=False))
        bad.add(pair.name)
    modules = [*symmetries.unrecognized, *(p.module for p in todo if p.name in bad)]
    return replace(
        symmetries,
        pairs=[p for p in symmetries.pairs if p.name not in bad],
        verified=verified,
        dropped=dropped,
        unrecognized=list(dict.fromkeys(modules)),
    )


def _handled_pairs(model: nn.Module, name_of) -> tuple[list[PairSpec], list[str]]:
    """Pairs of the modules a handler knows, and those modules."""
    pairs: list[PairSpec] = []
    handled: list[str] = []
    done: list[str] = []  # handled: their descendants are not visited
    for prefix, module in model.named_modules():
        if any(_inside(prefix, d) for d in done):
            continue
        handler = handler_for(module)
        if handler is not None:
            found = handler(module, prefix, name_of)
            pairs.extend(found)
            done.append(prefix)
            handled.append(prefix)
    return pairs, handled


def _forward(
    model: nn.Module, inputs: object, loss_fn, meta: bool = False
) -> Callable[[], object] | None:
    """A function that runs one forward pass, or ``None`` when there is no input (on
    the meta device one short sequence: shapes show the layout, values do not exist)."""
    if inputs is None:
        if loss_fn is not None:
            raise ValueError("loss_fn needs inputs: find_symmetries(model, batch, loss_fn=...)")
        inputs = example_inputs(model, batch=1, length=4) if meta else example_inputs(model)
        if inputs is None:
            return None
    if loss_fn is not None:
        return lambda: loss_fn(model, inputs)
    check_inputs(model, inputs)
    return lambda: call_model(model, inputs)


def check_inputs(model: nn.Module, inputs: object) -> None:
    """One-line error, before anything runs, when ``inputs`` cannot be the model's own
    (passed as in :func:`call_model`): ``forward`` does not take them, or a tuple holds a
    mapping (``(inputs, labels)``, the batch a loss function takes)."""
    how = (
        "model(**batch)" if isinstance(inputs, Mapping)
        else "model(*batch)" if isinstance(inputs, tuple) else "model(batch)"
    )  # fmt: skip
    reason = None
    if isinstance(inputs, tuple) and any(isinstance(x, Mapping) for x in inputs):
        reason = "it holds a dict of inputs beside other items"
    else:
        try:
            signature = inspect.signature(model.forward)
        except (TypeError, ValueError):  # a builtin: nothing to read
            return
        try:
            if isinstance(inputs, Mapping):
                signature.bind(**inputs)
            elif isinstance(inputs, tuple):
                signature.bind(*inputs)
            else:
                signature.bind(inputs)
        except TypeError as err:
            reason = f"model.forward does not take it ({err})"
    if reason is not None:
        raise UsageError(
            f"the batch is passed to the model as {how}, and {reason}: pass the model's own "
            "inputs, or the batch sharpness() takes with its loss_fn= (loss_fn(model, batch))"
        )


def _head(batch: object, n: int = 2) -> object | None:
    """The first ``n`` examples of a batch: every tensor whose first axis has the
    batch's size (the most common first axis) cut to ``n``; ``None`` when the batch is
    no larger or has no tensor. The trace keeps an integer record beside each activation:
    on a few examples it stays small."""
    tensors = [t for t in _tensors_of(batch) if t.dim() > 0]
    if not tensors:
        return None
    sizes = [t.shape[0] for t in tensors]
    size = max(set(sizes), key=sizes.count)
    if size <= n:
        return None

    def cut(x):
        if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == size:
            return x[:n]
        return x

    return tree_map(cut, batch)


def _tensors_of(obj: object) -> list[Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, Tensor)]


def call_model(model: nn.Module, inputs: object) -> object:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple, else
    ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _traced(
    model: nn.Module, run, meta: bool, synthetic: bool, warn: bool, failures: list | None = None
):
    """The pairs found by tracing ``run()``; ``None`` (with a warning) when the trace
    fails although the forward pass itself works, the error's first line appended to
    ``failures``."""
    try:
        with _quiet(), torch.no_grad(), _eval(model):
            if meta:
                tracer = _trace_meta(model, run)
            else:
                tracer = Tracer(model)
                with tracer.running():
                    run()
    except Exception as err:
        if failures is not None:
            failures.append(f"{type(err).__name__}: {err}".splitlines()[0])
        if meta or synthetic:
            reason = "the forward pass on " + ("the meta device" if meta else "random inputs")
            if warn:
                warn_user(
                    f"symmetry discovery could not run {reason} ({type(err).__name__}: {err}); "
                    "pass a batch: find_symmetries(model, batch)"
                )
            return None
        with torch.no_grad(), _eval(model):
            run()  # the model's own error, if it is one
        if warn:
            warn_user(
                f"symmetry discovery could not follow the forward pass ({type(err).__name__}: "
                f"{err}); only declared layouts are used"
            )
        return None
    return assemble(tracer.trace, [n for n, _ in model.named_modules()])


def _traced_parts(model: nn.Module, meta: bool):
    """Without a batch, when the model's own forward pass cannot run on random inputs
    (a wrapper with an unusual signature): each Hugging Face model inside it, traced on
    inputs that fit its config. Returns the assembly of all, and a function that runs
    them all (for verification), or ``(None, None)``."""
    parts = [
        (name, module)
        for name, module in model.named_modules()
        if name
        and getattr(module, "config", None) is not None
        and hasattr(module, "main_input_name")
    ]
    parts = [(n, m) for n, m in parts if not any(n.startswith(o + ".") for o, _ in parts)]
    found, runs = [], []
    for name, part in parts:
        inputs = example_inputs(part)
        if inputs is None:
            continue
        assembly = _traced(part, lambda p=part, x=inputs: call_model(p, x), meta, True, warn=False)
        if assembly is None:
            continue
        found.append(_prefixed(assembly, name, len(found) << 44))
        runs.append(lambda p=part, x=inputs: call_model(p, x))
    if not found:
        return None, None
    merged = Assembly(
        [p for a in found for p in a.pairs],
        [m for a in found for m in a.attention],
        [d for a in found for d in a.dropped],
        {m for a in found for m in a.ran},
        [o for a in found for o in a.opaque],
        {k: v for a in found for k, v in a.uses.items()},
        [u for a in found for u in a.unknown],
        {k: v for a in found for k, v in a.tainted.items()},
        {k: v for a in found for k, v in a.features.items()},
    )
    return merged, lambda: [run() for run in runs]


def _prefixed(assembly: Assembly, prefix: str, offset: int = 0) -> Assembly:
    """An assembly of a sub-model, named from the whole model, its feature ids moved by
    ``offset`` (each sub-model's trace numbers its own from 1)."""

    def name(n: str) -> str:
        return f"{prefix}.{n}" if n else prefix

    def block(b: Block) -> Block:
        return b.renamed(name(b.param))

    pairs = [
        replace(
            p,
            module=name(p.module),
            g_blocks=tuple(map(block, p.g_blocks)),
            h_blocks=tuple(map(block, p.h_blocks)),
        )
        for p in assembly.pairs
    ]
    dropped = [Dropped(name(d.module), d.kind, d.reason, d.exact) for d in assembly.dropped]
    renamed = {p.name: q.name for p, q in zip(assembly.pairs, pairs)}
    return Assembly(
        pairs,
        [name(m) for m in assembly.attention],
        dropped,
        {name(m) for m in assembly.ran},
        [(name(m), op) for m, op in assembly.opaque],
        {name(p): {name(m) if m != LOSS else m for m in ms} for p, ms in assembly.uses.items()},
        [
            (name(m), r, frozenset(map(name, ps)), runs + offset, frozenset(map(name, mats)))
            for m, r, ps, runs, mats in assembly.unknown
        ],
        {renamed[k]: v for k, v in assembly.tainted.items()},
        {renamed[k]: v + offset for k, v in assembly.features.items()},
    )


def _trace_meta(model: nn.Module, run) -> Tracer:
    """Trace a ``meta``-device model (shapes only): on its meta tensors, with a reduction
    that a Python branch reads (``if mask.all():``) answering ``False``; where the
    forward pass needs more than that, on fake tensors (slower)."""
    try:
        tracer = Tracer(model, meta=True)
        with tracer.running():
            run()
        return tracer
    except Exception:
        pass
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    params = {n: fake.from_tensor(p) for n, p in model.named_parameters()}
    buffers = {n: fake.from_tensor(b) for n, b in model.named_buffers()}
    tracer = Tracer(model, tensors=params, buffers=buffers, fake=True)
    with tracer.running(), fake, swapped(model, {**params, **buffers}):
        run()
    return tracer


def _verify(model, run, pairs, cond, seed, uses, ran=None):
    """The check of each pair (``None`` where its unit did not run)."""
    if not pairs:
        return []
    modules = dict(model.named_modules())
    inputs = capture_inputs(model, run, [unit_of(p, modules, uses, ran) for p in pairs])
    return verify_pairs(model, pairs, inputs, cond=cond, seed=seed, uses=uses, run=run, ran=ran)


def _uses(model: nn.Module, traced: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """Per parameter (by its first name), every module that holds it under any name
    and every module whose forward used it in the trace."""
    out = {
        names[0]: {n.rsplit(".", 1)[0] if "." in n else "" for n in names}
        for _, names in aliases(model)
    }
    for name, modules in traced.items():
        out.setdefault(name, set()).update(modules)
    return out


def _unit_name(unit: str) -> str:
    return {"": "the model", LOSS: "the loss"}.get(unit, unit)


def _refuted(check) -> str:
    return (
        f"a transform in its group changes the output of {_unit_name(check.unit)} by "
        f"{check.change:.1e} (relative, {check.dtype}; tolerance {check.tolerance:.0e}): "
        "not a symmetry"
    )


def _unverified(check) -> str:
    if check is None:
        return "not verified: the module holding it did not run on this batch"
    return (
        f"not verified: the output of {_unit_name(check.unit)} barely depends on it (a "
        f"transform that is not a symmetry moved it by {check.power:.1e}, under 100 times "
        f"the tolerance {check.tolerance:.0e})"
    )


def _merged(pairs: list[PairSpec]) -> tuple[list[PairSpec], dict[str, str]]:
    """Traced pairs that claim common entries (one projection module shared by two
    layers): one joint pair where one side's blocks are the same (the other sides
    stacked), else both kept for verification and their clash recorded (per pair name,
    the module of the other)."""
    out: list[PairSpec] = []
    clashes: dict[str, str] = {}
    for pair in pairs:
        clash = next((i for i, p in enumerate(out) if _overlap(pair, p)), None)
        if clash is None:
            out.append(pair)
            continue
        other = out[clash]
        joint = None
        if other.group == pair.group and other.kind == pair.kind:
            if _same_blocks(other.g_blocks, pair.g_blocks):
                joint = (other.g_blocks, other.h_blocks + pair.h_blocks)
            elif _same_blocks(other.h_blocks, pair.h_blocks):
                joint = (other.g_blocks + pair.g_blocks, other.h_blocks)
        if joint is not None:
            try:
                out[clash] = replace(
                    other, g_blocks=joint[0], h_blocks=joint[1],
                    note=f"shared with {pair.module}",
                )  # fmt: skip
                continue
            except ValueError:
                pass
        clashes[pair.name], clashes[other.name] = other.module, pair.module
        out.append(pair)  # verification decides; two that both hold are said
    return out, clashes


def _same_blocks(a: tuple[Block, ...], b: tuple[Block, ...]) -> bool:
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


def _overlap(a: PairSpec, b: PairSpec) -> bool:
    """Whether two pairs claim a common parameter entry."""
    common = set(a.params) & set(b.params)
    for name in common:
        ia = torch.cat([x.index.reshape(-1) for x in a.g_blocks + a.h_blocks if x.param == name])
        ib = torch.cat([x.index.reshape(-1) for x in b.g_blocks + b.h_blocks if x.param == name])
        if bool(torch.isin(ia, ib).any()):
            return True
    return False


def _adapted(d: Dropped, handled: list[str], trainable: set[str]) -> Dropped:
    """A trace drop inside a module whose adapters (LoRA) a handler claims: the
    adapters' own pairs are used there, by design (docs/architectures.md). With frozen
    base weights (those of the adapters' ``base_layer``) nothing is lost; with trainable
    ones the attention symmetry that would include them is ignored, and the drop says
    so."""
    if d.exact or not any(h.startswith(d.module + ".") for h in handled):
        return d
    bases = [f"{h}.base_layer." for h in handled if h.startswith(d.module + ".")]
    base = [n for n in trainable if any(n.startswith(b) for b in bases)]
    if base:
        reason = (
            "its projections carry adapters (LoRA) and their base weights are trainable: "
            "the attention pair that would hold them is left out and they are measured "
            "element-wise (freeze them, or merge the adapters)"
        )
        return Dropped(d.module, d.kind, reason, exact=False)
    reason = "its projections carry adapters (LoRA), whose own pairs are used instead"
    return Dropped(d.module, d.kind, reason, exact=True)


def _related(a: str, b: str) -> bool:
    return _inside(a, b) or _inside(b, a)


def _inside(name: str, ancestor: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


@contextlib.contextmanager
def _eval(model: nn.Module):
    from ..params import evaluation_mode

    with evaluation_mode(model):
        yield


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
