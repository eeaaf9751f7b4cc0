r"""What attention computes: a trace of one forward pass that follows projection outputs.

Every tensor of the forward may carry a *shadow*, computed beside it:

* :class:`PRef`: a parameter or a view of one (also rows looked up in a table), as
  positions in the parameter;
* :class:`Feat`: an activation that is, element by element, a sum of *features*
  (outputs of projections ``x -> x W``, numbered by :class:`Source`) and of parameter
  entries (biases, rows looked up, memory tokens); slots hold their ids (0: nothing),
  one slot per term. Where the terms went through an element-wise op that is not
  linear (an activation, a normalisation, a depthwise filter) the ids are kept and the
  op is its :attr:`Feat.taint`: a pair of such features is a candidate whose group
  verification finds (:mod:`geosharp.symmetry.discovery`);
* :class:`ComplexFeat`: a complex tensor's real and imaginary parts, each a :class:`Feat`;
* :class:`Prod`: the element-wise product of two feature tensors (summed over a shared
  axis, it is a contraction);
* :class:`Taint`: derived from features through anything else (a sum with an
  activation, a reduction across features, an op the trace does not know), with the
  first reason;
* :class:`Score`: derived from a product of two projections contracted over their
  features (attention scores, or any other bilinear form), naming the cores;
* ``CONST`` / ``ZERO`` / :class:`PDerived`: computed from constants / known to be zero
  / computed from parameters only.

Data movement (views, reshapes, permutations, slices, concatenation, repetition, slice
writes) is applied to the shadows themselves, so a shadow always says, for every
element, which features it holds: a fused ``qkv`` weight, an interleaved head layout,
grouped-query repetition, rotary embeddings (real or complex) or memory tokens need no
rule of their own. Contractions are classified by what meets (:meth:`Tracer.contract`):
an activation times a weight is a projection (a new :class:`Source`); two projections
contracted over their features are a *core* (:class:`Core`); scores times features
contracted over tokens *mix* them (:class:`Mixing`), and features times a weight are
*consumed* (:class:`Consumption`). A core whose scores mix no values is a product (a
scan, a mixture-of-experts combine, a similarity): its scores leave through the next
projection as new features, so nothing after it is hidden. The events are turned into
pairs by :mod:`geosharp.symmetry.assemble`; nothing here decides what a symmetry is.

Which rule an op gets is a table, :data:`FAMILIES`: each family of ops declared once
with its rule, a function of the tracer and the op, complete in one place (adding an op
is adding it to a family, or a family of its own). An op the table does not name is
opaque: features and weight matrices entering it are recorded as unknown
(:attr:`Trace.unknown`). With ``GEOSHARP_STRICT_TRACE=1`` (the tests) an error inside a
rule is raised instead of being read as an opaque op.

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
    "FAMILIES",
    "PARAM_BASE",
    "ZERO",
    "ComplexFeat",
    "Consumption",
    "Core",
    "Family",
    "Feat",
    "Mixing",
    "Op",
    "PDerived",
    "PRef",
    "Prod",
    "Score",
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

OTHER = -1
"""The slot id of an element that holds an activation or a constant, not features
(concatenated beside them, say); 0 is an element that holds nothing: zero."""

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


CONST = _Marker("CONST")
ZERO = _Marker("ZERO")  # known to be zero: a product with it is zero, a sum with it the other


@dataclass(frozen=True)
class PRef:
    """A parameter (or a view of it): element ``idx`` is entry ``offset + idx . strides``
    of parameter ``param``; ``explicit`` lists the positions where no strides do (a
    gathered view, rows looked up in a table)."""

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


@dataclass
class Taint:
    """Derived from features through an op that is not linear in them (or that the
    trace does not know: ``certain=False``); ``reason`` says which, and where.
    ``kind``: what of the features' symmetries the op may keep: ``"nonlinear"``, a
    function of each element (an activation, a clamp), none; ``"norm"``, a
    normalisation, rotations; ``"scale"``, a scale or filter that varies with the data
    or the column, what verification finds. The features that enter a taint are
    recorded in :attr:`Trace.taints`."""

    reason: str
    certain: bool = True
    kind: str = "nonlinear"

    @property
    def keeps_nothing(self) -> bool:
        """Whether no continuous symmetry of the features' columns survives the op."""
        return self.certain and self.kind == "nonlinear"


class Feat:
    """Sums of features and parameter entries: ``slots[s][idx]`` is the id of term ``s``
    of element ``idx`` (0: none). ``mix``: the :class:`Mixing` that mixed the features
    over tokens (``None``: not mixed). ``taint``: the first element-wise op on the way
    that is not linear (``None``: a linear function of the terms)."""

    __slots__ = ("mix", "slots", "taint")

    def __init__(self, slots: list[Tensor], mix: int | None = None, taint: Taint | None = None):
        self.slots = slots
        self.mix = mix
        self.taint = taint

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.slots[0].shape)

    def __repr__(self) -> str:
        return f"Feat({len(self.slots)} slots, shape={self.shape}, mix={self.mix})"


@dataclass
class ComplexFeat:
    """A complex tensor of features: its real and imaginary parts."""

    re: Feat
    im: Feat


@dataclass
class Prod:
    """The element-wise product of two feature tensors ``a * b`` (both of the result's
    shape): summed over an axis along which both vary, a contraction."""

    a: Feat
    b: Feat


@dataclass(frozen=True)
class Score:
    """Derived from products of two projections contracted over their features: the
    :class:`Core` events numbered ``cores``."""

    cores: frozenset[int]


Shadow = PRef | PDerived | Feat | ComplexFeat | Prod | Taint | Score | _Marker


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
        return _unravel_offsets(self.feat, f)


@dataclass
class Side:
    """One operand of a contraction seen from its slices: ``ids[l, t, c, s]`` is slot
    ``s`` of column ``c`` (a contracted index, or a feature of mixed values) at position
    ``t`` (a token: the operand's other axes) of slice ``l``. Slices are ``batch``
    groups (axes shared with the other operand) of ``stacked`` slices each (free axes
    along which the features change: query heads of a grouped einsum). A side that lost
    its ids has only its ``taint``; one whose ids went through an op that is not linear
    has both."""

    ids: Tensor | None = None
    taint: Taint | None = None
    batch: int = 1
    stacked: int = 1


@dataclass
class Core:
    """Two projections contracted over their features: attention scores, or any other
    product of two projections (a scan, a mixture-of-experts combine)."""

    index: int
    module: str
    left: Side
    right: Side


@dataclass
class Mixing:
    """Features mixed over tokens by scores (or another data matrix): ``ids[l, t, c, s]``
    of the mixed operand, ``t`` the mixed positions; the mixed output carries ``mix =
    index``. ``cores``: the cores whose scores mix. A tainted operand is recorded with
    its ``taint`` (and no ids where it lost them)."""

    index: int
    module: str
    ids: Tensor | None
    by_scores: bool
    taint: Taint | None = None
    cores: frozenset[int] = frozenset()


@dataclass
class Consumption:
    """Features (mixed or not) contracted with a weight: ``feat`` holds their
    ``ids[l, t, c, s]``; the weight's entry for row ``r`` (its free axes) and column
    ``c`` (the contracted axes) sits at ``weight.offset + rows . r + cols . c``."""

    module: str
    feat: Side
    weight: PRef
    rows: tuple[tuple[int, int], ...]
    cols: tuple[tuple[int, int], ...]
    mix: int | None
    batch: tuple[tuple[int, int], ...] = ()
    source: int = -1
    """The projection the contraction makes (its :attr:`Source.sid`)."""

    def slice_offsets(self) -> Tensor:
        """Offset of every slice (row-major over the axes shared with the input)."""
        return _axes_offsets(self.batch)

    def row_offsets(self) -> Tensor:
        """Offsets of every row (row-major over the free axes)."""
        return _axes_offsets(self.rows)

    def col_offsets(self, cols: Tensor) -> Tensor:
        """Offsets of flat column numbers ``cols``."""
        return _unravel_offsets(self.cols, cols)


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
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    """The shape of each parameter of :attr:`params`."""
    lookups: dict[str, set[int]] = field(default_factory=dict)
    """Per parameter, the axes along which rows were looked up (an embedding table)."""
    opaque: list[tuple[str, str]] = field(default_factory=list)
    """``(module, op)``: features entered an op the trace cannot look into."""
    ran: set[str] = field(default_factory=set)
    """The modules whose forward ran."""
    uses: dict[str, set[str]] = field(default_factory=dict)
    """Per parameter, the modules whose forward used it (``"<loss>"``: outside the
    model's forward)."""
    unknown: list[tuple[Tensor, str, str, frozenset[str]]] = field(default_factory=list)
    """``(runs, reason, module, params)``: projection features (``runs``) or weight
    matrices (``params``) that entered an op whose effect on them the trace cannot
    read (an opaque op, a product of three projections); features that went through a
    nonlinearity before are not recorded (their columns have no continuous symmetry)."""


# --- the op families --------------------------------------------------------------------


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


@dataclass(frozen=True)
class Family:
    """A family of ops and the rule that shadows their outputs, ``rule(tracer, op)``
    (``None``: the op returns no tensor, nothing to do). ``constants_too``: the rule runs
    even when no input holds features or parameters (otherwise such an op gives a
    constant, or nothing); ``any_output``: also when no result is a floating tensor (a
    write returns its target); ``matches``: the family also takes ops whose name it
    accepts (variants of a kernel)."""

    name: str
    ops: frozenset[str]
    rule: Callable[[Tracer, Op], None] | None
    constants_too: bool = False
    any_output: bool = False
    matches: Callable[[str], bool] | None = None


_FAMILIES: list[Family] = []


def family(name: str, ops=(), *, constants_too=False, any_output=False, matches=None):
    """Register the decorated rule for the ops ``ops`` (each op in one family only)."""

    def register(rule):
        _FAMILIES.append(Family(name, frozenset(ops), rule, constants_too, any_output, matches))
        return rule

    return register


_QUERIES = {
    "size", "dim", "numel", "shape", "dtype", "device", "is_floating_point", "stride",
    "storage_offset", "data_ptr", "element_size", "ndim", "is_contiguous", "__len__",
    "tolist", "item", "__bool__", "__index__", "__int__", "__float__", "__format__",
    "__repr__", "__hash__", "requires_grad", "is_complex", "__iter__", "__contains__",
    "is_meta", "layout", "names", "grad_fn", "is_leaf", "_version", "untyped_storage",
}  # fmt: skip
_FAMILIES.append(Family("query", frozenset(_QUERIES), None, constants_too=True))


@family("shape-only", {
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "zeros",
}, constants_too=True)  # fmt: skip
def _shape_only(tracer: Tracer, op: Op) -> None:
    """Factories that take a tensor's shape, not its values: a constant (zero for the
    zeros)."""
    zero = op.name in ("zeros_like", "new_zeros", "zeros") or (
        op.name in ("full_like", "new_full") and _number(op.args, 1) == 0
    )
    for t in op.outs:
        tracer.set(t, ZERO if zero else CONST)


