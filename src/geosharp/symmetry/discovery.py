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
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import SymmetryWarning
from ..params import aliases, swapped
from . import handlers, peft_handlers  # noqa: F401  (register the built-ins)
from .assemble import Assembly, assemble
from .inputs import example_inputs
from .pairs import Block, Dropped, PairSpec, Symmetries
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
    names = {id(p): n for n, p in named}

    def name_of(tensor: Tensor) -> str:
        try:
            return names[id(tensor)]
        except KeyError:
            raise ValueError(
                "a handler pointed at a tensor that is not a parameter of the model"
            ) from None

    declared, handled = _handled_pairs(model, name_of)
    meta = any(p.is_meta for _, p in named)
    run = _forward(model, inputs, loss_fn, meta)
    attention: list[str] = list(handled)
    dropped: list[Dropped] = []
    traced: list[PairSpec] = []
    unknown: list[tuple[str, str, frozenset[str]]] = []
    discovery = "structure"
    assembly = None
    failures: list[str] = []  # why a trace did not run, the last attempt's last
    if run is not None:
        head = _head(inputs) if inputs is not None else None
        small = _forward(model, head, loss_fn, meta) if head is not None else None
        if small is not None:  # the layout does not depend on the batch size
            assembly = _traced(model, small, meta, True, warn=False, failures=failures)
        if assembly is None:
            assembly = _traced(
                model, run, meta, inputs is None, warn and inputs is not None, failures
            )
    if assembly is None and inputs is None:  # no batch: the Hugging Face models inside
        assembly, run = _traced_parts(model, meta)
    if assembly is not None:
        discovery = "trace"
        traced = assembly.pairs
        unknown = assembly.unknown
        attention += [a for a in assembly.attention if a not in attention]
        trainable = {n for n, p in named if p.requires_grad}
        adapters = handled + [p.module for p in declared]
        dropped += [_adapted(d, adapters, trainable) for d in assembly.dropped]

    traced, merged_drops = _merged(traced)
    dropped += merged_drops
    candidates = declared + traced  # declared layouts first
    checks = [None] * len(candidates)
    checked = run is not None and verify and not meta and bool(candidates)
    if checked:
        uses = _uses(model, assembly.uses if assembly is not None else {})
        ran = assembly.ran if assembly is not None else None
        checks = _verify(model, run, candidates, cond, seed, uses, ran)
    pairs, failed, kept_declared = [], [], []
    verified = {}
    for i, (pair, check) in enumerate(zip(candidates, checks)):
        if check is not None and not check.ok:
            failed.append((pair, check))
            continue
        if i >= len(declared) and any(_overlap(pair, d) for d in kept_declared):
            continue  # the trace's copy of a declared pair
        if checked and (check is None or not check.conclusive):
            dropped.append(Dropped(pair.module, pair.kind, _unverified(check), exact=False))
            if warn:
                warnings.warn(
                    f"{pair.name}: not used, {_unverified(check)}", SymmetryWarning, stacklevel=2
                )
            continue
        pairs.append(pair)
        if i < len(declared):
            kept_declared.append(pair)
        if check is not None:
            verified[pair.name] = check
    for pair, check in failed:
        reason = _refuted(check)
        if any(_overlap(pair, p) for p in pairs):
            if warn:
                warnings.warn(
                    f"{pair.name}: dropped, {reason}; the layout traced from the forward pass "
                    "is used instead",
                    SymmetryWarning,
                    stacklevel=2,
                )
            continue
        dropped.append(Dropped(pair.module, pair.kind, reason, exact=False))
        if warn:
            warnings.warn(f"{pair.name}: dropped, {reason}", SymmetryWarning, stacklevel=2)

    # features that entered an op the trace cannot look into: not understood, unless
    # every parameter they come from is in a verified pair or a module already said so
    paired = {n for p in pairs for n in p.params}
    for module, op, params in unknown:
        said = {d.module for d in dropped if not d.exact}
        if params <= paired or any(_related(module, m) for m in said):
            continue
        reason = (
            f"projection features of {', '.join(sorted(params)[:2])}"
            f"{' ...' if len(params) > 2 else ''} enter {op}, which the trace cannot look into "
            "(discover with eager or sdpa attention, or declare the pairs)"
        )
        dropped.append(Dropped(module, "all", reason, exact=False))
    if discovery == "structure":  # nothing ran: what no handler declares is unknown
        outside = [n for n, _ in named if not any(_inside(n, h) for h in handled)]
        if outside:
            reason = (
                f"no forward pass ran, so {outside[0]}"
                f"{f' and {len(outside) - 1} more parameters' if len(outside) > 1 else ''} "
                "could not be traced: pass a batch, find_symmetries(model, batch)"
            )
            dropped.append(Dropped("", "all", reason, exact=False))
    unrecognized = list(dict.fromkeys(d.module for d in dropped if not d.exact))
    symmetries = Symmetries(
        pairs=pairs,
        parameters={n: tuple(p.shape) for n, p in named},
        unrecognized=list(dict.fromkeys(unrecognized)),
        attention=attention,
        dropped=dropped,
        verified=verified,
        discovery=discovery,
        trace_error=failures[-1] if assembly is None and failures else None,
        idle=[]
        if assembly is None
        else [
            n
            for n, _ in named
            if n not in assembly.uses and not any(_inside(n, h) for h in handled)
        ],
    )
    symmetries.validate()
    if warn and symmetries.unrecognized:
        warnings.warn(
            "geosharp does not understand the symmetries of these modules; "
            "their parameters are measured element-wise: "
            + ", ".join(u or "<root>" for u in symmetries.unrecognized)
            + ". See find_symmetries(model).summary(); declare their pairs with "
            "geosharp.symmetry.declare_pair or register_handler if they have any.",
            SymmetryWarning,
            stacklevel=2,
        )
    return symmetries


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
    return lambda: _call(model, inputs)


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


