"""What every measure shares: the problem it is asked to solve, set up once.

* the perturbed parameters, their pairs, layout and base point (:class:`Target`,
  :func:`find_target`), and the geometry a measure names (:func:`geometry_of`);
* the batches (:func:`peek`, :func:`numbered`) and each batch's seed (:func:`batch_seed`);
* the loss checked (:func:`checked_loss`), in the precision asked for
  (:func:`autocast_for`, :func:`matmuls`), with its round-off floor
  (:func:`check_floor`); how the model runs is a backend's
  (:mod:`geosharp.measures.backends`), what one measure holds of it a
  :class:`Measurement`;
* what is reported of the model's symmetries (:func:`symmetry_report`, :func:`say_ignored`).

:func:`~geosharp.measures.sharpness`, :func:`~geosharp.measures.hessian_trace`,
:class:`~geosharp.SharpnessMonitor` and :class:`~geosharp.GeodesicSAM` are built on it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..errors import PrecisionWarning, SymmetryWarning, UsageError, real_number, warn_user
from ..geometry.sharded import Shards
from ..geometry.space import Geometry, PerturbationSpace
from ..layout import ParameterLayout
from ..params import (
    LossFunction,
    scalar_loss,
    usable_for_grad,
)
from ..progress import Progress
from ..symmetry.discovery import find_symmetries
from ..symmetry.pairs import Symmetries
from .backends import LossGrad, MixedPrecision, Widened, float32_copies  # their home
from .fsdp import (
    check_shardable,
    is_sharded,
    local_shards,
    reshard,
    sharded_symmetries,
    symmetries_of,
)

__all__ = [
    "LEGACY",
    "FloorError",
    "LossGrad",
    "Measurement",
    "MixedPrecision",
    "NonFiniteError",
    "Target",
    "Widened",
    "autocast_for",
    "batch_seed",
    "check_floor",
    "check_model",
    "checked_loss",
    "checked_rho",
    "find_target",
    "float32_copies",
    "floor_message",
    "geometry_of",
    "label_of",
    "numbered",
    "peek",
    "refuse_legacy",
    "symmetry_report",
]


class NonFiniteError(FloatingPointError):
    """A perturbed loss that is not finite: the radius reaches where the model breaks
    down. Its fields (``label``, ``rho``, ``where``: the first place) let a front end say
    it in its own words (:meth:`message`)."""

    def __init__(self, label: str, rho: float, where: list[str]):
        self.label, self.rho, self.where = label, rho, list(where)
        super().__init__(self.message())

    def message(self, rho: str = "rho", inf: str = "nonfinite='inf'") -> str:
        """The error, with ``rho`` and ``inf`` spelling how to lower the radius and how
        to report ``inf`` instead."""
        return (
            f"{self.label} at rho={self.rho:g}: a perturbed loss is not finite "
            f"({self.where[0]}): the radius reaches where the model breaks down and the value "
            f"is no finite number; lower {rho}, or report it as inf ({inf})"
        )


def nonfinite_error(label: str, rho: float, broken: list[str]) -> None:
    raise NonFiniteError(label, rho, broken)


@contextlib.contextmanager
def matmuls(device: torch.device, precision: str, settings: dict):
    """Full-precision float32 matmuls on CUDA for the measure (``"highest"``), the
    process's setting restored after; the precision used goes into ``settings``."""
    before = torch.get_float32_matmul_precision()
    cuda = device.type == "cuda"
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if precision == "highest" and cuda:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    settings["matmul_precision"] = torch.get_float32_matmul_precision() if cuda else "highest (CPU)"
    try:
        yield
    finally:
        if cuda:
            torch.set_float32_matmul_precision(before)
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def floor_fix(precision: str, cli: bool) -> str:
    """The way to a finer floor from ``precision`` (``settings["precision"]``), in the
    command line's words or Python's."""
    larger = "a larger --rho" if cli else "a larger rho"
    if "autocast" in precision:
        return f"measure in float32 ({'no --autocast' if cli else 'no autocast'}) or with {larger}"
    if "float16" in precision:  # a half-precision model (bfloat16 too)
        copy = "--dtype float32" if cli else "a float32 copy of the model (model.float())"
        return f"measure {copy} or with {larger}"
    if "float32" in precision:
        return (
            f"measure with {larger} (float64: the Python API)"
            if cli
            else (f"measure in float64 or with {larger}")
        )
    return f"measure with {larger}"