@family("lookup", {"embedding"}, constants_too=True)
def _lookup(tracer: Tracer, op: Op) -> None:
    """Rows of a parameter table picked by integer ids: the parameter entries, listed
    (the table's row axis is recorded: a pair holding a column of it holds every row)."""
    ids, weight = _bound(op, ("input", "weight"))
    ref = tracer.shadow(weight) if isinstance(weight, Tensor) else None
    if not isinstance(ref, PRef) or ref.explicit is not None or ref.shape != tuple(weight.shape):
        return
    out = op.outs[0]
    if ids.is_meta or _is_fake(ids) or out.dim() != ids.dim() + 1:
        tracer.set(out, Taint(f"rows of {ref.param} looked up by ids of unknown value", False))
        return
    rows = ids.detach().cpu().to(_I64)[..., None] * ref.strides[0]
    cols = torch.arange(ref.shape[1], dtype=_I64) * ref.strides[1]
    positions = (ref.offset + rows + cols).contiguous()
    tracer.trace.lookups.setdefault(ref.param, set()).add(0)
    tracer.set(
        out, PRef(ref.param, 0, tuple(positions.stride()), tuple(positions.shape), positions)
    )


@family("write", {"__setitem__", "copy_", "fill_", "zero_"}, any_output=True)
def _write(tracer: Tracer, op: Op) -> None:
    """A write into (part of) a tensor: its shadow, and that of the tensor it views,
    take what is written where it is written."""
    target = op.args[0]
    if op.name == "__setitem__":
        index, value = op.args[1], op.args[2]
    else:
        index = None
        value = op.args[1] if op.name == "copy_" else (0.0 if op.name == "zero_" else op.args[1])
    tracer.write(target, index, value)


_MOVE = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "swapaxes", "swapdims",
    "permute", "contiguous", "clone", "__getitem__", "expand", "expand_as", "repeat",
    "repeat_interleave", "squeeze", "unsqueeze", "flatten", "unflatten", "narrow",
    "select", "split", "split_with_sizes", "chunk", "unbind", "t", "T", "mT", "movedim",
    "moveaxis", "roll", "flip", "index_select", "gather", "take_along_dim", "tile",
    "broadcast_to", "cat", "concat", "concatenate", "stack", "hstack", "vstack",
    "tensor_split", "diagonal", "pad", "detach", "__reversed__", "as_strided", "tril",
    "triu",
}  # fmt: skip
# Ops that change neither values' sources nor their layout.
_SAME = {
    "to", "float", "double", "half", "bfloat16", "type", "type_as", "cpu", "cuda",
    "requires_grad_", "detach_", "dropout", "alpha_dropout", "feature_alpha_dropout",
    "__neg__", "neg", "negative", "positive", "__pos__", "conj", "resolve_conj",
    "resolve_neg",
}  # fmt: skip


@family("movement", _MOVE | _SAME)
def _movement(tracer: Tracer, op: Op) -> None:
    """Data movement and identities: applied to the shadows themselves."""
    tracer.move(op)


@family("complex", {"view_as_complex", "view_as_real", "real", "imag", "complex"})
def _complex(tracer: Tracer, op: Op) -> None:
    """Complex numbers: a complex tensor of features holds its real and imaginary parts
    (a rotation by a complex number is the sum of both in each part)."""
    out = op.outs[0]
    s = op.shadows[0] if op.shadows else None
    if op.name == "view_as_complex" and isinstance(s, Feat) and s.shape[-1] == 2:
        parts = [Feat([x[..., k] for x in s.slots], s.mix, s.taint) for k in (0, 1)]
        tracer.set(out, ComplexFeat(*parts))
    elif op.name == "view_as_real" and isinstance(s, ComplexFeat):
        n = max(len(s.re.slots), len(s.im.slots))
        re, im = (_padded(p.slots, n) for p in (s.re, s.im))
        tracer.set(out, Feat([torch.stack([a, b], -1) for a, b in zip(re, im)], s.re.mix,
                             s.re.taint or s.im.taint))  # fmt: skip
    elif op.name in ("real", "imag") and isinstance(s, ComplexFeat):
        tracer.set(out, s.re if op.name == "real" else s.im)
    elif op.name == "complex" and all(isinstance(x, Feat) for x in op.shadows[:2]):
        a, b = op.shadows[:2]
        if a.mix != b.mix:
            raise _Unsupported("complex() of features mixed differently")
        tracer.set(out, ComplexFeat(a, b))
    elif any(isinstance(x, Score) for x in op.shadows):
        tracer.set(out, tracer.scores(op.shadows))
    else:
        tracer.generic(op, certain=False)


_ADD = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__",
        "__isub__", "sub_", "subtract"}  # fmt: skip


@family("sum", _ADD)
def _sum(tracer: Tracer, op: Op) -> None:
    """Sums: features add up slot by slot, parameters added to features are terms (a
    bias, a row looked up), anything else added to features taints them."""
    a, b = op.args[0], op.args[1] if len(op.args) > 1 else op.kwargs.get("other")
    sa = tracer.shadow(a) if isinstance(a, Tensor) else CONST
    sb = tracer.shadow(b) if isinstance(b, Tensor) else (CONST if b is None else _scalar(b))
    tracer.set_all(op.outs, tracer.add(sa, sb, tuple(op.outs[0].shape)))


_MUL = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply", "div", "__truediv__",
        "__itruediv__", "div_", "true_divide", "divide"}  # fmt: skip


@family("product", _MUL)
def _product(tracer: Tracer, op: Op) -> None:
    """Element-wise products: a scale (a number, a parameter, an activation, a gate)
    keeps the features (a scale that varies across a head's columns is decided by the
    pair's verification), two feature tensors make a :class:`Prod`, a complex constant
    rotates complex features."""
    a, b = op.args[0], op.args[1] if len(op.args) > 1 else op.kwargs.get("other")
    sa = tracer.shadow(a) if isinstance(a, Tensor) else _scalar(a)
    sb = tracer.shadow(b) if isinstance(b, Tensor) else _scalar(b)
    divides = op.name in ("div", "__truediv__", "__itruediv__", "div_", "true_divide", "divide")
    tracer.set_all(op.outs, tracer.mul(a, b, sa, sb, divides, tuple(op.outs[0].shape)))


@family("select", {"where"})
def _select(tracer: Tracer, op: Op) -> None:
    """``where``: scores stay scores (masking); features picked element by element are
    not followed."""
    _, a, b = [*op.args, op.kwargs.get("input"), op.kwargs.get("other")][:3]
    shadows = [tracer.shadow(x) if isinstance(x, Tensor) else None for x in (a, b)]
    if any(isinstance(s, Score) for s in shadows):
        tracer.set_all(op.outs, tracer.scores(shadows))
    elif any(isinstance(s, (Feat, ComplexFeat, Prod)) for s in shadows):
        raise _Unsupported("where() on features")
    else:
        tracer.generic(op, certain=True)


_TOKEN_LINEAR = {"sum", "mean", "cumsum", "nansum", "nanmean"}


@family("reduction", _TOKEN_LINEAR)
def _reduction(tracer: Tracer, op: Op) -> None:
    """Sums and means: along axes where every element holds the same features (tokens,
    landmarks, windows) they keep them; a product of features summed over an axis along
    which both vary is a contraction; across features, a taint."""
    s = op.shadows[0] if op.shadows else None
    if isinstance(s, Feat):
        tracer.reduce(op)
    elif isinstance(s, Prod):
        tracer.reduce_product(op)
    elif isinstance(s, Score):
        tracer.set_all(op.outs, s)
    else:
        tracer.generic(op, certain=True)


_NORMS = {"normalize", "rms_norm", "layer_norm", "group_norm", "batch_norm", "instance_norm"}
_ELEMENTWISE = _NORMS | {
    "softmax", "log_softmax", "gelu", "relu", "silu", "sigmoid", "tanh", "exp", "log",
    "pow", "__pow__", "sqrt", "rsqrt", "abs", "clamp", "clip", "clamp_", "clamp_min",
    "clamp_max", "erf", "square", "reciprocal", "softplus", "mish", "elu", "leaky_relu",
    "hardtanh", "sign", "floor", "ceil", "round", "relu6", "__abs__", "cos", "sin", "atan",
    "hardswish", "hardsigmoid", "logsigmoid", "log1p", "expm1", "selu", "celu", "silu_",
    "relu_", "softsign", "tanhshrink", "masked_fill", "masked_fill_", "gelu_", "sigmoid_",
    "tanh_", "exp_", "nan_to_num", "threshold", "softmin", "erfc", "logit",
}  # fmt: skip


@family("element-wise", _ELEMENTWISE)
def _elementwise(tracer: Tracer, op: Op) -> None:
    """Element-wise functions that are not linear (activations, normalisations, clamps,
    masked fills): one feature tensor in, of the result's shape, keeps its ids with the
    op as its taint (verification then finds which group, if any, survives it);
    scores stay scores."""
    tracer.elementwise(op)


@family("convolution", {"conv1d", "conv2d", "conv3d"})
def _convolution(tracer: Tracer, op: Op) -> None:
    """A depthwise filter over tokens (one filter per channel: Mamba's causal
    convolution) keeps each channel's features, a taint that no continuous symmetry of
    the channels survives; any other convolution taints its input."""
    x, weight = _bound(op, ("input", "weight"))
    s = tracer.shadow(x) if isinstance(x, Tensor) else None
    groups = _bound(op, ("input", "weight", "bias", "stride", "padding", "dilation", "groups"))[6]
    depthwise = (
        isinstance(s, Feat)
        and isinstance(weight, Tensor)
        and groups == x.shape[1] == weight.shape[0]
        and weight.shape[1] == 1
        and _constant_along(
            s, string.ascii_lowercase[: x.dim()], string.ascii_lowercase[2 : x.dim()]
        )
    )
    if not depthwise:
        return tracer.generic(op, certain=True)
    out = op.outs[0]
    index = (slice(None), slice(None)) + (slice(0, 1),) * (x.dim() - 2)
    taint = _stronger(
        s.taint, Taint(f"{op.name} (a filter per channel) in {tracer.here}", kind="scale")
    )
    tracer.record_taint([s], taint)
    tracer.set(out, Feat([slot[index].expand(out.shape) for slot in s.slots], s.mix, taint))


_NONLINEAR = {
    "var", "std", "norm", "max", "min", "amax", "amin", "logsumexp", "glu", "prod",
    "var_mean", "std_mean", "cross_entropy", "nll_loss", "mse_loss", "l1_loss",
    "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "embedding_bag", "topk", "sort",
    "kthvalue", "median", "cummax", "cummin", "cumprod", "max_pool1d", "max_pool2d",
    "maximum", "minimum", "fmax", "fmin", "hypot", "atan2", "lerp",
}  # fmt: skip


