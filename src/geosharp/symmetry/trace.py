r"""What attention computes: a trace of one forward pass that follows projection outputs.

Every tensor of the forward may carry a *shadow*, computed beside it:

* :class:`PRef`: a parameter or a view of one, as strided positions in the parameter;
* :class:`Feat`: an activation that is, element by element, a sum of *features*
  (outputs of projections ``x -> x W``, numbered by :class:`Source`) and of parameter
  entries (biases added later); slots hold their ids (0: nothing), one slot per term;
* :class:`Taint`: derived from features through anything else (a normalisation, a
  clamp, an op the trace does not know), with the first reason;
* ``SCORE``: derived from a product of two projections (attention scores, weights);
* ``CONST`` / :class:`PDerived`: computed from constants / from parameters only.

Data movement (views, reshapes, permutations, slices, concatenation, repetition) is
applied to the shadows themselves, so a shadow always says, for every element, which
features it holds: a fused ``qkv`` weight, an interleaved head layout, grouped-query
repetition or rotary embeddings need no rule of their own. Contractions are classified
by what meets (:meth:`Tracer.contract`): an activation times a weight is a projection
(a new :class:`Source`); two projections contracted over their features are an
attention *core* (:class:`Core`); scores times features contracted over tokens *mix*
them (:class:`Mixing`), and mixed features times a weight are *consumed*
(:class:`Consumption`). The events are turned into ``GL`` pairs by
:mod:`geosharp.symmetry.assemble`; nothing here decides what a symmetry is.

Which rule an op gets is a table, :data:`FAMILIES`: each family of ops (movement, sums,
products, contractions, reductions, nonlinear ops, ...) declared once with its rule;
an op the table does not name is opaque, and the features entering it are tainted as
uncertain. With ``GEOSHARP_STRICT_TRACE=1`` (the tests) an error inside a rule is
raised instead of being read as an opaque op.

The trace runs on real tensors or, for a model on the ``meta`` device, on its meta
tensors (a value that Python code reads, ``if mask.all():``, is 0 / ``False``) or fake
ones: shadows are small CPU tensors either way, and parameters are never listed
position by position (:class:`PRef` keeps strides).
"""

from __future__ import annotations

import contextlib
import math
import os
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "CONST",
    "PARAM_BASE",
    "SCORE",
    "Consumption",
    "Core",
    "Feat",
    "Mixing",
    "PDerived",
    "PRef",
    "Side",
    "Source",
    "Taint",
    "Trace",
    "Tracer",
    "param_entry",
]

STRICT = "GEOSHARP_STRICT_TRACE"
"""With this environment variable set to ``1`` (the test suite sets it) an error inside
the trace's own rules is raised instead of being read as an op the trace cannot look
into."""

PARAM_BASE = 1 << 40
"""Slot ids at or above this are parameter entries: ``(index + 1) * PARAM_BASE + position``."""

_MATERIALISE = 1 << 22  # at most this many positions of a parameter view are listed
_I64 = torch.int64


def param_entry(index: int, positions: Tensor) -> Tensor:
    """Slot ids of entries ``positions`` of the parameter numbered ``index``."""
    return positions + (index + 1) * PARAM_BASE


# --- shadows ----------------------------------------------------------------------------


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


SCORE = _Marker("SCORE")
CONST = _Marker("CONST")


@dataclass(frozen=True)
class PRef:
    """A parameter (or a view of it): element ``idx`` is entry ``offset + idx . strides``
    of parameter ``param``; ``explicit`` lists the positions where no strides do."""

    param: str
    offset: int
    strides: tuple[int, ...]
    shape: tuple[int, ...]
    explicit: Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def positions(self) -> Tensor:
        """Every element's position in the parameter (int64, ``shape``)."""
        if self.explicit is not None:
            return self.explicit
        out = torch.full(self.shape, self.offset, dtype=_I64)
        for dim, (size, stride) in enumerate(zip(self.shape, self.strides)):
            view = [1] * len(self.shape)
            view[dim] = size
            out += (torch.arange(size, dtype=_I64) * stride).view(view)
        return out


@dataclass(frozen=True)
class PDerived:
    """Computed from parameters (and constants) only."""

    params: frozenset[str]


class Feat:
    """Sums of features and parameter entries: ``slots[s][idx]`` is the id of term ``s``
    of element ``idx`` (0: none). ``mix``: the :class:`Mixing` that mixed the features
    over tokens (``None``: not mixed)."""

    __slots__ = ("mix", "slots")

    def __init__(self, slots: list[Tensor], mix: int | None = None):
        self.slots = slots
        self.mix = mix

    def __repr__(self) -> str:
        return f"Feat({len(self.slots)} slots, shape={tuple(self.slots[0].shape)}, mix={self.mix})"


@dataclass
class Taint:
    """Derived from features through an op that is not linear in them (or that the
    trace does not know: ``certain=False``); ``reason`` says which, and where. The
    features that enter a taint are recorded in :attr:`Trace.taints`."""

    reason: str
    certain: bool = True


Shadow = PRef | PDerived | Feat | Taint | _Marker


# --- events -----------------------------------------------------------------------------


@dataclass
class Source:
    """A projection ``y = x W`` (+ bias): its features are ``W``'s entries along the axes
    that are not contracted, numbered ``base, base + 1, ...`` in row-major order.

    ``feat`` and ``rows``: ``(size, stride)`` per feature axis and per contracted
    (input) axis of ``W``; the entry of feature ``f`` and input ``r`` sits at
    ``offset + f . feat + r . rows`` in parameter ``param``. ``bias``: the bias
    positions per feature, or ``None``.
    """

    sid: int
    base: int
    size: int
    param: str
    offset: int
    feat: tuple[tuple[int, int], ...]
    rows: tuple[tuple[int, int], ...]
    bias: PRef | None
    module: str

    def feature_offsets(self, f: Tensor) -> Tensor:
        """``f . feat`` for local feature numbers ``f`` (int64)."""
        out = torch.zeros_like(f)
        rest = f.clone()
        for size, stride in reversed(self.feat):
            out += (rest % size) * stride
            rest //= size
        return out


@dataclass
class Side:
    """One operand of a contraction seen from its slices: ``ids[l, c, s]`` is slot
    ``s`` of column ``c`` (contracted index) in slice ``l`` (batch index); a tainted
    operand has its ``taint`` instead."""

    ids: Tensor | None = None
    taint: Taint | None = None


@dataclass
class Core:
    """Two projections contracted over their features: attention scores."""

    module: str
    left: Side
    right: Side


@dataclass
class Mixing:
    """Features mixed over tokens by scores (or another data matrix): ``ids[l, c, s]`` of
    the mixed operand in slice ``l``; the mixed output carries ``mix = index``. A
    tainted operand is recorded with its ``taint`` (and no ids)."""

    index: int
    module: str
    ids: Tensor | None
    by_scores: bool
    taint: Taint | None = None