def floor_message(
    label: str, rho: float, value: float, floor: float, precision: str, cli: bool = False
):
    """What to say of a ``value`` within 10x of the loss's round-off ``floor`` (``None``
    when it is not); ``cli``: in the command line's words."""
    if not (math.isfinite(value) and floor > 0 and abs(value) < 10 * floor):
        return None
    return (
        f"{label} at rho={rho:g} is {value:.3g}, within 10x of the round-off floor of the loss "
        f"in {precision} ({floor:.2g}): the perturbation is near what this precision can see; "
        + floor_fix(precision, cli)
    )


class FloorError(UsageError):
    """``strict=True`` and a value within 10x of its floor; :meth:`message` says it in
    the command line's words too."""

    def __init__(self, label: str, rho: float, value: float, floor: float, precision: str):
        self.label, self.rho, self.value, self.floor = label, rho, value, floor
        self.precision = precision
        super().__init__(self.message())

    def message(self, cli: bool = False) -> str:
        return floor_message(self.label, self.rho, self.value, self.floor, self.precision, cli)

    def of(self, block: str) -> FloorError:
        """The same error, naming the block it concerns."""
        return FloorError(f"{self.label} [{block}]", self.rho, self.value, self.floor,
                          self.precision)  # fmt: skip


def warn_half_loss(dtype: torch.dtype, loss: float) -> None:
    """Warn that a loss computed in half precision rounds a confident prediction's loss
    to 0 (log-softmax of a confident row) and every value to its ``eps``."""
    name = str(dtype).removeprefix("torch.")
    warn_user(
        f"the loss is computed in {name} ({loss:.3g}): it resolves {torch.finfo(dtype).eps:.1g} "
        f"of itself, and rounds a confident prediction's loss to 0; compute it in float32 "
        "from the outputs (e.g. F.cross_entropy(logits.float(), labels))",
        PrecisionWarning,
    )


def check_floor(label: str, rho: float, value: float, floor: float, precision: str, strict: bool):
    """Warn (``strict``: raise) when ``value`` is within 10x of the loss's round-off floor."""
    message = floor_message(label, rho, value, floor, precision)
    if message is None:
        return
    if strict:
        raise FloorError(label, rho, value, floor, precision)
    warn_user(message, PrecisionWarning)


def peek(batches: Iterable) -> tuple[Iterable, int | None, object]:
    """``batches`` (a one-shot iterator is not lost), its length if known, and its
    first batch (discovery runs on it)."""
    if isinstance(batches, (Tensor, dict)):
        raise TypeError(
            "`batches` must be an iterable of batches (e.g. a DataLoader or a list); "
            "wrap a single batch in a list: [batch]"
        )
    total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
    if isinstance(batches, Sequence):
        if not batches:
            raise ValueError("no batches: `batches` yielded nothing to measure on")
        return batches, total, batches[0]
    iterator = iter(batches)
    try:
        first = next(iterator)
    except StopIteration:
        raise ValueError("no batches: `batches` yielded nothing to measure on") from None
    return itertools.chain([first], iterator), total, first


def symmetry_report(target: Target, geo: Geometry) -> dict:
    """What the measure knows of the model's symmetries: how they were found, the pairs
    used, and the attention modules measured element-wise with why (``ignored``: the
    symmetry was not understood; ``absent``: there is none, element-wise is exact)."""
    sym = target.symmetries
    if geo.metric is None or sym is None:
        return {}
    absent: dict[str, list[str]] = {}
    for d in sym.dropped:
        if d.exact:
            absent.setdefault(d.module, []).append(f"{d.kind}: {d.reason}")
    ignored = {m: [f"{d.kind}: {d.reason}" for d in ds] for m, ds in sym.ignored.items()}
    return {
        "discovery": sym.discovery,
        "pair_blocks": len(target.pairs),
        "pairs": sum(p.shape[0] for p in target.pairs),
        "attention_modules": len(sym.attention),
        "verified": sum(1 for p in target.pairs if p.name in sym.verified),
        "unverified": [p.name for p in target.pairs if p.name not in sym.verified],
        "idle": list(sym.idle),
        "absent": absent,
        "ignored": ignored,
    }