def _call(model: nn.Module, inputs: object) -> object:
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
                warnings.warn(
                    f"symmetry discovery could not run {reason} ({type(err).__name__}: {err}); "
                    "pass a batch: find_symmetries(model, batch)",
                    stacklevel=3,
                )
            return None
        with torch.no_grad(), _eval(model):
            run()  # the model's own error, if it is one
        if warn:
            warnings.warn(
                f"symmetry discovery could not follow the forward pass ({type(err).__name__}: "
                f"{err}); only declared layouts are used",
                stacklevel=3,
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
        assembly = _traced(part, lambda p=part, x=inputs: _call(p, x), meta, True, warn=False)
        if assembly is None:
            continue
        found.append(_prefixed(assembly, name))
        runs.append(lambda p=part, x=inputs: _call(p, x))
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
    )
    return merged, lambda: [run() for run in runs]


def _prefixed(assembly: Assembly, prefix: str) -> Assembly:
    """An assembly of a sub-model, named from the whole model."""

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
    return Assembly(
        pairs,
        [name(m) for m in assembly.attention],
        dropped,
        {name(m) for m in assembly.ran},
        [(name(m), op) for m, op in assembly.opaque],
        {name(p): {name(m) if m != LOSS else m for m in ms} for p, ms in assembly.uses.items()},
        [(name(m), r, frozenset(map(name, ps))) for m, r, ps in assembly.unknown],
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


def _merged(pairs: list[PairSpec]) -> tuple[list[PairSpec], list[Dropped]]:
    """Traced pairs that claim common entries (one projection module shared by two
    layers): one joint pair where one side's blocks are the same (the other sides
    stacked), else both dropped with the reason."""
    out: list[PairSpec] = []
    dropped: list[Dropped] = []
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
        out.pop(clash)
        reason = (
            f"{other.module} and {pair.module} use one parameter in pairs of different "
            "layouts: no joint pair"
        )
        dropped += [Dropped(p.module, p.kind, reason, exact=False) for p in (other, pair)]
    return out, dropped


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