@dataclass
class Consumption:
    """Features (mixed or not) contracted with a weight: ``feat`` holds their
    ``ids[l, c, s]``; the weight's entry for row ``r`` (its free axes) and column ``c``
    (the contracted axes) sits at ``weight.offset + rows . r + cols . c``."""

    module: str
    feat: Side
    weight: PRef
    rows: tuple[tuple[int, int], ...]
    cols: tuple[tuple[int, int], ...]
    mix: int | None
    batch: tuple[tuple[int, int], ...] = ()

    def slice_offsets(self) -> Tensor:
        """Offset of every slice (row-major over the axes shared with the input)."""
        out = torch.zeros(1, dtype=_I64)
        for size, stride in self.batch:
            out = (out[:, None] + torch.arange(size, dtype=_I64)[None, :] * stride).reshape(-1)
        return out

    def row_offsets(self) -> Tensor:
        """Offsets of every row (row-major over the free axes)."""
        out = torch.zeros(1, dtype=_I64)
        for size, stride in self.rows:
            out = (out[:, None] + torch.arange(size, dtype=_I64)[None, :] * stride).reshape(-1)
        return out

    def col_offsets(self, cols: Tensor) -> Tensor:
        """Offsets of flat column numbers ``cols``."""
        out = torch.zeros_like(cols)
        rest = cols.clone()
        for size, stride in reversed(self.cols):
            out += (rest % size) * stride
            rest //= size
        return out


@dataclass
class Trace:
    """What a traced forward pass computed: projections, cores, mixings and
    consumptions, taints of features, and the modules where they happened."""

    sources: list[Source] = field(default_factory=list)
    cores: list[Core] = field(default_factory=list)
    mixings: list[Mixing] = field(default_factory=list)
    consumptions: list[Consumption] = field(default_factory=list)
    taints: list[tuple[Tensor, str, bool, str]] = field(default_factory=list)
    """``(runs, reason, certain, module)``: features ``[start, stop)`` that entered a taint."""
    params: list[str] = field(default_factory=list)
    opaque: list[tuple[str, str]] = field(default_factory=list)
    """``(module, op)``: features entered an op the trace cannot look into."""
    ran: set[str] = field(default_factory=set)
    """The modules whose forward ran."""
    uses: dict[str, set[str]] = field(default_factory=dict)
    """Per parameter, the modules whose forward used it (``"<loss>"``: outside the
    model's forward)."""
    unknown: list[tuple[Tensor, str, str]] = field(default_factory=list)
    """``(runs, reason, module)``: projection features that entered, themselves, an op
    the trace cannot look into (not those joining an activation already tainted)."""


# --- the function mode ------------------------------------------------------------------

# Ops that move data without computing: applied to the shadows themselves.
_MOVE = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims",
    "permute", "contiguous", "clone", "__getitem__", "expand", "expand_as", "repeat",
    "repeat_interleave", "squeeze", "unsqueeze", "flatten", "unflatten", "narrow",
    "select", "split", "split_with_sizes", "chunk", "unbind", "t", "T", "mT", "movedim",
    "moveaxis", "roll", "flip", "index_select", "gather", "take_along_dim", "tile",
    "broadcast_to", "cat", "concat", "concatenate", "stack", "hstack", "vstack",
    "tensor_split", "diagonal", "pad", "detach", "__reversed__", "as_strided",
}  # fmt: skip
# Ops that change neither values' sources nor their layout.
_SAME = {
    "to", "float", "double", "half", "bfloat16", "type", "type_as", "cpu", "cuda",
    "requires_grad_", "detach_", "dropout", "alpha_dropout", "feature_alpha_dropout",
    "__neg__", "neg", "negative", "positive", "__pos__",
}  # fmt: skip
_ADD = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__",
        "__isub__", "sub_", "subtract"}  # fmt: skip
_MUL = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply", "div", "__truediv__",
        "__itruediv__", "div_", "true_divide", "divide"}  # fmt: skip
# Ops that are certainly not linear in their input (a normalisation, an activation...).
_NONLINEAR = {
    "softmax", "log_softmax", "layer_norm", "rms_norm", "group_norm", "batch_norm",
    "instance_norm", "normalize", "gelu", "relu", "silu", "sigmoid", "tanh", "exp", "log",
    "pow", "__pow__", "sqrt", "rsqrt", "abs", "clamp", "clip", "clamp_", "clamp_min",
    "clamp_max", "mean", "sum", "var", "std", "norm", "max", "min", "amax", "amin",
    "erf", "square", "reciprocal", "softplus", "mish", "elu", "leaky_relu", "hardtanh",
    "logsumexp", "cumsum", "sign", "floor", "ceil", "round", "relu6", "glu", "prod",
    "var_mean", "std_mean", "__abs__", "cos", "sin", "atan", "hardswish", "hardsigmoid",
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "logsigmoid",
    "log1p", "expm1", "selu", "celu", "silu_", "relu_", "softsign", "tanhshrink",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "index_add",
    "index_add_", "scatter_add", "scatter_add_", "scatter", "scatter_", "index_copy",
    "index_copy_", "index_put", "index_put_", "embedding_bag", "topk", "sort", "kthvalue",
    "median", "cummax", "cummin",
}  # fmt: skip
# Linear along the axes they reduce: over tokens they keep a head's features.
_TOKEN_LINEAR = {"sum", "mean", "cumsum", "nansum", "nanmean"}
# Queries that return no tensor.
_QUERIES = {"size", "dim", "numel", "shape", "dtype", "device", "is_floating_point",
                   "stride", "storage_offset", "data_ptr", "element_size", "ndim",
                   "is_contiguous", "__len__", "tolist", "item", "__bool__", "__index__",
                   "__int__", "__float__", "__format__", "__repr__", "__hash__",
                   "requires_grad", "is_complex", "__iter__", "__contains__"}  # fmt: skip
_CONTRACTIONS = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm",
                 "addmm", "einsum"}  # fmt: skip
_NOT_ACTIVATIONS = {"embedding"}  # parameter lookups: their output is an input
# Factories that take a tensor's shape, not its values: their result is a constant.
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
         "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}  # fmt: skip