@family("nonlinear", _NONLINEAR)
def _nonlinear(tracer: Tracer, op: Op) -> None:
    """Reductions across features, losses, sorts, max-pooling: certainly not linear in
    the features that enter (their ids are lost)."""
    tracer.generic(op, certain=True)


_UNFOLLOWED = {
    "conv_transpose1d", "conv_transpose2d", "avg_pool1d", "avg_pool2d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "interpolate", "index_add", "index_add_",
    "scatter_add", "scatter_add_", "scatter", "scatter_", "index_copy", "index_copy_",
    "index_put", "index_put_",
}  # fmt: skip


@family("unfollowed linear", _UNFOLLOWED)
def _unfollowed(tracer: Tracer, op: Op) -> None:
    """Linear maps the trace does not read into (transposed convolutions, average
    pooling, interpolation, writes and sums over positions): their outputs mix
    positions or features in ways no rule here follows, so the ids that enter are lost,
    as through a nonlinear op, and a pair whose features pass is not claimed."""
    tracer.generic(op, certain=True)


_CONTRACTIONS = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm",
                 "addmm", "einsum"}  # fmt: skip


@family("contraction", _CONTRACTIONS, constants_too=True)
def _contraction(tracer: Tracer, op: Op) -> None:
    """Products summed over shared axes (linear layers, matmuls, einsums of any number
    of operands, taken two at a time): see :meth:`Tracer.contract`."""
    tracer.contraction(op)


def _is_sdpa(name: str) -> bool:
    """``scaled_dot_product_attention`` and its variants (not their backward)."""
    return "scaled_dot_product" in name and "attention" in name and "backward" not in name