GAP_MEANS = {  # who says it, and what a gap in the symmetry does to what it computes
    "value": ("{}", "the value is not symmetry-correct there (see result.symmetry, "
              "find_symmetries(model).summary())"),
    "step": ("GeodesicSAM ({})", "its ascent step is not symmetry-invariant there (see "
             "find_symmetries(model).summary())"),
}  # fmt: skip


def say_ignored(symmetries: Symmetries, label: str, strict: bool, means: str = "value") -> None:
    """Warn (or, ``strict``, raise) when a geodesic measure (``means="value"``) or
    GeodesicSAM (``"step"``) would treat attention modules element-wise because their
    symmetry was not understood, or use pair blocks that no numerical check on the
    model confirmed: one message that names both."""
    parts = symmetries.gaps()
    if not parts:
        return
    if symmetries.unverified:
        parts[-1] += (
            ": pass symmetries found with a batch, find_symmetries(model, batch, loss_fn=...)"
        )
    who, means = GAP_MEANS[means]
    message = who.format(label) + ": " + "; and ".join(parts) + "; " + means
    if strict:
        raise ValueError(message + "; strict=True")
    warn_user(message, SymmetryWarning)  # the caller of sharpness()


def label_of(geo: Geometry) -> str:
    """The geometry's name in the measure table ("geodesic-inv", "adaptive-linf", ...)."""
    return geo.name if geo.p == 2 else f"{geo.name}-linf"


@dataclass
class Target:
    """What a measure works on: the perturbed parameters, their pairs and layout, and
    ``theta``, the model's own tensors (read, never written, never copied). The
    perturbation lives in ``dtype``, float32 or the widest of the parameters' dtypes: a
    half-precision parameter (of dtype ``half``; ``upcast``) is read in it piece by
    piece, exactly, and computes in float32; a parameter whose own dtype is narrower
    than ``dtype`` but not half (a float32 router of a float64 model) is cast to it
    for its forward (``narrow``)."""

    named: list[tuple[str, Tensor]]
    pairs: list
    layout: ParameterLayout
    dtype: torch.dtype
    upcast: bool
    theta: dict[str, Tensor] | Tensor
    device: torch.device
    symmetries: Symmetries | None = None
    shards: Shards | None = None  # a sharded model: this process's slices
    local: list[Tensor] = field(default_factory=list)  # ... the model's own
    half: torch.dtype | None = None
    narrow: dict[str, torch.dtype] = field(default_factory=dict)

    @property
    def halves(self) -> list[tuple[str, Tensor]]:
        """The perturbed parameters in half precision."""
        return [(n, t) for n, t in self.named if t.dtype == self.half]

    def local_flat(self) -> Tensor:
        """A flat copy of this process's slices (a sharded model)."""
        return torch.cat([t.detach().reshape(-1) for t in self.local])


HALF = (torch.float16, torch.bfloat16)


def perturbation_dtypes(named: list[tuple[str, Tensor]]):
    """``(dtype, half, narrow)`` of a target (see :class:`Target`): the perturbation's
    dtype, the half precision of its parameters in it (the most common, where both
    are), and the parameters that compute in a dtype narrower than ``dtype``, with it.

    >>> import torch
    >>> named = [("w", torch.zeros(2, dtype=torch.bfloat16)), ("router", torch.zeros(2))]
    >>> perturbation_dtypes(named)
    (torch.float32, torch.bfloat16, {})
    >>> wide = torch.zeros(2, dtype=torch.float64)
    >>> perturbation_dtypes([("w", wide), ("router", torch.zeros(2))])
    (torch.float64, None, {'router': torch.float32})
    """
    dtype = functools.reduce(
        torch.promote_types, [torch.float32, *(t.dtype for _, t in named if t.dtype not in HALF)]
    )
    halves = [t.dtype for _, t in named if t.dtype in HALF]
    half = max(set(halves), key=halves.count) if halves else None
    narrow = {}
    for name, t in named:
        computes = torch.float32 if t.dtype in HALF else t.dtype
        if computes != dtype:
            narrow[name] = computes
    return dtype, half, narrow