# Boolean results that Python code branches on (``if mask.all():``): on the meta device
# they read as False.
_CONDITIONS = {
    "all", "any", "__eq__", "eq", "__ne__", "ne", "__lt__", "lt", "__le__", "le", "__gt__",
    "gt", "__ge__", "ge", "isnan", "isinf", "isfinite", "logical_and", "logical_or",
    "logical_not", "__and__", "__or__", "__invert__",
}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A family of ops and the rule that shadows their outputs: ``rule(tracer, op)``.
    ``constants_too``: the rule runs even when no input holds features or parameters
    (otherwise such an op gives a constant, or nothing)."""

    name: str
    ops: frozenset[str]
    rule: Callable[[Tracer, Op], None]
    constants_too: bool = False


@dataclass
class Op:
    """One call the trace sees: the function, its name, arguments and result, the
    tensors of the result and the shadows of the floating inputs."""

    func: object
    name: str
    args: tuple
    kwargs: dict
    out: object
    outs: list[Tensor]
    shadows: list


def _like(tracer: Tracer, op: Op) -> None:
    for t in op.outs:
        tracer._set(t, CONST)


def _reduction(tracer: Tracer, op: Op) -> None:
    if isinstance(op.shadows[0] if op.shadows else None, Feat):
        tracer._reduce(op.name, op.args, op.kwargs, op.outs, op.shadows)
    else:
        tracer._generic(op.name, op.outs, op.shadows, certain=op.name in _NONLINEAR)


# Each op family once, with its rule; an op the table does not name is opaque (its
# features are tainted as uncertain), and an op in two families is an error here.
FAMILIES = (
    Family("query", frozenset(_QUERIES), lambda tr, op: None, constants_too=True),
    Family(
        "contraction",
        frozenset(_CONTRACTIONS),
        lambda tr, op: tr._contraction(op.name, op.args, op.kwargs, op.out),
        constants_too=True,
    ),
    Family("lookup", frozenset(_NOT_ACTIVATIONS), lambda tr, op: None, constants_too=True),
    Family("shape-only", frozenset(_LIKE), _like, constants_too=True),
    Family("write", frozenset({"__setitem__"}), lambda tr, op: tr._setitem(op.args)),
    Family(
        "movement",
        frozenset(_MOVE | _SAME),
        lambda tr, op: tr._move(op.func, op.name, op.args, op.kwargs, op.out, op.shadows),
    ),
    Family("sum", frozenset(_ADD), lambda tr, op: tr._add(op.args, op.out)),
    Family(
        "product", frozenset(_MUL), lambda tr, op: tr._mul(op.name, op.args, op.out, op.shadows)
    ),
    Family(
        "select",
        frozenset({"where"}),
        lambda tr, op: tr._where(op.args, op.kwargs, op.out, op.shadows),
    ),
    Family("reduction", frozenset(_TOKEN_LINEAR), _reduction),
    Family(
        "nonlinear",
        frozenset((_NONLINEAR - _TOKEN_LINEAR) | {"masked_fill", "masked_fill_"}),
        lambda tr, op: tr._generic(op.name, op.outs, op.shadows, certain=True),
    ),
)
RULES: dict[str, Family] = {}
for _family in FAMILIES:
    _twice = _family.ops & RULES.keys()
    assert not _twice, f"{sorted(_twice)} in two op families"
    RULES.update(dict.fromkeys(_family.ops, _family))
OPAQUE = Family(
    "opaque", frozenset(), lambda tr, op: tr._generic(op.name, op.outs, op.shadows, certain=False)
)


def _is_attention_kernel(name: str) -> bool:
    """``scaled_dot_product_attention`` and its variants (not their backward)."""
    return "scaled_dot_product" in name and "attention" in name and "backward" not in name


_NAMES: dict[object, str] = {}


def _name(func: object) -> str:
    """The op's name (a property's name for its getter), cached per function."""
    try:
        return _NAMES[func]
    except (KeyError, TypeError):
        pass
    name = getattr(func, "__name__", "")
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        name = getattr(owner, "__name__", name)
    try:
        _NAMES[func] = name
    except TypeError:  # unhashable
        pass
    return name


class _Mode(TorchFunctionMode):
    def __init__(self, tracer: Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.meta and args and isinstance(args[0], Tensor) and args[0].is_meta:
            if _name(func) in ("item", "tolist"):  # Python code reads a value: 0 / False
                return torch.zeros(args[0].shape, dtype=args[0].dtype).tolist()
        out = func(*args, **kwargs)
        if tracer.meta and isinstance(out, Tensor) and out.is_meta and out.dim() == 0:
            if out.dtype == torch.bool and _name(func) in _CONDITIONS:
                return torch.zeros((), dtype=torch.bool)  # for a Python branch to read
        if tracer.fake:
            with tracer.outside():
                tracer.observe(func, args, kwargs, out)
        else:
            tracer.observe(func, args, kwargs, out)
        return out


class _Unsupported(Exception):
    pass


class Tracer:
    """Runs a forward pass under a function mode that keeps a shadow beside every tensor
    derived from the model's parameters or projections; collects a :class:`Trace`."""

    def __init__(
        self,
        model: nn.Module,
        tensors: dict[str, Tensor] | None = None,
        buffers: dict[str, Tensor] | None = None,
        fake: bool = False,
        meta: bool = False,
    ):
        """``tensors`` / ``buffers``: what the forward pass uses in place of the model's
        parameters and buffers (fake tensors for a ``meta`` model); default, its own.
        ``meta``: a value that Python code reads from a ``meta`` tensor (``t.item()``, a
        branch on ``mask.all()``) is 0 / ``False``, so the code can run."""
        self.model = model
        self.trace = Trace()
        # a meta or fake trace holds no data: strong references are cheap there
        self.shadows = _IdDict() if (meta or fake) else WeakTensorKeyDictionary()
        named = tensors if tensors is not None else dict(model.named_parameters())
        self._param_index: dict[int, int] = {}
        self._param_tensors: list[Tensor] = []
        for name, tensor in named.items():
            if id(tensor) in self._param_index:
                continue  # tied: the first name
            self._param_index[id(tensor)] = len(self.trace.params)
            self._param_tensors.append(tensor)  # alive for the trace
            self.trace.params.append(name)
        self._numbers = {name: i for i, name in enumerate(self.trace.params)}
        buffer_list = list(buffers.values()) if buffers is not None else list(model.buffers())
        self._buffers = {id(b) for b in buffer_list}
        self._buffer_tensors = buffer_list  # alive for the trace
        self._sources: dict[tuple, Source] = {}
        self._next_id = 1
        self._stack: list[str] = []
        self._names = {id(m): n for n, m in model.named_modules()}
        self._types = {n: type(m).__name__ for n, m in model.named_modules()}
        self.fake = fake
        self.meta = meta

    # -- running ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Trace what runs inside: module stack hooks and the function mode."""
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        def push(module, _args):
            name = self._names.get(id(module))
            if name is not None:
                self._stack.append(name)
                self.trace.ran.add(name)

        def pop(module, _args, _out):
            if self._names.get(id(module)) is not None and self._stack:
                self._stack.pop()

        pre = register_module_forward_pre_hook(push)
        post = register_module_forward_hook(pop)
        try:
            with _Mode(self):
                yield
        finally:
            pre.remove()
            post.remove()

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Shadow computations run on real CPU tensors, also inside a fake-tensor trace."""
        if not self.fake:
            yield
            return
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            yield

    @property
    def where(self) -> str:
        """The module running now (its name in the model)."""
        return (self._stack[-1] if self._stack else "") or "<root>"

    @property
    def here(self) -> str:
        """The module running now, with its class, for reasons."""
        name = self._stack[-1] if self._stack else ""
        return f"{name or '<root>'} ({self._types.get(name, '?')})"

    def observe(self, func, args, kwargs, out) -> None:
        """Shadow ``out`` (:meth:`after`); an op the trace cannot follow taints its
        features instead of breaking the forward pass."""
        try:
            self.after(func, args, kwargs, out)
        except _Unsupported as err:
            self.unsupported(args, kwargs, out, str(err))
        except Exception as err:  # a gap of the trace: never break the user's forward
            if os.environ.get(STRICT) == "1":  # the tests: a tracer bug is an error
                raise
            self.unsupported(args, kwargs, out, f"{_name(func)} ({type(err).__name__})")

    # -- shadows ---------------------------------------------------------------------------

    def shadow(self, t: Tensor) -> Shadow | None:
        s = self.shadows.get(t)
        if s is not None:
            return s
        index = self._param_index.get(id(t))
        if index is not None:
            return PRef(self.trace.params[index], 0, tuple(t.stride()), tuple(t.shape))
        if id(t) in self._buffers:
            return CONST
        return None

    def _set(self, t: object, s: Shadow | None) -> None:
        # indices and masks carry no features: only floating tensors get shadows
        if isinstance(t, Tensor) and s is not None and (t.is_floating_point() or t.is_complex()):
            self.shadows[t] = s

    def _param_number(self, name: str) -> int:
        return self._numbers[name]

    def unsupported(self, args, kwargs, out, what: str) -> None:
        """An op the trace cannot follow: features entering it are tainted (uncertain)."""
        shadows = [self.shadow(t) for t in _tensors((args, kwargs))]
        if any(s is SCORE for s in shadows):
            result: Shadow | None = SCORE
        elif any(isinstance(s, (Feat, Taint)) for s in shadows):
            result = self._taint(shadows, f"{what} in {self.here}", certain=False)
            self.trace.opaque.append((self.where, what))
            self._unknown(shadows, f"{what} in {self.here}")
        else:
            return
        for t in _tensors(out):
            self._set(t, result)

    def _unknown(self, shadows: list, reason: str) -> None:
        """Record the features of ``shadows`` as entering an op the trace cannot read."""
        runs = [_runs(slot) for s in shadows if isinstance(s, Feat) for slot in s.slots]
        runs = [r for r in runs if r.numel()]
        if runs:
            self.trace.unknown.append((torch.cat(runs), reason, self.where))

    def _taint(self, shadows: list, reason: str, certain: bool) -> Taint:
        """The taint of an op's result: the first input taint's, else a new one; the
        features of the op's :class:`Feat` inputs are recorded as tainted by it."""
        first = next((s for s in shadows if isinstance(s, Taint)), None)
        taint = (
            Taint(first.reason, first.certain and certain)
            if first is not None
            else Taint(reason, certain)
        )
        runs = [_runs(slot) for s in shadows if isinstance(s, Feat) for slot in s.slots]
        runs = [r for r in runs if r.numel()]
        if runs:
            self.trace.taints.append((torch.cat(runs), taint.reason, taint.certain, self.where))
        return taint

    # -- dispatch --------------------------------------------------------------------------

    def after(self, func, args, kwargs, out) -> None:
        """Shadow the result of one op by its family's rule (:data:`FAMILIES`)."""
        name = _name(func)
        family = RULES.get(name, OPAQUE)
        if family.name == "query":
            return
        outs = _tensors(out)
        if family.name != "write" and not any(
            t.is_floating_point() or t.is_complex() for t in outs
        ):
            return  # indices and masks (argmax, comparisons) carry no features
        inputs = _tensors((args, kwargs))
        for t in inputs:
            index = self._param_index.get(id(t))
            if index is not None:
                where = self._stack[-1] if self._stack else "<loss>"
                self.trace.uses.setdefault(self.trace.params[index], set()).add(where)
        shadows = [self.shadow(t) for t in inputs if t.is_floating_point() or t.is_complex()]
        op = Op(func, name, args, kwargs, out, outs, shadows)
        if _is_attention_kernel(name):
            return self._sdpa(args, kwargs, out)
        if not family.constants_too and all(s is None for s in shadows):
            if not inputs:  # a factory: constant
                for t in outs:
                    self._set(t, CONST)
            return
        family.rule(self, op)

    def _generic(self, name, outs, shadows, certain: bool) -> None:
        if any(s is SCORE for s in shadows):
            result: Shadow | None = SCORE
        elif any(isinstance(s, (Feat, Taint)) for s in shadows):
            result = self._taint(shadows, f"{name} in {self.here}", certain)
            if not certain and any(isinstance(s, Feat) for s in shadows):
                self.trace.opaque.append((self.where, name))
                self._unknown(shadows, f"{name} in {self.here}")
        elif any(isinstance(s, (PRef, PDerived)) for s in shadows):
            if any(s is None for s in shadows):
                result = None  # a parameter applied to an activation: an activation
            else:
                params = set()
                for s in shadows:
                    if isinstance(s, PRef):
                        params.add(s.param)
                    elif isinstance(s, PDerived):
                        params |= s.params
                result = PDerived(frozenset(params))
        elif any(s is None for s in shadows):
            result = None
        else:
            result = CONST
        for t in outs:
            self._set(t, result)

    def _reduce(self, name, args, kwargs, outs, shadows) -> None:
        """A sum, mean or cumulative sum: along axes where every element holds the same
        features (tokens, landmarks, windows) it keeps them; across features it is not
        linear in the head's columns (a taint)."""
        x, feat = args[0], shadows[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if len(shadows) != 1 or dim is None or isinstance(dim, torch.dtype) or dim == ():
            return self._generic(name, outs, shadows, certain=True)
        dims = sorted({d % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim])})
        for slot in feat.slots:
            for d in dims:
                if not bool((slot == slot.narrow(d, 0, 1)).all()):
                    return self._generic(name, outs, shadows, certain=True)
        if name == "cumsum":
            slots = list(feat.slots)
        else:
            keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
            slots = []
            for slot in feat.slots:
                for d in reversed(dims):
                    slot = slot.narrow(d, 0, 1) if keep else slot.select(d, 0)
                slots.append(slot)
        for t in outs:
            self._set(t, Feat(slots, feat.mix))

    # -- data movement ---------------------------------------------------------------------

    def _move(self, func, name, args, kwargs, out, shadows) -> None:
        outs = _tensors(out)
        if name in _SAME:
            # a cast or an identity (eval-mode dropout): each element keeps its sources,
            # and a parameter view's element keeps its place in the parameter
            first = shadows[0] if shadows else None
            for t in outs:
                self._set(t, first)
            return
        kinds = {type(s) if not isinstance(s, _Marker) else s for s in shadows if s is not None}
        if SCORE in kinds:
            for t in outs:
                self._set(t, SCORE)
            return
        if Taint in kinds:
            taint = self._taint(shadows, "", True)
            for t in outs:
                self._set(t, taint)
            return
        if Feat in kinds:
            feats = [s for s in shadows if isinstance(s, Feat)]
            mixes = {f.mix for f in feats}
            if len(mixes) > 1:
                raise _Unsupported(f"{name} joins differently mixed features")
            n_slots = max(len(f.slots) for f in feats)
            slot_outs = []
            single = (
                len(shadows) == 1
                and isinstance(args[0], Tensor)
                and self.shadow(args[0]) is feats[0]
                and not any(isinstance(a, Tensor) for a in args[1:])
                and not any(isinstance(v, Tensor) for v in kwargs.values())
            )
            for k in range(n_slots):
                if single:  # one tensor moved (a view, reshape, ...): no substitution pass
                    moved = func(feats[0].slots[k], *args[1:], **kwargs)
                else:
                    moved = func(*self._slot_args(args, k), **self._slot_args(kwargs, k))
                slot_outs.append(_tensors(moved))
            for j, t in enumerate(outs):
                self._set(t, Feat([so[j] for so in slot_outs], feats[0].mix))
            return
        if PRef in kinds or PDerived in kinds:
            refs = [s for s in shadows if isinstance(s, PRef)]
            if len(refs) == 1 and kinds <= {PRef}:
                tensor = next(
                    t for t in _tensors((args, kwargs)) if isinstance(self.shadow(t), PRef)
                )
                moved = self._move_param(func, args, kwargs, tensor, refs[0], len(outs))
                for t, ref in zip(outs, moved):
                    self._set(t, ref)
                return
            params = set()
            for s in shadows:
                if isinstance(s, PRef):
                    params.add(s.param)
                elif isinstance(s, PDerived):
                    params |= s.params
            for t in outs:
                self._set(t, PDerived(frozenset(params)))
            return
        result = None if any(s is None for s in shadows) else CONST
        for t in outs:
            self._set(t, result)

    def _slot_args(self, obj, k: int):
        """``obj`` with each tensor replaced by slot ``k`` of its shadow (zeros if none)."""

        def replace(x):
            if not isinstance(x, Tensor):
                return x
            s = self.shadow(x)
            if isinstance(s, Feat):
                if k < len(s.slots):
                    return s.slots[k]
                return torch.zeros(x.shape, dtype=_I64)
            if x.dtype in (torch.int64, torch.int32, torch.bool, torch.uint8, torch.int16):
                if x.is_meta or _is_fake(x):
                    raise _Unsupported("indexing by a tensor whose values are unknown")
                return x.detach().cpu()  # an index or mask
            return torch.zeros(x.shape, dtype=_I64)

        return tree_map(replace, obj)

    def _move_param(self, func, args, kwargs, tensor: Tensor, ref: PRef, n: int) -> list[Shadow]:
        """The results of a data-movement op on a parameter view: strided positions where
        the result is a view (found by applying the op to a meta stand-in), listed
        positions where it is a small copy."""
        if ref.explicit is None:
            size = ref.offset + sum((n - 1) * s for n, s in zip(ref.shape, ref.strides)) + 1
            base = torch.empty(max(size, 1), device="meta")
            stand_in = base.as_strided(ref.shape, ref.strides, ref.offset)

            def swap(x):
                return stand_in if x is tensor else x

            try:
                moved = _tensors(func(*tree_map(swap, args), **tree_map(swap, kwargs)))
            except Exception:  # the stand-in's strides do not allow this view
                moved = None
            if moved is not None and all(m._base is base for m in moved):
                return [
                    PRef(ref.param, m.storage_offset(), tuple(m.stride()), tuple(m.shape))
                    for m in moved
                ]
        derived = [PDerived(frozenset({ref.param}))] * n
        if ref.numel > _MATERIALISE:
            return derived
        positions = ref.positions()

        def swap_positions(x):
            if not isinstance(x, Tensor):
                return x
            if x is tensor:
                return positions
            if x.is_meta or _is_fake(x):
                raise _Unsupported("indexing by a tensor whose values are unknown")
            return x

        try:
            moved = _tensors(
                func(*tree_map(swap_positions, args), **tree_map(swap_positions, kwargs))
            )
        except Exception:
            return derived
        return [
            PRef(ref.param, 0, tuple(m.contiguous().stride()), tuple(m.shape), m.contiguous())
            for m in moved
        ]

    def _setitem(self, args) -> None:
        target, index, value = args
        st = self.shadow(target)
        sv = self.shadow(value) if isinstance(value, Tensor) else None
        if st is None and sv is None:
            return
        if SCORE in (st, sv):
            self._set(target, SCORE)
            return
        if isinstance(st, Taint) or isinstance(sv, Taint):
            self._set(target, self._taint([st, sv], "", True))
            return
        if isinstance(sv, (PRef, PDerived)) or isinstance(st, (PRef, PDerived)):
            raise _Unsupported("writing into a parameter view")
        if not isinstance(st, Feat) and not isinstance(sv, Feat):
            # constants and activations only: a constant stays one only if what is
            # written is constant too; else the target is an activation (no shadow)
            if not (st is CONST and (sv is CONST or not isinstance(value, Tensor))):
                self.shadows.pop(target, None)
            return
        n = max(len(s.slots) for s in (st, sv) if isinstance(s, Feat))
        slots = []
        for k in range(n):
            base = (
                st.slots[k].clone()
                if isinstance(st, Feat) and k < len(st.slots)
                else torch.zeros(target.shape, dtype=_I64)
            )
            if isinstance(sv, Feat):
                v = sv.slots[k] if k < len(sv.slots) else torch.zeros(value.shape, dtype=_I64)
            else:
                v = torch.zeros(value.shape if isinstance(value, Tensor) else (), dtype=_I64)
            base[self._slot_args(index, k)] = v
            slots.append(base)
        mix = st.mix if isinstance(st, Feat) else sv.mix
        self._set(target, Feat(slots, mix))

    # -- elementwise -----------------------------------------------------------------------

    def _add(self, args, out) -> None:
        a = args[0]
        b = args[1] if len(args) > 1 else None
        sa = self.shadow(a) if isinstance(a, Tensor) else CONST
        sb = self.shadow(b) if isinstance(b, Tensor) else (CONST if b is None else _scalar(b))
        outs = _tensors(out)
        if SCORE in (sa, sb):
            result: Shadow | None = SCORE
        elif isinstance(sa, Taint) or isinstance(sb, Taint):
            result = self._taint([sa, sb], "", True)
        elif isinstance(sa, Feat) or isinstance(sb, Feat):
            feat, other = (sa, sb) if isinstance(sa, Feat) else (sb, sa)
            shape = tuple(outs[0].shape)
            if isinstance(other, Feat):
                if feat.mix != other.mix:
                    result = self._taint(
                        [sa, sb], f"sum of features mixed differently in {self.here}", True
                    )
                else:
                    result = Feat([_bcast(s, shape) for s in feat.slots + other.slots], feat.mix)
            elif isinstance(other, PRef):
                if other.numel > _MATERIALISE:
                    raise _Unsupported("a large parameter added to features")
                entries = param_entry(self._param_number(other.param), other.positions())
                result = Feat(
                    [_bcast(s, shape) for s in feat.slots] + [_bcast(entries, shape)], feat.mix
                )
            elif other == 0.0:  # adding zero
                result = Feat([_bcast(s, shape) for s in feat.slots], feat.mix)
            else:
                what = (
                    "a constant"
                    if other is CONST or isinstance(other, float)
                    else (
                        "a tensor computed from parameters"
                        if isinstance(other, PDerived)
                        else "an activation"
                    )
                )
                result = self._taint([feat], f"{what} added in {self.here}", True)
        else:
            self._generic("add", outs, [sa, sb], certain=True)
            return
        for t in outs:
            self._set(t, result)

    def _mul(self, name, args, out, shadows) -> None:
        a = args[0]
        b = args[1] if len(args) > 1 else None
        sa = self.shadow(a) if isinstance(a, Tensor) else _scalar(a)
        sb = self.shadow(b) if isinstance(b, Tensor) else _scalar(b)
        outs = _tensors(out)
        divides = name in ("div", "__truediv__", "__itruediv__", "div_", "true_divide", "divide")
        if SCORE in (sa, sb):
            result: Shadow | None = SCORE
        elif isinstance(sa, Feat) and isinstance(sb, Feat):
            result = self._taint([sa, sb], f"product of features in {self.here}", True)
        elif isinstance(sa, Feat) or isinstance(sb, Feat):
            feat = sa if isinstance(sa, Feat) else sb
            if divides and not isinstance(sa, Feat):
                result = self._taint([sa, sb], f"division by features in {self.here}", True)
            else:
                # scaled by a number, a parameter, an activation or a gate: a scale shared
                # by a head's columns commutes with GL(h) of that head, one that varies
                # across them does not; the pair is kept as a candidate and its
                # numerical verification decides
                shape = tuple(outs[0].shape)
                result = Feat([_bcast(s, shape) for s in feat.slots], feat.mix)
        elif isinstance(sa, Taint) or isinstance(sb, Taint):
            result = self._taint([sa, sb], "", True)
        elif (
            isinstance(sa, PRef)
            and not isinstance(sb, (PRef, PDerived, Feat))
            and (not isinstance(b, Tensor) or b.numel() == 1)
        ):
            result = sa  # a parameter times a number: the same entries
        elif isinstance(sb, PRef) and not divides and not isinstance(a, Tensor):
            result = sb
        else:
            self._generic(name, outs, [sa, sb], certain=True)
            return
        for t in outs:
            self._set(t, result)

    def _where(self, args, kwargs, out, shadows) -> None:
        _, a, b = [*args, kwargs.get("input"), kwargs.get("other")][:3]
        sa = self.shadow(a) if isinstance(a, Tensor) else None
        sb = self.shadow(b) if isinstance(b, Tensor) else None
        outs = _tensors(out)
        if SCORE in (sa, sb):
            result: Shadow | None = SCORE
        elif isinstance(sa, Feat) or isinstance(sb, Feat):
            if isinstance(sa, Taint) or isinstance(sb, Taint):
                result = self._taint([sa, sb], "", True)
            else:
                raise _Unsupported("where() on features")
        else:
            self._generic("where", outs, shadows, certain=True)
            return
        for t in outs:
            self._set(t, result)

    # -- contractions ----------------------------------------------------------------------

    def _contraction(self, name, args, kwargs, out) -> None:
        spec = _einsum_spec(name, args, kwargs)
        if spec is None:
            raise _Unsupported(f"{name} with these operands")
        (left, right), (ll, lr, lo), bias = spec
        # the second operand of linear and addmm is the weight, whatever the first is
        weight_right = name in ("linear", "addmm") and isinstance(self.shadow(right), PRef)
        result = self.contract(left, right, ll, lr, lo, out, bias, weight_right)
        for t in _tensors(out):
            self._set(t, result)

    def contract(
        self, left, right, ll: str, lr: str, lo: str, out: Tensor, bias=None, weight_right=False
    ):
        """The shadow of ``einsum(f"{ll},{lr}->{lo}", left, right)`` (+ ``bias``),
        recording the event it is; ``weight_right``: ``right`` is a weight (linear
        layers), even if ``left`` is a parameter too (an embedding table projected)."""
        sl, sr = self.shadow(left), self.shadow(right)
        sb = self.shadow(bias) if isinstance(bias, Tensor) else None
        kinds = (_kind(sl), _kind(sr))
        contracted = "".join(c for c in ll if c in lr and c not in lo)
        if "score" in kinds:
            first = kinds[0] == "score"
            s_other, l_other, l_score = (sr, lr, ll) if first else (sl, ll, lr)
            if isinstance(s_other, (Feat, Taint)):
                return self._mix(s_other, l_other, l_score, lo, contracted, out, by_scores=True)
            if s_other is None:  # scores mix an activation that no projection made
                index = len(self.trace.mixings)
                self.trace.mixings.append(Mixing(index, self.where, None, True))
            return SCORE
        if kinds == ("param", "param") and not weight_right:
            return PDerived(frozenset({sl.param, sr.param}))
        if "param" in kinds:
            w_first = kinds[0] == "param" and not weight_right
            sw, lw = (sl, ll) if w_first else (sr, lr)
            sx, lx = (sr, lr) if w_first else (sl, ll)
            return self._project(sw, lw, sx, lx, lo, contracted, out, sb)
        if "pderived" in kinds:
            shadows = [s for s in (sl, sr) if isinstance(s, (Feat, Taint))]
            if not shadows and "none" not in kinds:
                return PDerived(frozenset())
            reason = f"a projection through a weight computed from parameters in {self.here}"
            self.trace.opaque.append((self.where, reason))
            if not shadows:
                return Taint(reason, False)
            self._unknown(shadows, reason)
            return self._taint(shadows, reason, certain=False)
        featlike = [k in ("feat", "taint") for k in kinds]
        if all(featlike):
            return self._core(sl, ll, sr, lr, lo, contracted, tuple(out.shape))
        if any(featlike):
            sf, lf, l_other = (sl, ll, lr) if featlike[0] else (sr, lr, ll)
            if isinstance(sf, Feat) and _constant_along(sf, lf, contracted):
                return self._mix(sf, lf, l_other, lo, contracted, out, by_scores=False)
            # a fixed or data-dependent linear map of a head's features (a rotation
            # written as a matrix, say) may keep a subgroup: not understood, not absent
            reason = f"features contracted with a matrix of activations or constants in {self.here}"
            self._unknown([sf], reason)
            return self._taint([sf], reason, False)
        if "none" in kinds:
            return None
        return CONST

    def _project(self, sw: PRef, lw, sx, lx, lo, contracted, out, bias_shadow) -> Shadow:
        """An input (any activation) times the weight ``sw``: a projection, whose output
        features are the weight's entries along its free axes."""
        if sw.explicit is not None:
            reason = f"a projection through a gathered weight view in {self.here}"
            self.trace.opaque.append((self.where, reason))
            return Taint(reason, False)
        free = "".join(c for c in lw if c not in contracted)
        feat = tuple((sw.shape[lw.index(c)], sw.strides[lw.index(c)]) for c in free)
        rows = tuple((sw.shape[lw.index(c)], sw.strides[lw.index(c)]) for c in contracted)
        size = math.prod(s for s, _ in feat)
        bias = bias_shadow if isinstance(bias_shadow, PRef) and bias_shadow.numel == size else None
        key = (
            sw.param,
            sw.offset,
            feat,
            rows,
            None if bias is None else (bias.param, bias.offset, bias.strides),
        )
        source = self._sources.get(key)
        if source is None:
            source = Source(
                len(self.trace.sources),
                self._next_id,
                size,
                sw.param,
                sw.offset,
                feat,
                rows,
                bias,
                self.where,
            )
            self._next_id += size
            self._sources[key] = source
            self.trace.sources.append(source)
        ids = torch.arange(source.base, source.base + size, dtype=_I64)
        ids = ids.view([s for s, _ in feat])
        slot = _arrange(ids, free, lo, tuple(out.shape))
        if isinstance(sx, Feat):
            side = self._side(sx, lx, lw, lo, contracted, out.shape)
            batch = [c for c in lo if c in lw and c in lx]
            row_axes = tuple(
                (sw.shape[lw.index(c)], sw.strides[lw.index(c)])
                for c in lw
                if c not in contracted and c not in batch
            )
            batch_axes = tuple((sw.shape[lw.index(c)], sw.strides[lw.index(c)]) for c in batch)
            self.trace.consumptions.append(
                Consumption(self.where, side, sw, row_axes, rows, sx.mix, batch_axes)
            )
        return Feat([slot])

    def _side(
        self, s: Feat | Taint, letters: str, other: str, lo: str, contracted: str, shape
    ) -> Side:
        """Operand ``s`` (axes ``letters``) as ``ids[l, c, k]``: slices ``l`` over the axes
        it shares with the other operand and the output (in the output's order, broadcast
        to the output's ``shape``), columns ``c`` over ``contracted``, slots ``k``; its
        other (token) axes at index 0."""
        if isinstance(s, Taint):
            return Side(taint=s)
        batch = [c for c in lo if c in letters and c in other]
        sizes = dict(zip(lo, shape))
        out = []
        for slot in s.slots:
            index = tuple(slice(None) if (c in batch or c in contracted) else 0 for c in letters)
            t = slot[index]
            kept = [c for c in letters if c in batch or c in contracted]
            t = t.expand([sizes[c] if c in batch else t.shape[i] for i, c in enumerate(kept)])
            t = t.permute([kept.index(c) for c in batch] + [kept.index(c) for c in contracted])
            out.append(t.reshape(math.prod(t.shape[: len(batch)]), -1))
        return Side(ids=torch.stack(out, -1))

    def _core(self, sl, ll, sr, lr, lo, contracted, shape) -> Shadow:
        """Two projections contracted over their features: attention scores."""
        for s, letters in ((sl, ll), (sr, lr)):
            if isinstance(s, Feat) and _constant_along(s, letters, contracted):
                reason = f"projections contracted over tokens in {self.here}"
                self._unknown([sl, sr], reason)
                return self._taint([sl, sr], reason, False)
        self.trace.cores.append(
            Core(
                self.where,
                self._side(sl, ll, lr, lo, contracted, shape),
                self._side(sr, lr, ll, lo, contracted, shape),
            )
        )
        return SCORE

    def _mix(self, s, letters, other, lo, contracted, out, by_scores: bool) -> Shadow:
        """Features ``s`` (axes ``letters``) mixed over their token axes ``contracted`` by
        an operand with axes ``other``: each column keeps its features."""
        if isinstance(s, Taint):
            index = len(self.trace.mixings)
            self.trace.mixings.append(Mixing(index, self.where, None, by_scores, taint=s))
            return s
        if not _constant_along(s, letters, contracted):
            return self._taint([s], f"features mixed over their columns in {self.here}", False)
        free = "".join(c for c in letters if c not in contracted)
        slices = [c for c in lo if c in free and c in other]
        cols = [c for c in free if c not in slices]
        out_slots, ids = [], []
        for slot in s.slots:
            t = slot[tuple(0 if c in contracted else slice(None) for c in letters)]
            out_slots.append(_arrange(t, free, lo, tuple(out.shape)))
            u = t.permute([free.index(c) for c in slices] + [free.index(c) for c in cols])
            ids.append(u.reshape(math.prod(u.shape[: len(slices)]), -1))
        index = len(self.trace.mixings)
        self.trace.mixings.append(Mixing(index, self.where, torch.stack(ids, -1), by_scores))
        return Feat(out_slots, mix=index)

    def _sdpa(self, args, kwargs, out) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        if bound.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = self._repeated(k, rep), self._repeated(v, rep)
        lead = string.ascii_lowercase[: q.dim() - 2]
        scores = torch.empty((*q.shape[:-1], k.shape[-2]), device="meta")
        self._set(scores, self.contract(q, k, lead + "xd", lead + "yd", lead + "xy", scores))
        result = _tensors(out)[0]
        self._set(result, self.contract(scores, v, lead + "xy", lead + "yd", lead + "xd", result))

    def _repeated(self, t: Tensor, rep: int) -> Tensor:
        """A stand-in for ``t`` with each head repeated ``rep`` times (grouped-query)."""
        s = self.shadow(t)
        shape = list(t.shape)
        shape[-3] *= rep
        stand_in = torch.empty(shape, device="meta")
        if isinstance(s, Feat):
            s = Feat([x.repeat_interleave(rep, dim=-3) for x in s.slots], s.mix)
        self._set(stand_in, s)
        return stand_in