@family("attention kernel", matches=_is_sdpa, constants_too=True)
def _attention_kernel(tracer: Tracer, op: Op) -> None:
    """An attention kernel whose computation is known: ``softmax(q k^T + mask) v``."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    bound = dict(zip(names, op.args))
    bound.update(op.kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if bound.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = tracer.repeated(k, rep), tracer.repeated(v, rep)
    tracer.attend(q, k, v, _tensors(op.out)[0])


@family("flex attention", {"flex_attention"}, constants_too=True)
def _flex_attention(tracer: Tracer, op: Op) -> None:
    """``flex_attention`` (its higher-order op, called eagerly during the trace): the
    scores of ``q k^T``, then its ``score_mod`` run on them under the trace, which must
    leave them scores (it reads only the scores, their indices, constants and
    parameters), then the values mixed."""
    q, k, v, score_mod = op.args[:4]
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = tracer.repeated(k, rep), tracer.repeated(v, rep)
    b, h, n, _ = q.shape
    m = k.shape[-2]
    scores = torch.zeros((b, h, n, m))
    tracer.set(scores, tracer.contract_tensors(q, k, "abxd", "abyd", "abxy", scores))
    if score_mod is not None:
        idx = [torch.arange(s).view([-1 if i == j else 1 for j in range(4)])
               for i, s in enumerate((b, h, n, m))]  # fmt: skip
        with _Mode(tracer):
            modified = score_mod(scores, *idx)
        if not isinstance(tracer.shadow(modified), Score):
            raise _Unsupported("a score_mod that reads more than the scores")
        scores = modified
    out = _tensors(op.out)[0]
    tracer.set(out, tracer.contract_tensors(scores, v, "abxy", "abyd", "abxd", out))


@family("functional attention", {"multi_head_attention_forward"}, constants_too=True)
def _functional_attention(tracer: Tracer, op: Op) -> None:
    """``F.multi_head_attention_forward`` with its projections, bias keys and values
    and masks, read through a decomposition into the ops it computes, traced."""
    out = _tensors(op.out)
    with _Mode(tracer):
        ours = _mha_reference(*op.args, **op.kwargs)
    for t, mine in zip(out, ours):
        if isinstance(mine, Tensor):
            tracer.set(t, tracer.shadow(mine))


RULES: dict[str, Family] = {}
for _f in _FAMILIES:
    _twice = _f.ops & RULES.keys()
    assert not _twice, f"{sorted(_twice)} in two op families"
    RULES.update(dict.fromkeys(_f.ops, _f))
FAMILIES: tuple[Family, ...] = tuple(_FAMILIES)
"""Every op family the trace knows, with its rule (see :class:`Family`)."""
_MATCHING = [f for f in FAMILIES if f.matches is not None]


def _opaque(tracer: Tracer, op: Op) -> None:
    tracer.generic(op, certain=False)


OPAQUE = Family("opaque", frozenset(), _opaque)
"""An op no family names: what enters it is not followed (recorded as unknown)."""


def family_of(name: str) -> Family:
    """The family of the op named ``name``."""
    found = RULES.get(name)
    if found is not None:
        return found
    return next((f for f in _MATCHING if f.matches(name)), OPAQUE)


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


_CONDITIONS = {
    "all", "any", "__eq__", "eq", "__ne__", "ne", "__lt__", "lt", "__le__", "le", "__gt__",
    "gt", "__ge__", "ge", "isnan", "isinf", "isfinite", "logical_and", "logical_or",
    "logical_not", "__and__", "__or__", "__invert__",
}  # fmt: skip
"""Boolean results that Python code branches on (``if mask.all():``): on the meta
device they read as False."""


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
            self.trace.shapes.append(tuple(tensor.shape))
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
        """Trace what runs inside: module stack hooks and the function mode
        (``flex_attention`` runs eagerly, so that the mode sees its op)."""
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
        flex = _flex_module()
        eager = getattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
        if flex is not None:
            flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        try:
            with _Mode(self):
                yield
        finally:
            pre.remove()
            post.remove()
            if flex is not None:
                flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = eager

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

    def after(self, func, args, kwargs, out) -> None:
        """Shadow the result of one op by its family's rule (:data:`FAMILIES`)."""
        name = _name(func)
        fam = family_of(name)
        if fam.rule is None:
            return
        outs = _tensors(out)
        if not fam.any_output and not any(t.is_floating_point() or t.is_complex() for t in outs):
            return  # indices and masks (argmax, comparisons) carry no features
        inputs = _tensors((args, kwargs))
        for t in inputs:
            index = self._param_index.get(id(t))
            if index is not None:
                where = self._stack[-1] if self._stack else "<loss>"
                self.trace.uses.setdefault(self.trace.params[index], set()).add(where)
        shadows = [self.shadow(t) for t in inputs if t.is_floating_point() or t.is_complex()]
        if not fam.constants_too and all(s is None for s in shadows):
            if not inputs:  # a factory: constant
                self.set_all(outs, CONST)
            return
        fam.rule(self, Op(func, name, args, kwargs, out, outs, shadows))

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

    def set(self, t: object, s: Shadow | None) -> None:
        """Give tensor ``t`` the shadow ``s`` (only floating tensors get shadows: indices
        and masks carry no features); ``None`` removes it."""
        if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
            return
        if s is None:
            self.shadows.pop(t, None)
        else:
            self.shadows[t] = s

    def set_all(self, outs: list[Tensor], s: Shadow | None) -> None:
        for t in outs:
            self.set(t, s)

    def param_number(self, name: str) -> int:
        return self._numbers[name]

    # -- recording -------------------------------------------------------------------------

    def unsupported(self, args, kwargs, out, what: str) -> None:
        """An op the trace cannot follow: features entering it are tainted (uncertain)."""
        shadows = [self.shadow(t) for t in _tensors((args, kwargs))]
        self.set_all(_tensors(out), self.opaque_result(shadows, f"{what} in {self.here}", what))

    def opaque_result(self, shadows: list, reason: str, what: str) -> Shadow | None:
        """The shadow of an op whose effect the trace cannot read: scores stay scores,
        features and weight matrices entering it are recorded as unknown."""
        if any(isinstance(s, Score) for s in shadows):
            return self.scores(shadows)
        matrices = frozenset(s.param for s in shadows if isinstance(s, PRef) and len(s.shape) >= 2)
        carries = [s for s in shadows if isinstance(s, (Feat, ComplexFeat, Prod, Taint))]
        if not carries and not (matrices and any(s is None for s in shadows)):
            return self.plain_result(shadows)
        self.trace.opaque.append((self.where, what))
        self.unknown(shadows, reason, matrices)
        return self.taint(shadows, reason, certain=False)

    def unknown(self, shadows: list, reason: str, params: frozenset[str] = frozenset()) -> None:
        """Record the features of ``shadows`` (and the weight matrices ``params``) as
        entering an op whose effect on them the trace cannot read; features that went
        through a nonlinearity before are left out."""
        runs = [
            _runs(slot)
            for f in _feats(shadows)
            if not (f.taint is not None and f.taint.keeps_nothing)
            for slot in f.slots
        ]
        runs = [r for r in runs if r.numel()]
        if runs or params:
            joined = torch.cat(runs) if runs else torch.zeros(0, 2, dtype=_I64)
            self.trace.unknown.append((joined, reason, self.where, params))

    def record_taint(self, shadows: list, taint: Taint) -> None:
        """Record the features of ``shadows`` as entering ``taint``."""
        runs = [_runs(slot) for f in _feats(shadows) for slot in f.slots]
        runs = [r for r in runs if r.numel()]
        if runs:
            self.trace.taints.append((torch.cat(runs), taint.reason, taint.certain, self.where))

    def taint(self, shadows: list, reason: str, certain: bool) -> Taint:
        """The taint of an op's result: the first input taint's, else a new one; the
        features of the op's inputs are recorded as tainted by it."""
        first = next((s for s in shadows if isinstance(s, Taint)), None)
        taint = (
            Taint(first.reason, first.certain and certain)
            if first is not None
            else Taint(reason, certain)
        )
        self.record_taint(shadows, taint)
        return taint

    def scores(self, shadows: list) -> Score:
        """The scores of every core that ``shadows`` derive from."""
        cores = frozenset().union(*(s.cores for s in shadows if isinstance(s, Score)))
        return Score(cores)

    def plain_result(self, shadows: list) -> Shadow | None:
        """The result of an op on no features: computed from parameters, an activation,
        or a constant."""
        if any(isinstance(s, (PRef, PDerived)) for s in shadows):
            if any(s is None for s in shadows):
                return None  # a parameter applied to an activation: an activation
            params: set[str] = set()
            for s in shadows:
                if isinstance(s, PRef):
                    params.add(s.param)
                elif isinstance(s, PDerived):
                    params |= s.params
            return PDerived(frozenset(params))
        if any(s is None for s in shadows):
            return None
        return CONST

    def generic(self, op: Op, certain: bool) -> None:
        """An op the trace does not read into: scores stay scores, features are tainted
        (``certain=False``: the op is opaque, and they are recorded as unknown)."""
        shadows = op.shadows
        if not certain:
            self.set_all(op.outs, self.opaque_result(shadows, f"{op.name} in {self.here}", op.name))
            return
        if any(isinstance(s, Score) for s in shadows):
            result: Shadow | None = self.scores(shadows)
        elif any(isinstance(s, (Feat, ComplexFeat, Prod, Taint)) for s in shadows):
            result = self.taint(shadows, f"{op.name} in {self.here}", certain=True)
        else:
            result = self.plain_result(shadows)
        self.set_all(op.outs, result)

    # -- element-wise ----------------------------------------------------------------------

    def elementwise(self, op: Op) -> None:
        shadows = op.shadows
        if any(isinstance(s, Score) for s in shadows):
            return self.set_all(op.outs, self.scores(shadows))
        feats = [s for s in shadows if isinstance(s, (Feat, ComplexFeat, Prod, Taint))]
        out = op.outs[0]
        one = (
            len(feats) == 1
            and isinstance(feats[0], Feat)
            and feats[0].shape == tuple(out.shape)
            and len(op.outs) == 1
        )
        if not one:
            return self.generic(op, certain=True)
        s = feats[0]
        if op.name in ("masked_fill", "masked_fill_"):
            # filled with zero, the positions hold no feature: still linear
            mask = op.args[1] if len(op.args) > 1 else op.kwargs.get("mask")
            value = op.args[2] if len(op.args) > 2 else op.kwargs.get("value")
            if isinstance(mask, Tensor) and not (mask.is_meta or _is_fake(mask)) and value == 0:
                keep = ~mask.detach().cpu().expand(out.shape)
                self.set(out, Feat([x * keep for x in s.slots], s.mix, s.taint))
                return
        fresh = Taint(
            f"{op.name} in {self.here}", True, "norm" if op.name in _NORMS else "nonlinear"
        )
        self.record_taint([s], fresh)
        taint = _stronger(s.taint, fresh)
        self.set(out, Feat(list(s.slots), s.mix, taint))

    def add(self, sa, sb, shape: tuple[int, ...]) -> Shadow | None:
        """The shadow of ``a + b`` (or ``a - b``)."""
        if sa is ZERO or sb is ZERO:
            return sb if sa is ZERO else sa
        pair = [sa, sb]
        if any(isinstance(s, Score) for s in pair):
            # terms of the scores (a bias, positions, a mask, another core); features
            # added to them are tainted (a residual stream after a product: its next
            # projection makes new features)
            features = [s for s in pair if isinstance(s, (Feat, ComplexFeat, Prod))]
            if features:
                self.taint(features, f"features added to scores in {self.here}", True)
            return self.scores(pair)
        if isinstance(sa, Taint) or isinstance(sb, Taint):
            return self.taint(pair, "", True)
        if isinstance(sa, Prod) or isinstance(sb, Prod):
            if isinstance(sa, Prod) and isinstance(sb, Prod) and _same_prod(sa, sb):
                return sa
            return self.taint(pair, f"a sum of products of features in {self.here}", True)
        if isinstance(sa, ComplexFeat) or isinstance(sb, ComplexFeat):
            if isinstance(sa, ComplexFeat) and isinstance(sb, ComplexFeat):
                re, im = self.add(sa.re, sb.re, shape), self.add(sa.im, sb.im, shape)
                if isinstance(re, Feat) and isinstance(im, Feat):
                    return ComplexFeat(re, im)
            return self.taint(pair, f"a constant added to complex features in {self.here}", True)
        if not (isinstance(sa, Feat) or isinstance(sb, Feat)):
            return self.plain_result(pair)
        feat, other = (sa, sb) if isinstance(sa, Feat) else (sb, sa)
        if isinstance(other, Feat):
            if feat.mix != other.mix:  # values mixed by two scores: a joint pair, perhaps
                reason = f"a sum of features mixed differently in {self.here}"
                return self.taint(pair, reason, False)
            return Feat(
                _joined(feat.slots, other.slots, shape), feat.mix, feat.taint or other.taint
            )
        if isinstance(other, PRef):
            if other.numel > _MATERIALISE and other.explicit is None:
                raise _Unsupported("a large parameter added to features")
            entries = param_entry(self.param_number(other.param), other.positions())
            return Feat(_joined(feat.slots, [entries], shape), feat.mix, feat.taint)
        if other == 0.0:  # adding zero
            return Feat([_bcast(s, shape) for s in feat.slots], feat.mix, feat.taint)
        what = (
            "a constant"
            if other is CONST or isinstance(other, float)
            else (
                "a tensor computed from parameters"
                if isinstance(other, PDerived)
                else "an activation"
            )
        )
        return self.taint([feat], f"{what} added in {self.here}", True)

    def mul(self, a, b, sa, sb, divides: bool, shape: tuple[int, ...]) -> Shadow | None:
        """The shadow of ``a * b`` (or ``a / b``)."""
        pair = [sa, sb]
        if sa is ZERO or (sb is ZERO and not divides):
            return ZERO
        if any(isinstance(s, Score) for s in pair):
            # a scale of the scores (a temperature, a gate): scores; features that
            # scale them are tainted
            features = [s for s in pair if isinstance(s, (Feat, ComplexFeat, Prod))]
            if features:
                self.taint(features, f"features that multiply scores in {self.here}", True)
            return self.scores(pair)
        if isinstance(sa, ComplexFeat) or isinstance(sb, ComplexFeat):
            return self.mul_complex(a, b, sa, sb, divides, shape)
        gate = _gate(sa, sb, divides)
        if gate is not None:  # features through a nonlinearity scale the others: a gate
            self.record_taint([sa, sb], Taint(f"a gate in {self.here}", kind="scale"))
            sa, sb = (CONST, sb) if gate is sa else (sa, CONST)
        if isinstance(sa, Feat) and isinstance(sb, Feat):
            if divides:
                return self.taint(pair, f"a quotient of features in {self.here}", True)
            if sa.mix != sb.mix:
                return self.taint(
                    pair, f"a product of features mixed differently in {self.here}", True
                )
            return Prod(_bcast_feat(sa, shape), _bcast_feat(sb, shape))
        if isinstance(sa, Prod) or isinstance(sb, Prod):
            prod, other = (sa, sb) if isinstance(sa, Prod) else (sb, sa)
            if isinstance(other, (Feat, Prod)) or (divides and other is not sb):
                return self.taint(pair, f"a product of three feature tensors in {self.here}", True)
            if other is None or isinstance(other, Taint):
                self.record_taint(
                    [prod], Taint(f"scaled by an activation in {self.here}", kind="scale")
                )
            return Prod(_bcast_feat(prod.a, shape), _bcast_feat(prod.b, shape))
        if isinstance(sa, Feat) or isinstance(sb, Feat):
            feat, other = (sa, sb) if isinstance(sa, Feat) else (sb, sa)
            if divides and not isinstance(sa, Feat):
                return self.taint(pair, f"division by features in {self.here}", True)
            # scaled by a number, a parameter, an activation or a gate: a scale shared
            # by a head's columns commutes with GL(h) of that head, one that varies
            # across them does not; the pair is kept as a candidate and its
            # numerical verification decides. A scale that the data sets cannot be
            # absorbed by any weight: where verification refutes the pair, no symmetry
            # exists (a parameter's scale might be absorbed by the other side's)
            if (other is None or isinstance(other, Taint)) and _tensor_like(a, b, feat):
                self.record_taint(
                    [feat], Taint(f"scaled by an activation in {self.here}", kind="scale")
                )
            return _bcast_feat(feat, shape)
        if isinstance(sa, Taint) or isinstance(sb, Taint):
            return self.taint(pair, "", True)
        if isinstance(sa, PRef) and _is_number(b, sb):
            return sa  # a parameter times a number (or a parameter scalar): the same entries
        if isinstance(sb, PRef) and not divides and _is_number(a, sa):
            return sb
        return self.plain_result(pair)

    def mul_complex(self, a, b, sa, sb, divides: bool, shape) -> Shadow:
        """Complex features times a number: a real one scales them, a complex one
        rotates them (each part the sum of both); times features, a taint."""
        cf, other, other_t = (sa, sb, b) if isinstance(sa, ComplexFeat) else (sb, sa, a)
        if isinstance(other, (Feat, ComplexFeat, Prod)) or (divides and cf is sb):
            return self.taint([sa, sb], f"a product of complex features in {self.here}", True)
        if isinstance(other, Taint):
            return self.taint([sa, sb], "", True)
        re, im = _bcast_feat(cf.re, shape), _bcast_feat(cf.im, shape)
        rotates = isinstance(other_t, complex) or (
            isinstance(other_t, Tensor)
            and other_t.is_complex()
            and (other_t.is_meta or _is_fake(other_t) or bool(other_t.imag.ne(0).any()))
        )
        if not rotates:
            return ComplexFeat(re, im)
        return ComplexFeat(
            Feat(_joined(re.slots, im.slots, shape), re.mix, re.taint or im.taint),
            Feat(_joined(im.slots, re.slots, shape), im.mix, re.taint or im.taint),
        )

    def reduce(self, op: Op) -> None:
        """A sum, mean or cumulative sum of features: along axes where every element
        holds the same features (tokens, landmarks, windows) it keeps them; across
        features it is not linear in the head's columns (a taint)."""
        feat = op.shadows[0]
        dims = _dims(op)
        if len(op.shadows) != 1 or dims is None:
            return self.generic(op, certain=True)
        for slot in feat.slots:
            for d in dims:
                if not bool((slot == slot.narrow(d, 0, 1)).all()):
                    return self.generic(op, certain=True)
        self.set_all(op.outs, Feat(_reduced(feat.slots, op, dims), feat.mix, feat.taint))

    def reduce_product(self, op: Op) -> None:
        """A sum of a product of features: over axes along which both factors vary, a
        contraction of the two (attention scores written as ``(q * k).sum(-1)``); over
        axes along which neither varies, the product."""
        prod = op.shadows[0]
        dims = _dims(op)
        if dims is None or op.name == "cumsum" or len(op.shadows) != 1:
            return self.generic(op, certain=True)
        a, b = prod.a, prod.b
        both = [d for d in dims if _varies_any(a, d) and _varies_any(b, d)]
        if any(d not in both and (_varies_any(a, d) or _varies_any(b, d)) for d in dims):
            return self.generic(op, certain=True)
        out = op.outs[0]
        if not both:
            self.set_all(op.outs, Prod(*(Feat(_reduced(f.slots, op, dims), f.mix, f.taint)
                                         for f in (a, b))))  # fmt: skip
            return
        # the axes neither factor varies along first, then the contraction over the rest
        neither = [d for d in dims if d not in both]
        keep = [d for d in range(len(a.shape)) if d not in neither]
        a, b = (Feat([_drop_axes(t, neither) for t in f.slots], f.mix, f.taint) for f in (a, b))
        letters = "".join(string.ascii_letters[d] for d in keep)
        lo = "".join(string.ascii_letters[d] for d in keep if d not in both)
        shape = tuple(a.shape[i] for i, d in enumerate(keep) if d not in both)
        result = self.contract(a, b, letters, letters, lo, shape)
        if isinstance(result, Feat):
            result = Feat([t.reshape(out.shape) for t in result.slots], result.mix, result.taint)
        self.set_all(op.outs, result)

    # -- data movement ---------------------------------------------------------------------

    def move(self, op: Op) -> None:
        func, name, args, kwargs, outs, shadows = (
            op.func, op.name, op.args, op.kwargs, op.outs, op.shadows
        )  # fmt: skip
        if name in _SAME:
            # a cast or an identity (eval-mode dropout): each element keeps its sources,
            # and a parameter view's element keeps its place in the parameter
            first = shadows[0] if shadows else None
            self.set_all(outs, first)
            return
        kinds = {type(s) if not isinstance(s, _Marker) else s for s in shadows if s is not None}
        if Score in kinds:
            self.set_all(outs, self.scores(shadows))
        elif Taint in kinds:
            self.set_all(outs, self.taint(shadows, "", True))
        elif Prod in kinds:
            if len(shadows) != 1 or not self._single(args, kwargs, shadows[0]):
                self.set_all(outs, self.taint(shadows, f"{name} of a product of features", True))
                return
            a, b = (self._moved_slots(func, args, kwargs, f, None, outs) for f in
                    (shadows[0].a, shadows[0].b))  # fmt: skip
            for j, t in enumerate(outs):
                self.set(t, Prod(a[j], b[j]))
        elif ComplexFeat in kinds:
            feats = [s for s in shadows if isinstance(s, ComplexFeat)]
            re = self._moved_slots(func, args, kwargs, None, "re", outs)
            im = self._moved_slots(func, args, kwargs, None, "im", outs)
            for j, t in enumerate(outs):
                self.set(t, ComplexFeat(re[j], im[j]))
            del feats
        elif Feat in kinds:
            feats = [s for s in shadows if isinstance(s, Feat)]
            single = (
                feats[0] if len(shadows) == 1 and self._single(args, kwargs, feats[0]) else None
            )
            moved = self._moved_slots(func, args, kwargs, single, None, outs)
            self.set_all_each(outs, moved)
        elif PRef in kinds or PDerived in kinds:
            refs = [s for s in shadows if isinstance(s, PRef)]
            if len(refs) == 1 and kinds <= {PRef}:
                tensor = next(
                    t for t in _tensors((args, kwargs)) if isinstance(self.shadow(t), PRef)
                )
                moved = self.move_param(func, args, kwargs, tensor, refs[0], len(outs))
                for t, ref in zip(outs, moved):
                    self.set(t, ref)
                return
            self.set_all(outs, self.plain_result(shadows))
        elif kinds == {ZERO}:
            self.set_all(outs, ZERO)
        else:
            self.set_all(outs, None if any(s is None for s in shadows) else CONST)

    def set_all_each(self, outs: list[Tensor], shadows: list) -> None:
        for t, s in zip(outs, shadows):
            self.set(t, s)

    def _single(self, args, kwargs, s) -> bool:
        """Whether the op moves one tensor (whose shadow is ``s``) and no other."""
        return (
            isinstance(args[0], Tensor)
            and self.shadow(args[0]) is s
            and not any(isinstance(a, Tensor) for a in args[1:])
            and not any(isinstance(v, Tensor) for v in kwargs.values())
        )

    def _moved_slots(self, func, args, kwargs, single: Feat | None, part, outs) -> list[Feat]:
        """The moved :class:`Feat` of each output, slot by slot (``part``: of complex
        features, ``"re"`` or ``"im"``)."""
        feats = [self._part(s, part) for s in map(self.shadow, _tensors((args, kwargs)))]
        feats = [f for f in feats if isinstance(f, Feat)]
        if single is not None:
            feats = [single]
        mixes = {f.mix for f in feats}
        if len(mixes) > 1:
            raise _Unsupported("data movement joins differently mixed features")
        n_slots = max(len(f.slots) for f in feats)
        taint = next((f.taint for f in feats if f.taint is not None), None)
        slot_outs = []
        for k in range(n_slots):
            if single is not None:  # one tensor moved (a view, reshape, ...): no substitution
                slot = single.slots[k]
                rest, named = args[1:], kwargs
                if func_name(func) == "as_strided":  # strides of the real tensor's storage
                    slot = _laid_out_like(slot, args[0])
                if func_name(func) == "pad":  # a constant pad holds nothing if zero
                    rest, named = _padding(args, kwargs, k)
                try:
                    moved = func(slot, *rest, **named)
                except RuntimeError:  # a view the slot's own strides do not allow
                    moved = func(slot.contiguous(), *rest, **named)
            else:
                moved = func(*self.slot_args(args, k, part), **self.slot_args(kwargs, k, part))
            slot_outs.append(_tensors(moved))
        return [Feat([so[j] for so in slot_outs], feats[0].mix, taint) for j in range(len(outs))]

    @staticmethod
    def _part(s, part):
        if part is None:
            return s
        return getattr(s, part) if isinstance(s, ComplexFeat) else None

    def slot_args(self, obj, k: int, part: str | None = None):
        """``obj`` with each tensor replaced by slot ``k`` of its shadow: features' ids,
        a parameter's entries (slot 0), :data:`OTHER` in slot 0 of an activation or a
        constant (zeros of one known to be zero); indices and masks as they are."""

        def replace(x):
            if not isinstance(x, Tensor):
                return x
            s = self._part(self.shadow(x), part)
            if isinstance(s, Feat):
                if k < len(s.slots):
                    return s.slots[k].contiguous() if x.is_contiguous() else s.slots[k]
                return torch.zeros(x.shape, dtype=_I64)
            if (
                isinstance(s, PRef)
                and k == 0
                and (s.explicit is not None or s.numel <= _MATERIALISE)
            ):
                return param_entry(self.param_number(s.param), s.positions())
            if x.dtype in (torch.int64, torch.int32, torch.bool, torch.uint8, torch.int16):
                if x.is_meta or _is_fake(x):
                    raise _Unsupported("indexing by a tensor whose values are unknown")
                return x.detach().cpu()  # an index or mask
            filler = OTHER if k == 0 and s is not ZERO else 0
            return torch.full(x.shape, filler, dtype=_I64)

        return tree_map(replace, obj)

    def move_param(self, func, args, kwargs, tensor: Tensor, ref: PRef, n: int) -> list[Shadow]:
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
        if ref.numel > _MATERIALISE and ref.explicit is None:
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

    def write(self, target: Tensor, index, value) -> None:
        """``target[index] = value`` (``index=None``: all of it), into the shadow of
        ``target`` and of the tensor it is a view of."""
        st = self.shadow(target)
        sv = (
            self.shadow(value)
            if isinstance(value, Tensor)
            else (CONST if value is not None else None)
        )
        if isinstance(value, (int, float)) and value == 0:
            sv = ZERO
        if st is None and sv is None:
            return
        if isinstance(st, (PRef, PDerived)):
            raise _Unsupported("writing into a parameter view")
        new = self._written(target, st, index, value, sv)
        base = target._base if isinstance(target._base, Tensor) else None
        if base is not None:
            sb = self.shadow(base)
            if sb is not None or new is not None:
                region = _view_positions(base, target)
                if region is None:
                    raise _Unsupported("a write into a view the trace cannot place")
                self.set(base, self._written(base, sb, region, target, new, flat=True))
        self.set(target, new)

    def _written(self, target, st, index, value, sv, flat: bool = False) -> Shadow | None:
        """The shadow of ``target`` (shadow ``st``) after ``value`` (shadow ``sv``) is
        written at ``index`` (``flat``: positions in the flattened target)."""
        shape = tuple(target.shape)
        if any(isinstance(s, Score) for s in (st, sv)):
            return self.scores([st, sv])
        if any(isinstance(s, (Taint, Prod, ComplexFeat)) for s in (st, sv)):
            return self.taint([st, sv], "", True)
        if not isinstance(st, Feat) and not isinstance(sv, (Feat, PRef)):
            # constants and activations only: a constant stays one only if what is
            # written is constant too
            if index is None:
                return sv if _constant(sv) else None
            return (st if st is sv else CONST) if _constant(st) and _constant(sv) else None
        feats = [s for s in (st, sv) if isinstance(s, Feat)]
        n = max([len(s.slots) for s in feats] + [1])
        mix = feats[0].mix if feats else None
        if any(f.mix != mix for f in feats):
            raise _Unsupported("a write joins differently mixed features")
        taint = next((f.taint for f in feats if f.taint is not None), None)
        vshape = tuple(value.shape) if isinstance(value, Tensor) else ()
        slots = []
        for k in range(n):
            base = (
                st.slots[k].clone()
                if isinstance(st, Feat) and k < len(st.slots)
                else torch.zeros(shape, dtype=_I64)
            )
            if isinstance(sv, Feat):
                v = sv.slots[k] if k < len(sv.slots) else torch.zeros(vshape, dtype=_I64)
            elif isinstance(sv, PRef) and k == 0:
                v = param_entry(self.param_number(sv.param), sv.positions())
            else:
                v = torch.zeros(vshape, dtype=_I64)
            if index is None:
                base = torch.broadcast_to(v, shape).clone()
            elif flat:
                base.view(-1)[index.reshape(-1)] = torch.broadcast_to(v, value.shape).reshape(-1)
            else:
                base[self.slot_args(index, k)] = v
            slots.append(base)
        return Feat(slots, mix, taint)

    # -- contractions ----------------------------------------------------------------------

    def contraction(self, op: Op) -> None:
        """A contraction op: its operands as einsum letters, taken two at a time."""
        spec = _einsum_spec(op.name, op.args, op.kwargs)
        if spec is None:
            raise _Unsupported(f"{op.name} with these operands")
        operands, letters, bias = spec
        out = op.outs[0]
        if len(operands) == 1:
            return self.set(out, self.einsum_one(operands[0], letters[0], letters[-1], out))
        (first, *rest), (l_first, *l_rest, lo) = operands, letters
        # the second operand of linear and addmm is the weight, whatever the first is
        weight_right = op.name in ("linear", "addmm") and isinstance(self.shadow(operands[1]), PRef)
        current, l_current = first, l_first
        for i, (operand, l_operand) in enumerate(zip(rest, l_rest)):
            last = i == len(rest) - 1
            if last:
                l_out, target = lo, out
            else:
                later = set("".join(l_rest[i + 1 :]) + lo)
                l_out = "".join(dict.fromkeys(c for c in l_current + l_operand if c in later))
                sizes = {
                    **dict(zip(l_current, current.shape)),
                    **dict(zip(l_operand, operand.shape)),
                }
                target = torch.empty([sizes[c] for c in l_out], device="meta")
            self.set(target, self.contract_tensors(
                current, operand, l_current, l_operand, l_out, target,
                bias if last else None, weight_right,
            ))  # fmt: skip
            current, l_current = target, l_out

    def einsum_one(self, x: Tensor, letters: str, lo: str, out: Tensor) -> Shadow | None:
        """A one-operand einsum: a permutation, with sums over the letters it drops."""
        s = self.shadow(x)
        if len(set(letters)) != len(letters) or not set(lo) <= set(letters):
            raise _Unsupported("an einsum with repeated letters")
        dropped = [i for i, c in enumerate(letters) if c not in lo]
        if isinstance(s, Feat):
            for slot in s.slots:
                for d in dropped:
                    if bool((slot != slot.narrow(d, 0, 1)).any()):
                        return self.taint([s], f"einsum across features in {self.here}", True)
            kept = [c for c in letters if c in lo]
            order = [kept.index(c) for c in lo]
            return Feat([_drop_axes(t, dropped).permute(order) for t in s.slots], s.mix, s.taint)
        if isinstance(s, Score):
            return s
        if isinstance(s, (Taint, Prod, ComplexFeat)):
            return self.taint([s], f"einsum in {self.here}", True)
        return self.plain_result([s])

    def contract_tensors(
        self, left, right, ll: str, lr: str, lo: str, out: Tensor, bias=None, weight_right=False
    ) -> Shadow | None:
        """The shadow of ``einsum(f"{ll},{lr}->{lo}", left, right)`` (+ ``bias``)."""
        sb = self.shadow(bias) if isinstance(bias, Tensor) else None
        return self.contract(self.shadow(left), self.shadow(right), ll, lr, lo, tuple(out.shape),
                             sb, weight_right, (left, right))  # fmt: skip

    def contract(
        self, sl, sr, ll: str, lr: str, lo: str, shape, sb=None, weight_right=False, tensors=None
    ) -> Shadow | None:
        """The shadow of ``einsum(f"{ll},{lr}->{lo}")`` of operands shadowed ``sl``, ``sr``
        (+ a bias shadowed ``sb``), recording the event it is; ``weight_right``: the right
        operand is a weight (linear layers), even if the left is a parameter too (an
        embedding table projected); ``tensors``: the operands, where their values help
        (a constant matrix)."""
        kinds = (_kind(sl), _kind(sr))
        contracted = "".join(c for c in ll if c in lr and c not in lo)
        if "zero" in kinds:
            return ZERO
        if "score" in kinds and not contracted:  # nothing summed: a scale of the scores
            return self.mul(None, None, sl, sr, False, shape)
        if "score" in kinds:
            first = kinds[0] == "score"
            s_score, s_other, l_other, l_score = (sl, sr, lr, ll) if first else (sr, sl, ll, lr)
            if isinstance(s_other, (Feat, Taint)):
                return self.mix(s_other, l_other, l_score, lo, contracted, shape, s_score.cores)
            if isinstance(s_other, PRef):  # scores through a weight: new features
                return self.project(s_other, l_other, None, l_score, lo, contracted, shape, sb)
            if s_other is None:  # scores mix an activation that no projection made
                index = len(self.trace.mixings)
                self.trace.mixings.append(
                    Mixing(index, self.where, None, True, cores=s_score.cores)
                )
            if isinstance(s_other, (ComplexFeat, Prod)):
                return self.taint(
                    [s_other], f"{_kind(s_other)} mixed by scores in {self.here}", False
                )
            return self.scores([sl, sr])
        if "complex" in kinds:
            reason = f"a product of complex features in {self.here}"
            self.unknown([sl, sr], reason)
            return self.taint([sl, sr], reason, False)
        if kinds == ("param", "param") and not weight_right:
            return PDerived(frozenset({sl.param, sr.param}))
        if "param" in kinds:
            w_first = kinds[0] == "param" and not weight_right
            sw, lw = (sl, ll) if w_first else (sr, lr)
            sx, lx = (sr, lr) if w_first else (sl, ll)
            return self.project(sw, lw, sx, lx, lo, contracted, shape, sb)
        if "pderived" in kinds:
            shadows = [s for s in (sl, sr) if isinstance(s, (Feat, Taint, Prod))]
            if not shadows and "none" not in kinds:
                return PDerived(frozenset())
            reason = f"a projection through a weight computed from parameters in {self.here}"
            self.trace.opaque.append((self.where, reason))
            if not shadows:
                return Taint(reason, False)
            self.unknown(shadows, reason)
            return self.taint(shadows, reason, certain=False)
        featlike = [k in ("feat", "taint", "prod") for k in kinds]
        if not contracted and any(featlike):  # nothing summed: an element-wise product
            return self.outer(sl, ll, sr, lr, lo, shape)
        if all(featlike):
            if "prod" in kinds:
                return self.contract_product(sl, ll, sr, lr, lo, contracted, shape)
            return self.core(sl, ll, sr, lr, lo, contracted, shape)
        if any(featlike):
            sf, lf, l_other = (sl, ll, lr) if featlike[0] else (sr, lr, ll)
            other = (tensors[1] if featlike[0] else tensors[0]) if tensors is not None else None
            if isinstance(sf, Feat) and _constant_along(sf, lf, contracted):
                return self.mix(sf, lf, l_other, lo, contracted, shape, None)
            if isinstance(sf, Feat) and kinds.count("const") == 1:
                mapped = self.fixed_map(sf, lf, other, l_other, lo, contracted, shape)
                if mapped is not None:
                    return mapped
            # a data-dependent linear map of a head's features may keep a subgroup: not
            # understood, not absent
            reason = f"features contracted with a matrix of activations or constants in {self.here}"
            self.unknown([sf], reason)
            return self.taint([sf], reason, False)
        if "none" in kinds:
            return None
        return CONST

    def outer(self, sl, ll, sr, lr, lo, shape) -> Shadow:
        """An einsum that sums nothing: the element-wise product of its operands."""
        a, b = (_arranged(s, letters, lo, shape) for s, letters in ((sl, ll), (sr, lr)))
        return self.mul(None, None, a, b, False, shape)

    def contract_product(self, sl, ll, sr, lr, lo, contracted, shape) -> Shadow:
        """A product of features ``a * b`` contracted with features ``c``: where only
        ``b`` varies along the summed axes, the contraction of ``b`` with ``c``, scaled by
        ``a`` (whose features enter a product of three projections: recorded as unknown,
        unless they went through a nonlinearity)."""
        if isinstance(sl, Prod) and isinstance(sr, Prod):
            return self.taint([sl, sr], f"a product of two products in {self.here}", False)
        prod, lp, other, l_other = (sl, ll, sr, lr) if isinstance(sl, Prod) else (sr, lr, sl, ll)
        varies = [
            any(_varies(s, lp, c) for s in f.slots for c in contracted) for f in (prod.a, prod.b)
        ]
        if varies.count(True) != 1:
            reason = f"a product of three projections contracted in {self.here}"
            self.unknown([prod.a, prod.b, other], reason)
            return self.taint([prod.a, prod.b, other], reason, False)
        factor, coefficient = (prod.b, prod.a) if varies[1] else (prod.a, prod.b)
        self.unknown([coefficient], f"a product of three projections in {self.here}")
        if isinstance(sl, Prod):
            return self.contract(factor, other, lp, l_other, lo, shape)
        return self.contract(other, factor, l_other, lp, lo, shape)

    def fixed_map(self, sf: Feat, lf, matrix, l_matrix, lo, contracted, shape) -> Feat | None:
        """Features times a constant matrix over one of their axes (a rotation matrix
        per position): each output column holds the features of the input columns whose
        coefficients are not all zero; ``None`` where the matrix's values are unknown."""
        if (
            not isinstance(matrix, Tensor)
            or matrix.is_meta
            or _is_fake(matrix)
            or len(contracted) != 1
        ):
            return None
        free = [c for c in l_matrix if c not in contracted and c not in lf]
        if len(free) != 1 or not set(l_matrix) <= set(lf) | set(free) | set(contracted):
            return None
        c_in, c_out = contracted, free[0]
        nonzero = (matrix.detach() != 0).cpu()
        # reduce the matrix's other axes: a coefficient that is non-zero anywhere counts
        other_axes = [i for i, c in enumerate(l_matrix) if c not in (c_in, c_out)]
        if other_axes:
            nonzero = nonzero.any(dim=other_axes)
        kept = [c for c in l_matrix if c in (c_in, c_out)]
        if kept[0] != c_in:
            nonzero = nonzero.t()
        n_in, n_out = nonzero.shape
        count = nonzero.sum(0)
        width = int(count.max()) if n_out else 0
        if width == 0 or width > 2:
            return None
        # per output column its input columns, its own (same index) first
        order = torch.arange(n_in).expand(n_out, n_in)
        own = torch.arange(n_out)[:, None] == order
        rank = (~nonzero.t()).to(_I64) * 4 + (~own).to(_I64) * 2
        picks = torch.argsort(rank, dim=1, stable=True)[:, :width]  # (n_out, width)
        valid = torch.gather(nonzero.t(), 1, picks)
        axis = lf.index(c_in)
        slots = []
        for slot in sf.slots:
            for w in range(width):
                moved = slot.index_select(axis, picks[:, w]) * valid[:, w].view(
                    [-1 if i == axis else 1 for i in range(slot.dim())]
                )
                slots.append(moved)
        l_moved = lf.replace(c_in, c_out)
        if set(l_moved) - set(lo):
            return None
        return Feat([_arrange(s, l_moved, lo, shape) for s in slots], sf.mix, sf.taint)

    def project(self, sw: PRef, lw, sx, lx, lo, contracted, shape, bias_shadow) -> Shadow:
        """An input (any activation, or scores) times the weight ``sw``: a projection,
        whose output features are the weight's entries along its free axes."""
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
                len(self.trace.sources), self._next_id, size, sw.param, sw.offset, feat, rows,
                bias, self.where,
            )  # fmt: skip
            self._next_id += size
            self._sources[key] = source
            self.trace.sources.append(source)
        ids = torch.arange(source.base, source.base + size, dtype=_I64)
        ids = ids.view([s for s, _ in feat])
        slot = _arrange(ids, free, lo, tuple(shape))
        if isinstance(sx, Feat):
            batch = [c for c in lo if c in lw and c in lx]
            side = self.side(sx, lx, batch, contracted, dict(zip(lo, shape)))
            row_axes = tuple(
                (sw.shape[lw.index(c)], sw.strides[lw.index(c)])
                for c in lw
                if c not in contracted and c not in batch
            )
            batch_axes = tuple((sw.shape[lw.index(c)], sw.strides[lw.index(c)]) for c in batch)
            self.trace.consumptions.append(
                Consumption(self.where, side, sw, row_axes, rows, sx.mix, batch_axes, source.sid)
            )
        elif isinstance(sx, Prod):
            self.taint([sx], f"a product of features projected in {self.here}", True)
        return Feat([slot])

    def side(
        self, s: Feat | Taint, letters: str, batch, columns, sizes, stack: bool = False
    ) -> Side:
        """Operand ``s`` (axes ``letters``) as :class:`Side` ``ids[l, t, c, k]``: slices
        ``l`` over the ``batch`` axes (broadcast to ``sizes``) and, with ``stack``, the
        other axes along which its features change; columns ``c`` over ``columns``;
        positions ``t`` over the rest."""
        if isinstance(s, Taint):
            return Side(taint=s)
        rest = [c for c in letters if c not in batch and c not in columns]
        stacked = [c for c in rest if stack and _features_vary(s, letters, c)]
        tokens = [c for c in rest if c not in stacked]
        out = []
        n_batch = n_stacked = 1
        for slot in s.slots:
            t = slot
            shape = [
                sizes.get(c, t.shape[i]) if c in batch else t.shape[i]
                for i, c in enumerate(letters)
            ]
            t = t.expand(shape)
            order = [letters.index(c) for c in (*batch, *stacked, *tokens, *columns)]
            t = t.permute(order)
            sz = t.shape
            n_batch = math.prod(sz[: len(batch)])
            n_stacked = math.prod(sz[len(batch) : len(batch) + len(stacked)])
            n_tokens = math.prod(
                sz[len(batch) + len(stacked) : len(batch) + len(stacked) + len(tokens)]
            )
            out.append(t.reshape(n_batch * n_stacked, n_tokens, -1))
        return Side(torch.stack(out, -1), s.taint, n_batch, n_stacked)

    def core(self, sl, ll, sr, lr, lo, contracted, shape) -> Shadow:
        """Two projections contracted over their features: a core."""
        for s, letters in ((sl, ll), (sr, lr)):
            if isinstance(s, Feat) and _features_constant_along(s, letters, contracted):
                reason = f"projections contracted over tokens in {self.here}"
                self.unknown([sl, sr], reason)
                return self.taint([sl, sr], reason, False)
        sizes = dict(zip(lo, shape))
        batch = [c for c in lo if c in ll and c in lr]
        index = len(self.trace.cores)
        self.trace.cores.append(
            Core(
                index,
                self.where,
                self.side(sl, ll, batch, contracted, sizes, stack=True),
                self.side(sr, lr, batch, contracted, sizes, stack=True),
            )
        )
        return Score(frozenset({index}))

    def mix(self, s, letters, other, lo, contracted, shape, cores) -> Shadow:
        """Features ``s`` (axes ``letters``) mixed over their token axes ``contracted`` by
        an operand with axes ``other`` (scores of ``cores``, or ``None``: another data
        matrix): each column keeps its features; parameter entries that differ between
        the mixed positions (memory tokens) are recorded, not carried."""
        by_scores = cores is not None
        index = len(self.trace.mixings)
        if isinstance(s, Taint):
            self.trace.mixings.append(
                Mixing(index, self.where, None, by_scores, taint=s, cores=cores or frozenset())
            )
            return s
        if not _features_constant_along(s, letters, contracted):
            mixed_in = any(bool((slot == OTHER).any()) for slot in s.slots)
            what = (
                "features mixed with an activation or a constant"
                if mixed_in
                else "features mixed over their columns"
            )
            return self.taint([s], f"{what} in {self.here}", False)
        free = "".join(c for c in letters if c not in contracted)
        slices = [c for c in lo if c in free and c in other]
        cols = [c for c in free if c not in slices]
        axes = [letters.index(c) for c in contracted]
        out_slots = [_arrange(_mixed(slot, axes), free, lo, tuple(shape)) for slot in s.slots]
        side = self.side(s, letters, slices, cols, dict(zip(lo, shape)))
        self.trace.mixings.append(
            Mixing(index, self.where, side.ids, by_scores, s.taint, cores or frozenset())
        )
        return Feat(out_slots, mix=index, taint=s.taint)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        """``softmax(q k^T) v`` over the last two axes, as shadows."""
        lead = string.ascii_lowercase[: q.dim() - 2]
        scores = torch.empty((*q.shape[:-1], k.shape[-2]), device="meta")
        self.set(scores, self.contract_tensors(q, k, lead + "xd", lead + "yd", lead + "xy", scores))
        self.set(out, self.contract_tensors(scores, v, lead + "xy", lead + "yd", lead + "xd", out))

    def repeated(self, t: Tensor, rep: int) -> Tensor:
        """A stand-in for ``t`` with each head repeated ``rep`` times (grouped-query)."""
        s = self.shadow(t)
        shape = list(t.shape)
        shape[-3] *= rep
        stand_in = torch.empty(shape, device="meta")
        if isinstance(s, Feat):
            s = Feat([x.repeat_interleave(rep, dim=-3) for x in s.slots], s.mix, s.taint)
        self.set(stand_in, s)
        return stand_in