def settle(model: nn.Module, batch: object, loss_fn: LossFunction) -> None:
    """One forward pass without gradient before the measure reads the parameters'
    dtypes: a model whose own forward converts a parameter (a router cast to float32
    in its first forward) is measured in the dtypes it computes in (discovery runs one
    where the measure has pairs; :func:`~geosharp.params.tensors_kept` puts the model's
    tensors back after the measure)."""
    from ..params import evaluation_mode, frozen_except

    with torch.no_grad(), evaluation_mode(model), frozen_except(model, []):
        loss_fn(model, batch)


def check_model(model: object) -> None:
    """An error unless ``model`` is a module whose parameters hold values: a path or a
    name (load it first), or weights on the ``meta`` device (shapes without values)."""
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        raise TypeError(
            f"model must be a torch.nn.Module, got the {type(model).__name__} {model!r}: load "
            "it first (e.g. AutoModelForSequenceClassification.from_pretrained(path))"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"{meta} is on the meta device (a shape without values): load the weights (e.g. "
            "from_pretrained, or load_state_dict(..., assign=True)) before measuring"
        )


def find_target(
    model: nn.Module,
    geo: Geometry,
    parameters: Sequence[str] | str | None,
    symmetries: Symmetries | None,
    probe: tuple[object, LossFunction] | None = None,
    strict: bool = False,
    unsupported: tuple = (None, False),
    means: str = "value",
) -> Target:
    """The perturbed parameters and their pairs. Without ``symmetries``, they are found
    (:func:`find_symmetries`, on ``probe = (batch, loss_fn)`` when given) only where the
    measure uses pairs: its geometry has a pair factor, or ``parameters="pairs"``. A
    geometry with a pair factor on a model whose attention symmetry is partly not
    understood warns once (``strict``: raises). A sharded model (FSDP2) gives this
    process's slices (:mod:`geosharp.fsdp`); ``unsupported = (entries, distributed)``
    are refused there. ``means``: what the warning says a gap does (:data:`GAP_MEANS`)."""
    check_model(model)
    pairs_only = isinstance(parameters, str) and parameters == "pairs"
    sharded = is_sharded(model)
    if sharded:
        reshard(model)
        if symmetries is None:
            symmetries = symmetries_of(model)
    if symmetries is None and (geo.metric is not None or pairs_only):
        if sharded:  # found on its structure, checked on the sharded model
            symmetries = sharded_symmetries(model, probe)
        elif probe is not None:
            batch, loss_fn = probe
            symmetries = find_symmetries(model, batch, loss_fn=loss_fn, warn=False)
        else:
            symmetries = find_symmetries(model, warn=False)
    elif probe is not None and not sharded:
        settle(model, *probe)
    if pairs_only:
        parameters = pair_parameters(model, symmetries)
    named = perturbed_parameters(model, parameters)
    pairs = (
        symmetries.restrict([n for n, _ in named]).pairs
        if geo.metric is not None and symmetries is not None
        else []
    )
    if geo.metric is not None and symmetries is not None:
        say_ignored(symmetries, label_of(geo), strict, means)
    dtype, half, narrow = perturbation_dtypes(named)
    upcast = half is not None
    if sharded:  # theta: the model's own slices (a measure that writes them copies them)
        check_shardable(*unsupported)
        if narrow or (half is not None and len({t.dtype for _, t in named}) > 1):
            raise UsageError(
                "the perturbed parameters of this sharded model come in several dtypes "
                f"({', '.join(sorted({str(t.dtype).removeprefix('torch.') for _, t in named}))}"
                "): measure it unsharded, or perturb parameters of one dtype (parameters=...)"
            )
        shards, local = local_shards(named)
        theta = {n: t.detach() for (n, _), t in zip(named, local)}
        device = local[0].device
        return Target(
            named, pairs, shards.local, dtype, upcast, theta, device, symmetries, shards, local,
            half,
        )  # fmt: skip
    theta = {n: t.detach() for n, t in named}
    return Target(
        named, pairs, ParameterLayout.from_named(named), dtype, upcast, theta,
        named[0][1].device, symmetries, half=half, narrow=narrow,
    )  # fmt: skip