# --- helpers ------------------------------------------------------------------------------


def _is_fake(t: Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _tensors(obj) -> list[Tensor]:
    """The tensors in ``obj`` (nested tuples, lists, dicts; other containers through
    pytree)."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        out = []
        for x in obj:
            if isinstance(x, Tensor):
                out.append(x)
            elif isinstance(x, (tuple, list, dict)) or hasattr(x, "__dict__"):
                out.extend(_tensors(x))
        return out
    if type(obj) is dict:
        return _tensors(list(obj.values()))
    if obj is None or isinstance(obj, (int, float, bool, str, torch.dtype, torch.device)):
        return []
    leaves, _ = tree_flatten(obj)
    return [x for x in leaves if isinstance(x, Tensor)]


class _IdDict(dict):
    """Shadows by tensor identity, holding the tensors (for meta and fake traces)."""

    def get(self, t, default=None):
        entry = dict.get(self, id(t))
        return entry[1] if entry is not None and entry[0] is t else default

    def __setitem__(self, t, value):
        dict.__setitem__(self, id(t), (t, value))

    def pop(self, t, default=None):
        entry = dict.get(self, id(t))
        if entry is None or entry[0] is not t:
            return default
        return dict.pop(self, id(t))[1]


def _scalar(x) -> object:
    if isinstance(x, bool):
        return CONST
    if isinstance(x, (int, float)):
        return float(x)
    return CONST


def _kind(s) -> str:
    if s is None:
        return "none"
    if s is SCORE:
        return "score"
    if s is CONST:
        return "const"
    if isinstance(s, PRef):
        return "param"
    if isinstance(s, PDerived):
        return "pderived"
    if isinstance(s, Feat):
        return "feat"
    return "taint"


def _constant_axes_dropped(t: Tensor) -> Tensor:
    """``t`` flattened, without the axes along which it is constant: broadcast axes
    first (free), then those a comparison shows constant."""
    for dim in range(t.dim()):
        if t.shape[dim] > 1 and t.stride(dim) == 0:
            t = t.narrow(dim, 0, 1)
    for dim in reversed(range(t.dim())):
        if t.shape[dim] > 1 and bool((t == t.narrow(dim, 0, 1)).all()):
            t = t.narrow(dim, 0, 1)
    return t.reshape(-1)


def _runs(t: Tensor) -> Tensor:
    """The feature ids in ``t`` as runs ``[start, stop)`` (``(k, 2)`` int64): axes along
    which ``t`` is constant are dropped first, and a projection's consecutive ids are
    one run found without sorting."""
    t = _constant_axes_dropped(t)
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo > 0 and hi < PARAM_BASE and hi - lo + 1 == t.numel():
            if t.numel() == 1 or bool(torch.diff(t).eq(1).all()):
                return torch.tensor([[lo, hi + 1]])
    t = t[(t > 0) & (t < PARAM_BASE)]
    if not t.numel():
        return torch.zeros(0, 2, dtype=_I64)
    t = t.unique()
    cut = torch.nonzero(t[1:] - t[:-1] != 1).flatten() + 1
    starts = torch.cat([t[:1], t[cut]])
    stops = torch.cat([t[cut - 1] + 1, t[-1:] + 1])
    return torch.stack([starts, stops], 1)


def _bcast(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    return torch.broadcast_to(t, shape)


def _arrange(t: Tensor, letters: str, lo: str, shape: tuple[int, ...]) -> Tensor:
    """``t`` (axes ``letters``) laid out along the output axes ``lo`` and broadcast to
    ``shape`` (axes of ``lo`` that ``t`` lacks are broadcast)."""
    if not letters:
        return t.reshape([1] * len(lo)).expand(shape)
    t = t.permute([letters.index(c) for c in lo if c in letters])
    view = [t.shape[[c for c in lo if c in letters].index(c)] if c in letters else 1 for c in lo]
    return t.reshape(view).expand(shape)


def _varies(t: Tensor, letters: str, c: str) -> bool:
    dim = letters.index(c)
    return t.shape[dim] > 1 and not bool((t == t.narrow(dim, 0, 1)).all())


def _constant_along(s: Feat, letters: str, axes: str) -> bool:
    """Whether every slot of ``s`` is the same along each axis in ``axes``."""
    for slot in s.slots:
        for c in axes:
            if _varies(slot, letters, c):
                return False
    return True


_OPERANDS = {
    "linear": ("input", "weight", "bias"),
    "addmm": ("input", "mat1", "mat2"),
    "mm": ("input", "mat2"),
    "bmm": ("input", "mat2"),
    "baddbmm": ("input", "batch1", "batch2"),
    "matmul": ("input", "other"),
    "__matmul__": ("input", "other"),
    "__rmatmul__": ("input", "other"),
}


def _einsum_spec(name, args, kwargs):
    """``((left, right), (ll, lr, lo), bias)`` of a contraction op, with the letters of
    ``einsum`` (``None``: not a two-operand contraction the trace reads)."""
    if name == "einsum":
        eq = args[0] if args else kwargs.get("equation")
        ops = tuple(args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        if len(ops) != 2 or "->" not in eq:
            return None
        lhs, lo = eq.replace(" ", "").split("->")
        ll, lr = lhs.split(",")
        if "." in ll or "." in lr:
            ll, lr, lo = _expand_ellipsis(ll, lr, lo, ops)
        return (ops[0], ops[1]), (ll, lr, lo), None
    bound = dict(zip(_OPERANDS[name], args))
    bound.update({k: v for k, v in kwargs.items() if k in _OPERANDS[name]})
    if name == "linear":
        x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
        if not (isinstance(x, Tensor) and isinstance(w, Tensor)) or w.dim() != 2 or x.dim() < 1:
            return None
        lead = string.ascii_lowercase[: x.dim() - 1]
        return (x, w), (lead + "i", "oi", lead + "o"), b
    first, second = _OPERANDS[name][-2:]
    a, b = bound.get(first), bound.get(second)
    bias = bound.get("input") if name in ("addmm", "baddbmm") else None
    if name == "__rmatmul__":
        a, b = b, a
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() < 2 or b.dim() < 2:
        return None
    n = max(a.dim(), b.dim()) - 2
    lead = string.ascii_lowercase[:n]
    la = lead[n - (a.dim() - 2) :] + "xk"
    lb = lead[n - (b.dim() - 2) :] + "ky"
    # leading axes broadcast from size 1 show the same ids in every slice
    return (a, b), (la, lb, lead + "xy"), bias


def _expand_ellipsis(ll: str, lr: str, lo: str, ops) -> tuple[str, str, str]:
    used = set((ll + lr + lo).replace(".", ""))
    spare = [c for c in string.ascii_letters if c not in used]
    out = []
    n = max(op.dim() - len(s.replace("...", "")) for op, s in zip(ops, (ll, lr)))
    fill = "".join(spare[:n])
    for op, s in zip(ops, (ll, lr)):
        k = op.dim() - len(s.replace("...", ""))
        out.append(s.replace("...", fill[n - k :]))
    out.append(lo.replace("...", fill))
    return out[0], out[1], out[2]