# --- helpers ------------------------------------------------------------------------------


def _flex_module():
    try:
        import torch.nn.attention.flex_attention as flex
    except Exception:  # a torch without it
        return None
    return flex


def _mha_reference(
    query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias, bias_k,
    bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias, training=True,
    key_padding_mask=None, need_weights=True, attn_mask=None, use_separate_proj_weight=False,
    q_proj_weight=None, k_proj_weight=None, v_proj_weight=None, static_k=None, static_v=None,
    average_attn_weights=True, is_causal=False,
):  # fmt: skip
    """What ``F.multi_head_attention_forward`` computes (in eval mode), in plain ops,
    for the trace to follow: projections, bias keys and values, heads, masked softmax,
    the output projection."""
    del embed_dim_to_check, dropout_p, training, need_weights, average_attn_weights
    if static_k is not None or static_v is not None:
        raise _Unsupported("multi_head_attention_forward with static keys or values")
    batched = query.dim() == 3
    if not batched:
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
    tgt, bsz, embed = query.shape
    head = embed // num_heads
    if use_separate_proj_weight:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        weights = in_proj_weight.chunk(3)
    biases = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    q, k, v = (F_linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
    if bias_k is not None:
        k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
    if add_zero_attn:
        k = torch.cat([k, k.new_zeros((1, *k.shape[1:]))])
        v = torch.cat([v, v.new_zeros((1, *v.shape[1:]))])
    q, k, v = (t.reshape(t.shape[0], bsz * num_heads, head).transpose(0, 1) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(head)
    src = k.shape[1]
    if is_causal and attn_mask is None:
        attn_mask = torch.ones(tgt, src, dtype=torch.bool).triu(1)
    if attn_mask is not None:
        mask = attn_mask[..., :tgt, :src] if attn_mask.dim() >= 2 else attn_mask
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(mask, float("-inf"))
        else:
            scores = scores + mask
    if key_padding_mask is not None:
        pad = key_padding_mask.reshape(bsz, 1, 1, -1).expand(bsz, num_heads, 1, -1)
        pad = pad.reshape(bsz * num_heads, 1, -1)[..., :src]
        if pad.dtype == torch.bool:
            scores = scores.masked_fill(pad, float("-inf"))
        else:
            scores = scores + pad
    y = scores.softmax(-1) @ v
    y = y.transpose(0, 1).reshape(tgt, bsz, embed)
    out = F_linear(y, out_proj_weight, out_proj_bias)
    weights_out = scores.softmax(-1).view(bsz, num_heads, tgt, src)
    if not batched:
        out = out.squeeze(1)
    return out, weights_out


def F_linear(x, w, b):
    return torch.nn.functional.linear(x, w, b)


def _bound(op: Op, names: tuple[str, ...]) -> list:
    bound = dict(zip(names, op.args))
    bound.update({k: v for k, v in op.kwargs.items() if k in names})
    defaults = {"groups": 1}
    return [bound.get(n, defaults.get(n)) for n in names]


def func_name(func) -> str:
    return _name(func)


def _padding(args: tuple, kwargs: dict, k: int) -> tuple[tuple, dict]:
    """The arguments of ``F.pad`` for slot ``k``: a constant pad's value as an id (0 for
    zero, which holds nothing; :data:`OTHER` in slot 0 for any other constant)."""
    names = ("pad", "mode", "value")
    bound = dict(zip(names, args[1:]))
    bound.update({n: v for n, v in kwargs.items() if n in names})
    if bound.get("mode", "constant") != "constant":
        return args[1:], kwargs
    value = bound.get("value") or 0
    bound["value"] = 0 if value == 0 or k > 0 else OTHER
    return (), bound


def _laid_out_like(slot: Tensor, x: Tensor) -> Tensor:
    """``slot``'s values in a tensor with ``x``'s strides and storage offset (for an op
    that reads the storage, ``as_strided``)."""
    if tuple(slot.stride()) == tuple(x.stride()) and slot.storage_offset() == x.storage_offset():
        return slot
    extent = x.storage_offset() + sum((n - 1) * st for n, st in zip(x.shape, x.stride())) + 1
    buffer = torch.zeros(max(extent, 1), dtype=slot.dtype)
    view = buffer.as_strided(tuple(x.shape), tuple(x.stride()), x.storage_offset())
    view.copy_(slot)
    return view


def _constant(s) -> bool:
    return s is CONST or s is ZERO


def _number(args, i):
    return args[i] if len(args) > i and isinstance(args[i], (int, float)) else None


def _is_fake(t: Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _is_number(x, s) -> bool:
    """A Python number, or a one-element tensor that holds no features."""
    if not isinstance(x, Tensor):
        return x is not None or isinstance(s, float)
    return x.numel() == 1 and not isinstance(s, (Feat, ComplexFeat, Prod, Taint, Score))


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
    if callable(obj):
        return []
    leaves, _ = tree_flatten(obj)
    return [x for x in leaves if isinstance(x, Tensor)]


def _feats(shadows: list) -> list[Feat]:
    """The feature tensors among ``shadows`` (both parts of complex ones, both factors
    of products)."""
    out = []
    for s in shadows:
        if isinstance(s, Feat):
            out.append(s)
        elif isinstance(s, ComplexFeat):
            out += [s.re, s.im]
        elif isinstance(s, Prod):
            out += [s.a, s.b]
    return out


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
    if isinstance(s, Score):
        return "score"
    if s is CONST:
        return "const"
    if s is ZERO:
        return "zero"
    if isinstance(s, PRef):
        return "param"
    if isinstance(s, PDerived):
        return "pderived"
    if isinstance(s, Feat):
        return "feat"
    if isinstance(s, ComplexFeat):
        return "complex"
    if isinstance(s, Prod):
        return "prod"
    return "taint"


_STRENGTH = {"scale": 0, "norm": 1, "nonlinear": 2}


def _stronger(a: Taint | None, b: Taint) -> Taint:
    """Of two taints on one path, the one that keeps less of the features' symmetries
    (the first where they keep as much)."""
    if a is None or _STRENGTH[b.kind] > _STRENGTH[a.kind]:
        return b
    return a


def _tensor_like(a, b, feat) -> bool:
    """Whether the other operand of a product with features is a tensor (not a number)."""
    return a is None or b is None or (isinstance(a, Tensor) and isinstance(b, Tensor))


def _gate(sa, sb, divides: bool) -> Feat | None:
    """Of a product of features and features that went through a nonlinearity (a
    sigmoid gate, a softplus step), the latter: it scales the former, as an activation
    would."""
    for gate, other in ((sa, sb), (sb, sa)):
        if divides and gate is sa:
            continue
        if (
            isinstance(gate, Feat)
            and gate.taint is not None
            and isinstance(other, (Feat, Prod))
            and (isinstance(other, Prod) or other.taint is None)
        ):
            return gate
    return None


def _same_prod(a: Prod, b: Prod) -> bool:
    return all(
        len(x.slots) == len(y.slots) and all(torch.equal(u, v) for u, v in zip(x.slots, y.slots))
        for x, y in ((a.a, b.a), (a.b, b.b))
    )


def _joined(first: list[Tensor], second: list[Tensor], shape) -> list[Tensor]:
    """The slots of a sum: both lists broadcast to ``shape``, a slot equal to one already
    there (the same terms again) left out."""
    out = [_bcast(s, shape) for s in first]
    for s in second:
        s = _bcast(s, shape)
        if not any(torch.equal(s, o) for o in out):
            out.append(s)
    return out


def _padded(slots: list[Tensor], n: int) -> list[Tensor]:
    return slots + [torch.zeros_like(slots[0])] * (n - len(slots))


def _bcast(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    return torch.broadcast_to(t, shape)


def _bcast_feat(f: Feat, shape) -> Feat:
    return Feat([_bcast(s, shape) for s in f.slots], f.mix, f.taint)


def _dims(op: Op) -> list[int] | None:
    """The axes a reduction op sums over (``None``: all of them, or unknown)."""
    x = op.args[0]
    dim = op.kwargs.get("dim", op.args[1] if len(op.args) > 1 else None)
    if dim is None or isinstance(dim, torch.dtype) or dim == ():
        return None
    return sorted({d % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim])})


def _keepdim(op: Op) -> bool:
    return bool(op.kwargs.get("keepdim", op.args[2] if len(op.args) > 2 else False))


def _reduced(slots: list[Tensor], op: Op, dims: list[int]) -> list[Tensor]:
    if op.name == "cumsum":
        return list(slots)
    keep = _keepdim(op)
    out = []
    for slot in slots:
        for d in reversed(dims):
            slot = slot.narrow(d, 0, 1) if keep else slot.select(d, 0)
        out.append(slot)
    return out


def _drop_axes(t: Tensor, dims: list[int]) -> Tensor:
    for d in sorted(dims, reverse=True):
        t = t.select(d, 0)
    return t


def _view_positions(base: Tensor, view: Tensor) -> Tensor | None:
    """The flat positions in ``base`` of every element of ``view`` (a view of it), or
    ``None`` where ``base`` is not contiguous."""
    if not base.is_contiguous():
        return None
    offset = view.storage_offset() - base.storage_offset()
    out = torch.full(tuple(view.shape), offset, dtype=_I64)
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride())):
        shape = [1] * view.dim()
        shape[dim] = size
        out = out + (torch.arange(size, dtype=_I64) * stride).view(shape)
    return out