def checked_rho(rho: object) -> float:
    number = real_number(rho, "rho")
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"rho must be a positive finite number, got {rho!r}")
    return number


def geometry_of(
    measure: str | Geometry | None, parameters: Sequence[str] | str | None = None
) -> tuple[Geometry, Sequence[str] | str | None]:
    """The geometry of ``measure`` (a name of :data:`~geosharp.measures.MEASURES`, default
    ``"geodesic-inv"``, or a :class:`~geosharp.geometry.Geometry`), and the parameters to
    perturb (a ``*-attn`` measure restricts them to the pairs).

    >>> geometry_of("adaptive-attn")[1]
    'pairs'
    """
    from .catalog import measure_kwargs

    if isinstance(measure, Geometry):
        return measure, parameters
    if measure is None:
        measure = "geodesic-inv"
    if not isinstance(measure, str):
        raise TypeError(f"measure must be a name or a Geometry, got {measure!r}")
    spec = measure_kwargs(measure)
    parameters = spec.pop("parameters", parameters)
    return Geometry.named(spec.pop("geometry"), **spec), parameters


_GEOMETRY_KEYS = {"geometry", "metric", "eps", "p", "elementwise_step"}
_ESTIMATOR_KEYS = {"kind", "n_iters", "n_samples", "starts", "random_start"}
LEGACY = _GEOMETRY_KEYS | _ESTIMATOR_KEYS


def refuse_legacy(function: str, keywords: dict) -> None:
    """A ``TypeError`` naming the current spelling of the flat keywords of earlier
    versions (the geometry and the estimator piece by piece), or of unknown ones."""
    if not keywords:
        return
    if "per" in keywords:
        raise TypeError(
            f"{function}() no longer takes per: write block_sharpness(model, batches, loss_fn, "
            f"..., per={keywords['per']!r}) (geosharp.block_sharpness)"
        )
    if "low_memory" in keywords:
        raise TypeError(
            f"{function}() no longer takes low_memory: its memory (no copy of the best "
            "point's gradient) is the default now; remove the argument"
        )
    unknown = sorted(set(keywords) - LEGACY)
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword argument(s): {', '.join(unknown)}")
    spelled = []
    geometry = {k: v for k, v in keywords.items() if k in _GEOMETRY_KEYS}
    if geometry:
        args = [repr(geometry.pop("geometry", "geodesic"))]
        args += [f"{k}={_spelled(v)}" for k, v in geometry.items()]
        spelled.append(f"measure=Geometry.named({', '.join(args)})")
    estimator = {k: v for k, v in keywords.items() if k in _ESTIMATOR_KEYS}
    if estimator:
        if estimator.get("kind") == "average":
            spelled.append(f"estimator=AverageCase(n_samples={estimator.get('n_samples', 10)})")
        else:
            starts = "'random'" if estimator.get("random_start") else None
            starts = repr(estimator["starts"]) if "starts" in estimator else starts
            args = [f"n_iters={estimator['n_iters']}"] if "n_iters" in estimator else []
            args += [f"starts={starts}"] if starts else []
            spelled.append(f"estimator=WorstCase({', '.join(args)})")
    raise TypeError(
        f"{function}() no longer takes {', '.join(sorted(keywords))}: write "
        + ", ".join(spelled)
        + " (geosharp.Geometry, geosharp.WorstCase, geosharp.AverageCase)"
    )