def _arranged(s, letters: str, lo: str, shape) -> Shadow:
    """A shadow on axes ``letters`` laid out along the output axes ``lo``."""
    if isinstance(s, Feat):
        return Feat([_arrange(x, letters, lo, shape) for x in s.slots], s.mix, s.taint)
    if isinstance(s, Prod):
        return Prod(_arranged(s.a, letters, lo, shape), _arranged(s.b, letters, lo, shape))
    return s


def _mixed(slot: Tensor, axes: list[int]) -> Tensor:
    """A slot after mixing over ``axes``: each column's feature (constant along them),
    and the parameter entries that are the same at every mixed position."""
    if not axes:
        return slot
    is_feat = (slot > 0) & (slot < PARAM_BASE)
    feats = torch.where(is_feat, slot, torch.zeros_like(slot))
    params = torch.where(is_feat, torch.zeros_like(slot), slot)
    top = feats.amax(dim=axes)
    p_hi, p_lo = params.amax(dim=axes), params.amin(dim=axes)
    return torch.where(top > 0, top, torch.where(p_hi == p_lo, p_hi, torch.zeros_like(p_hi)))


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


def _arrange(t: Tensor, letters: str, lo: str, shape: tuple[int, ...]) -> Tensor:
    """``t`` (axes ``letters``) laid out along the output axes ``lo`` and broadcast to
    ``shape`` (axes of ``lo`` that ``t`` lacks are broadcast)."""
    if not letters:
        return t.reshape([1] * len(lo)).expand(shape)
    present = [c for c in lo if c in letters]
    t = t.permute([letters.index(c) for c in present])
    view = [t.shape[present.index(c)] if c in letters else 1 for c in lo]
    return t.reshape(view).expand(shape)


def _varies(t: Tensor, letters: str, c: str) -> bool:
    dim = letters.index(c)
    return t.shape[dim] > 1 and not bool((t == t.narrow(dim, 0, 1)).all())


def _varies_any(f: Feat, dim: int) -> bool:
    """Whether some slot of ``f`` changes along axis ``dim`` where it holds a term
    (zeros, padding, hold none)."""
    for s in f.slots:
        if s.shape[dim] < 2 or s.stride(dim) == 0 or bool((s == s.narrow(dim, 0, 1)).all()):
            continue
        present = s != 0
        hi = torch.where(present, s, torch.full_like(s, -(1 << 62))).amax(dim, keepdim=True)
        lo = torch.where(present, s, torch.full_like(s, 1 << 62)).amin(dim, keepdim=True)
        if bool(((hi != lo) & present.any(dim, keepdim=True)).any()):
            return True
    return False


def _constant_along(s: Feat, letters: str, axes: str) -> bool:
    """Whether every slot of ``s`` is the same along each axis in ``axes``."""
    for slot in s.slots:
        for c in axes:
            if _varies(slot, letters, c):
                return False
    return True


def _features_vary(s: Feat, letters: str, c: str) -> bool:
    """Whether the features of ``s`` (not its parameter entries) change along axis ``c``
    at positions that hold features."""
    dim = letters.index(c)
    slot = s.slots[0]
    if slot.shape[dim] < 2 or slot.stride(dim) == 0:
        return False
    if bool((slot == slot.narrow(dim, 0, 1)).all()):
        return False
    is_feat = (slot > 0) & (slot < PARAM_BASE)
    hi = torch.where(is_feat, slot, torch.zeros_like(slot)).amax(dim, keepdim=True)
    lo = torch.where(is_feat, slot, torch.full_like(slot, PARAM_BASE)).amin(dim, keepdim=True)
    some = is_feat.any(dim, keepdim=True)
    return bool(((hi != lo) & some).any())