def _spelled(value) -> str:
    """``value`` as Python source (``float('inf')`` for an infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return f"float({str(value)!r})"
    return repr(value)


def pair_parameters(model: nn.Module, symmetries: Symmetries) -> list[str]:
    """The names of the parameters in ``symmetries``' pairs, in the model's order."""
    in_pairs = {n for pair in symmetries.pairs for n in pair.params}
    names = [n for n, _ in model.named_parameters() if n in in_pairs]
    if not names:
        raise ValueError(
            "parameters='pairs': no symmetric pairs were found in the model "
            "(see geosharp.find_symmetries(model).summary())"
        )
    return names


def perturbed_parameters(model: nn.Module, names: Sequence[str] | None) -> list[tuple[str, Tensor]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    named = list(model.named_parameters())
    if not named:
        raise ValueError("the model has no parameters: there is nothing to perturb")
    if names is None:
        chosen = [(n, p) for n, p in named if p.requires_grad]
        if not chosen:
            raise ValueError(
                "no parameter of the model requires grad; pass `parameters=[...]` to choose "
                "which to perturb"
            )
        return chosen
    if isinstance(names, str):
        raise TypeError(f"parameters must be a list of names or 'pairs', got {names!r}")
    names = list(names)
    if not names:
        raise ValueError(
            "parameters=[] names no parameter to perturb: give at least one name, or "
            "parameters=None for all that require grad"
        )
    known = dict(named)
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"unknown parameter names: {missing}; see model.named_parameters()")
    return [(n, known[n]) for n in names]


def numbered(
    batches: Iterable, limit: int | None, progress: bool, label: str, length: int | None = None
):
    if isinstance(batches, (Tensor, dict)):
        raise TypeError(
            "`batches` must be an iterable of batches (e.g. a DataLoader or a list); "
            "wrap a single batch in a list: [batch]"
        )
    if length is None and hasattr(batches, "__len__"):
        length = len(batches)  # type: ignore[arg-type]
    total = limit
    if length is not None:
        total = length if limit is None else min(limit, length)
    iterator = iter(Progress(batches, total=total, desc=label, unit="batch", enabled=progress))
    for i, batch in enumerate(iterator):
        if limit is not None and i >= limit:
            break
        yield i, usable_for_grad(batch)


def checked_loss(loss: object, where: str) -> float:
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar, got shape {tuple(loss.shape)}; "
            "reduce it, e.g. with .mean()"
        )
    value = float(loss.detach())
    if not math.isfinite(value):
        raise FloatingPointError(f"the {where} loss is {value}: check the model and the data")
    return value


def autocast_for(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def process_group(distributed: bool) -> tuple[int, int]:
    if not distributed:
        return 0, 1
    from ..distributed import rank_and_world

    return rank_and_world(require=True)


def batch_seed(seed: int, index: int) -> int:
    """``seed`` for the first batch, a splitmix64 mix of ``(seed, index)`` after."""
    if index == 0:
        return seed
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + index) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 1


def entry_mask(space: PerturbationSpace, layout: ParameterLayout, entries) -> Tensor:
    """A flat 0/1 vector: 1 at the ``entries`` of each parameter."""
    mask = space.empty().zero_()
    for name, index in entries.items():
        if name not in layout.names:
            raise ValueError(f"entries names {name!r}, which is not among the measured parameters")
        size = math.prod(layout.shapes[layout.names.index(name)])
        index = torch.as_tensor(index, dtype=torch.long, device=mask.device).reshape(-1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= size):
            raise ValueError(f"entries of {name!r} fall outside its {size} elements")
        mask[layout.offset(name) + index] = 1.0
    if not bool(mask.any()):
        raise ValueError("entries selects no element to perturb")
    return mask


def masked(xi: Tensor, mask: Tensor | None) -> Tensor:
    return xi if mask is None else xi.mul_(mask)


def scale_to(space: PerturbationSpace, xi: Tensor, rho: float) -> Tensor:
    return xi.mul_((rho / space.norm(xi).clamp_min(1e-30)).to(xi.dtype))


def _wider(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The next wider floating dtype (MPS has no float64)."""
    if dtype in HALF:
        return torch.float32
    if dtype == torch.float32 and device.type != "mps":
        return torch.float64
    return dtype


@dataclass
class Measurement:
    """One measure set up on a model, for its estimator's per-batch estimates: how the
    model runs (``backend``: the loss ``evaluate(params, batch)`` and the base point
    ``theta`` as it reads it, :mod:`geosharp.measures.backends`) in its precision
    (``autocast``), the perturbation space and radius, the entries measured (``mask``),
    the seed, and the progress and callback of each evaluation."""

    backend: object
    space: PerturbationSpace
    layout: ParameterLayout
    rho: float
    seed: int
    autocast: object
    floor_dtype: torch.dtype | None  # None: measured against float32 (autocast)
    mask: Tensor | None = None
    callback: object = None
    steps: Progress | None = None
    grad_dtype: torch.dtype | None = None  # a half-precision model's, offered to Auto-PGD
    model: nn.Module | None = None  # whose outputs' precision the floor reads

    @property
    def evaluate(self):
        return self.backend.evaluate

    @property
    def theta(self):
        return self.backend.theta

    def unperturbed(self, batch) -> tuple[float, float]:
        """The loss at ``theta`` and its round-off floor: ``|L - L_float32|`` under
        autocast, measured; else the larger of ``eps * |L|`` of the precision the model
        computes in and :meth:`output_floor`, what the precision of the model's outputs
        and of the loss's own arithmetic resolves (never 0 because the loss is, as a
        confident prediction's is in bfloat16)."""
        with self.autocast():
            value = self.evaluate(self.theta, batch)
            loss = checked_loss(value, "unperturbed")
        if self.floor_dtype is None:
            with torch.no_grad():
                return loss, abs(loss - float(self.evaluate(self.theta, batch)))
        floor = torch.finfo(self.floor_dtype).eps * abs(loss)
        if self.model is not None:
            floor = max(floor, self.output_floor(batch, loss, value.dtype))
        if value.dtype in HALF:
            warn_half_loss(value.dtype, loss)
        return loss, floor

    def output_floor(self, batch, loss: float, dtype: torch.dtype) -> float:
        """``|L' - L|``, ``L'`` the loss from the model's floating outputs each multiplied
        by ``1 +- eps`` of its dtype (fixed random signs) and widened by one step
        (half precision to float32, float32 to float64 but on MPS): the change that
        rounding the outputs makes, and the round-off of the loss computed from them (a
        log-softmax in bfloat16 rounds a loss of 1e-4 to 0). A loss of exactly 0 that a
        loss function's own cast keeps 0 there: ``eps`` of the loss's ``dtype`` times the
        outputs' mean magnitude, what its arithmetic on such outputs rounds away."""
        from torch.utils._pytree import tree_map_only

        scale = [0.0]

        def rounded(t: Tensor) -> Tensor:
            if not t.is_floating_point():
                return t
            scale[0] = max(scale[0], float(t.detach().abs().float().mean()))
            generator = torch.Generator(device=t.device).manual_seed(0)
            signs = torch.randint(0, 2, t.shape, generator=generator, device=t.device)
            wide = t.to(_wider(t.dtype, t.device))
            return wide * (1 + torch.finfo(t.dtype).eps * (2 * signs - 1))

        hook = self.model.register_forward_hook(
            lambda _m, _a, out: tree_map_only(Tensor, rounded, out)
        )
        try:
            with torch.no_grad(), self.autocast():
                moved = float(scalar_loss(self.evaluate(self.theta, batch)).detach())
        finally:
            hook.remove()
        if not math.isfinite(moved):
            return 0.0
        if moved == loss == 0 and dtype.is_floating_point:
            return torch.finfo(dtype).eps * scale[0]
        return abs(moved - loss)

    def generator(self, index: int) -> torch.Generator:
        """Batch ``index``'s own generator: its value does not depend on which process
        measures it."""
        generator = torch.Generator(device=self.space.device)
        return generator.manual_seed(batch_seed(self.seed, index))

    def random(self, generator: torch.Generator) -> Tensor:
        """A random tangent of norm ``rho`` (Gaussian in the metric, on the entries)."""
        return scale_to(self.space, masked(self.space.random(generator), self.mask), self.rho)

    def objective(self, batch):
        """``(point, out) -> (loss, gradient into out)`` for Auto-PGD on ``batch``."""
        return self.backend.objective(self.layout, batch, self.autocast, self.mask)

    def loss_at(self, point: Tensor, batch) -> float:
        """The loss at the flat ``point``, without gradient."""
        with torch.no_grad(), self.autocast():
            return float(self.evaluate(self.layout.unflatten(point), batch))

    def evaluated(self) -> None:
        if self.steps is not None:
            self.steps.update()