def _features_constant_along(s: Feat, letters: str, axes: str) -> bool:
    """Whether every slot's features are the same along ``axes`` wherever they are
    present (parameter entries may differ: memory tokens, rows looked up)."""
    for slot in s.slots:
        is_feat = None
        for c in axes:
            dim = letters.index(c)
            if slot.shape[dim] < 2 or slot.stride(dim) == 0:
                continue
            if bool((slot == slot.narrow(dim, 0, 1)).all()):
                continue  # the same terms all along
            if is_feat is None:
                is_feat = (slot > 0) & (slot < PARAM_BASE)
            hi = torch.where(is_feat, slot, torch.zeros_like(slot)).amax(dim, keepdim=True)
            lo = torch.where(is_feat, slot, torch.full_like(slot, PARAM_BASE)).amin(
                dim, keepdim=True
            )
            if bool(((hi != lo) & is_feat.any(dim, keepdim=True)).any()):
                return False
            # an activation or constant where others hold features: mixed in
            if bool((is_feat.any(dim, keepdim=True) & (slot == OTHER)).any()):
                return False
    return True


def _axes_offsets(axes: tuple[tuple[int, int], ...]) -> Tensor:
    """Offsets of the flat (row-major) index over ``axes`` ``(size, stride)``."""
    out = torch.zeros(1, dtype=_I64)
    for size, stride in axes:
        out = (out[:, None] + torch.arange(size, dtype=_I64)[None, :] * stride).reshape(-1)
    return out


def _unravel_offsets(axes: tuple[tuple[int, int], ...], flat: Tensor) -> Tensor:
    """``flat`` (row-major numbers over ``axes``) as offsets ``sum index . stride``."""
    out = torch.zeros_like(flat)
    rest = flat.clone()
    for size, stride in reversed(axes):
        out += (rest % size) * stride
        rest //= size
    return out


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
    """``(operands, letters, bias)`` of a contraction op, with the letters of ``einsum``
    (one string per operand, then the output's); ``None``: not a contraction the trace
    reads."""
    if name == "einsum":
        eq = args[0] if args else kwargs.get("equation")
        ops = tuple(args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        if not ops or not isinstance(eq, str) or "->" not in eq:
            return None
        lhs, lo = eq.replace(" ", "").split("->")
        ins = lhs.split(",")
        if len(ins) != len(ops):
            return None
        if "." in lhs:
            ins, lo = _expand_ellipsis(ins, lo, ops)
        return ops, (*ins, lo), None
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
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.dim() < 1 or b.dim() < 1:
        return None
    if a.dim() == 1 or b.dim() == 1:  # a vector: matmul's rules for 1-D operands
        la = "k" if a.dim() == 1 else string.ascii_lowercase[: a.dim() - 2] + "xk"
        lb = "k" if b.dim() == 1 else string.ascii_lowercase[: b.dim() - 2] + "ky"
        lead = max(la[:-2] if a.dim() > 1 else "", lb[:-2] if b.dim() > 1 else "", key=len)
        lo = lead + ("x" if a.dim() > 1 else "") + ("y" if b.dim() > 1 else "")
        return (a, b), (la, lb, lo), bias
    n = max(a.dim(), b.dim()) - 2
    lead = string.ascii_lowercase[:n]
    la = lead[n - (a.dim() - 2) :] + "xk"
    lb = lead[n - (b.dim() - 2) :] + "ky"
    # leading axes broadcast from size 1 show the same ids in every slice
    return (a, b), (la, lb, lead + "xy"), bias


def _expand_ellipsis(ins: list[str], lo: str, ops) -> tuple[list[str], str]:
    used = set("".join(ins) + lo) - {"."}
    spare = [c for c in string.ascii_letters if c not in used]
    n = max(op.dim() - len(s.replace("...", "")) for op, s in zip(ops, ins))
    fill = "".join(spare[:n])
    out = []
    for op, s in zip(ops, ins):
        k = op.dim() - len(s.replace("...", ""))
        out.append(s.replace("...", fill[n - k :]))
    return out, lo.replace("...", fill)
