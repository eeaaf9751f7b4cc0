r"""``sharpness``: worst- and average-case sharpness in one of five geometries.

For a batch ``S`` with loss ``L_S`` and a ball of radius ``rho`` in the chosen
geometry (see :mod:`geosharp.geometry.space`),

.. math::

    S_\max = \max_{\|\xi\| \le \rho} L_S(\gamma_\xi(1)) - L_S(\theta), \qquad
    S_\text{avg} = \mathbb{E}_{\|\xi\| = \rho} L_S(\gamma_\xi(1)) - L_S(\theta),

maximised by Auto-PGD (:mod:`geosharp.measures.apgd`) or averaged over random
directions (Gaussian in the metric, projected, scaled to norm ``rho``). Sharpness is
computed batch by batch and averaged, as in the paper.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..errors import PrecisionWarning, UsageError, warn_user
from ..geometry.space import Geometry, PerturbationSpace
from ..io import dumps
from ..params import (
    LossFunction,
    checkpointing_kept,
    evaluation_mode,
    frozen_except,
    grad_owned,
    keeping_tensors,
)
from ..progress import Progress
from ..symmetry.discovery import find_symmetries
from ..symmetry.pairs import Symmetries
from .apgd import RESTART, APGDTrace, Iterate, gradient_dtype
from .backends import choose_backend
from .blocks import PER, BlockSharpness, head_entries, parameter_blocks
from .estimators import AverageCase, BatchResult, Estimator, WorstCase
from .fsdp import is_sharded
from .problem import (
    FloorError,
    Measurement,
    Target,
    autocast_for,
    check_floor,
    check_model,
    checked_rho,
    entry_mask,
    find_target,
    geometry_of,
    label_of,
    matmuls,
    nonfinite_error,
    numbered,
    peek,
    process_group,
    refuse_legacy,
    symmetry_report,
)

__all__ = ["SharpnessResult", "block_sharpness", "sharpness"]


@dataclass
class SharpnessResult:
    """Sharpness of a model on a set of batches.

    ``value`` is the mean over batches of (best or mean perturbed loss minus the
    unperturbed loss); ``per_batch`` holds each batch's value, ``loss`` the mean
    unperturbed loss, ``traces`` the Auto-PGD trace of each batch (worst case; of its
    best start), ``per_batch_starts`` each start's value per batch (several starts).
    ``nonfinite``: where a perturbed loss was not finite (``nonfinite="inf"``: the
    value is then ``inf``, never a finite number). ``floor``: the round-off floor of the
    loss at the precision used, per batch on average: under autocast ``|L(theta) -
    L_float32(theta)|``, measured; otherwise ``eps * |L(theta)|`` of the dtype, a lower
    bound. A value within 10x of it is warned about (``strict``: refused).
    """

    value: float
    per_batch: list[float]
    loss: float
    per_batch_loss: list[float]
    geometry: str
    kind: str
    rho: float
    settings: dict = field(default_factory=dict)
    traces: list[APGDTrace] = field(default_factory=list)
    per_batch_starts: list[list[float]] = field(default_factory=list)
    symmetry: dict = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)
    floor: float = 0.0

    @property
    def symmetry_complete(self) -> bool:
        """Whether every symmetry found was used and every pair used was verified on the
        model: ``False`` when some modules were measured element-wise because geosharp
        did not understand their symmetry (``symmetry["ignored"]`` says which and why) or
        a pair was used unverified (``symmetry["unverified"]``); always ``True`` for
        measures without a pair factor (adaptive, Euclidean)."""
        return not self.symmetry.get("ignored") and not self.symmetry.get("unverified")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["traces"] = [t.to_dict() for t in self.traces]
        return out

    def to_json(self, **kwargs) -> str:
        """Strict JSON: a non-finite value is ``null`` (``nonfinite`` says why)."""
        return dumps(self.to_dict(), **{"indent": None, **kwargs})

    def __str__(self) -> str:
        text = (
            f"{self.kind}-case {self.geometry} sharpness (rho={self.rho:g}): {self.value:.6g} "
            f"over {len(self.per_batch)} batch(es); unperturbed loss {self.loss:.6g}"
        )
        ignored = self.symmetry.get("ignored") or {}
        if ignored:
            text += (
                f"; NOT symmetry-correct in {len(ignored)} attention module"
                f"{'s' * (len(ignored) != 1)} measured element-wise (see .symmetry)"
            )
        return text


@grad_owned  # also under the caller's no_grad() or inference_mode()
@keeping_tensors
def sharpness(
    model: nn.Module,
    batches: Iterable,
    loss_fn: LossFunction,
    measure: str | Geometry | None = None,
    rho: float | None = None,
    estimator: Estimator | None = None,
    *,
    seed: int = 0,
    symmetries: Symmetries | None = None,
    parameters: Sequence[str] | str | None = None,
    entries: Mapping[str, Tensor] | None = None,
    max_batches: int | None = None,
    progress: bool = False,
    autocast_dtype: torch.dtype | None = None,
    distributed: bool = False,
    callback: Callable[[str, int, Iterate], None] | None = None,
    strict: bool = False,
    nonfinite: str = "error",
    matmul_precision: str = "highest",
    **legacy,
) -> SharpnessResult:
    """Measure the sharpness of ``model`` on ``batches``.

    What is measured: ``measure``, ``rho`` and ``estimator``; the other arguments say
    how (which parameters, which batches, on which processes, with what feedback).

    Args:
        model: any ``nn.Module``; it is put in eval mode for the measure and left
            bit-identical afterwards (flags restored, tensors never written), also
            when this function raises.
        batches: an iterable of batches (a ``DataLoader``, a list, ...).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``; call the model inside it
            (so dict inputs of Hugging Face models work).
        measure: a named measure of :data:`geosharp.measures.MEASURES`
            (``"geodesic-inv"``, the default, ``"adaptive"``, ``"adaptive-attn"``,
            ...), which sets the geometry and, for the ``*-attn`` measures,
            ``parameters``; or a :class:`~geosharp.geometry.Geometry`
            (``Geometry.named(...)``, with its options, or your own).
        rho: radius of the ball (relative for adaptive/``inv``, absolute for ``mix``
            and Euclidean); a Python, NumPy or 0-d torch number. Default: the measure's
            default radius, ``geosharp.measures.DEFAULT_RHO`` (the same in the CLI).
        estimator: :class:`~geosharp.measures.WorstCase` (Auto-PGD; the default,
            ``WorstCase(n_iters=20, starts="zero")``) or
            :class:`~geosharp.measures.AverageCase` (random directions).
        seed: seed of a private generator (random starts, average case); global RNG
            state is not touched.
        symmetries: the model's symmetries (default: :func:`find_symmetries` on the
            first batch with ``loss_fn``, each pair verified; not needed by measures
            without a pair factor). Attention modules whose symmetry geosharp does not
            understand are measured element-wise: the result says so
            (``result.symmetry``, a warning), and ``strict=True`` makes it an error.
        parameters: names of the parameters to perturb (default: all that require
            grad), or ``"pairs"``: those of the symmetric pairs (attention's
            query/key/value/output weights and biases), where the geometries differ.
            Pairs with a parameter outside this set are not used.
        max_batches: use at most this many batches.
        progress: show progress per forward+backward (each Auto-PGD step; each random
            direction), with the time left: a bar on a terminal, a line every 30 s in a
            log.
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16`` to run the model's
            forward and backward under :func:`torch.autocast` (unperturbed loss
            included); the perturbation, its geometry and the gradient stay in the
            parameters' dtype. Without loss scaling: prefer bfloat16.
        distributed: measure across the processes of the default ``torch.distributed``
            group (launched with ``torchrun``): every process iterates over the same
            ``batches``, measures batches ``rank, rank + world_size, ...`` and receives
            the full result, identical to a single-process run (see
            :mod:`geosharp.distributed`).
        callback: ``callback(event, i, iterate)`` for diagnostics and benchmarks, handed
            to :func:`~geosharp.measures.auto_pgd` (worst case; see its events;
            ``iterate.xi`` is the tangent).
        strict: raise instead of warning when a geodesic measure would treat attention
            modules whose symmetry geosharp does not understand element-wise, or when
            the value is within 10x of the loss's round-off floor (``result.floor``).
        nonfinite: what a perturbed loss that is not finite (NaN or infinite: the radius
            reaches where the model breaks down) makes of the value: ``"error"`` (the
            default) raises a ``FloatingPointError`` naming the batch and step;
            ``"inf"`` reports ``inf`` for that batch, and where in
            ``result.nonfinite``. Never a finite number: the supremum over a ball that
            holds such a point is not one.
        matmul_precision: float32 matmuls on CUDA during the measure: ``"highest"``
            (the default: TF32 off, whatever the training script set, since TF32 cannot
            see small perturbations) or ``"as-set"`` (keep the process's setting).
            Recorded in ``result.settings``.
        entries: ``{parameter name: flat positions}`` (int64 indices into
            ``param.view(-1)``): perturb only these entries, the rest of the model
            fixed (``parameters`` defaults to the names given). The ball is the
            measure's ball in that subspace: the gradient and the random starts are
            masked, which every geometry here keeps exact (element-wise parts are
            diagonal, pair blocks are per head).

    Half-precision (``bfloat16``/``float16``) models are perturbed in float32: a
    relative perturbation of ``rho`` spread over all weights is far below their
    resolution and would round away (sharpness exactly 0). The modules that own
    perturbed parameters compute in float32, on the weights read in float32 where used,
    the rest of the model in its own precision (``settings["precision"]``); their
    straight steps keep Auto-PGD's gradient in bfloat16
    (``settings["gradient"]``). The model itself is not touched; pass
    ``autocast_dtype`` to run the matrix products in half precision.

    Batch ``i`` draws its random start or directions from its own generator (seeded
    with ``seed`` for the first batch and with a mix of ``seed`` and ``i`` after), so a
    batch's value does not depend on which process measures it.
    """
    refuse_legacy("sharpness", legacy)
    estimator = _checked_estimator(estimator)
    _check_options(nonfinite, autocast_dtype, matmul_precision)
    if entries is not None and parameters is None:
        parameters = list(entries)
    geo, parameters = geometry_of(measure, parameters)
    rho = _radius(rho, geo, parameters)
    rank, world = process_group(distributed)
    batches, total, first = peek(batches)
    target = find_target(
        model, geo, parameters, symmetries, probe=(first, loss_fn), strict=strict,
        unsupported=(entries, distributed),
    )  # fmt: skip
    backend = choose_backend(model, target, loss_fn, first, autocast_dtype)
    # the precision of the rest of a model measured in float32 where it is perturbed
    half = backend.half
    settings = _settings(geo, estimator, target, parameters, seed, autocast_dtype, half,
                         backend.split)  # fmt: skip
    if entries is not None:
        settings["entries"] = {n: len(i) for n, i in entries.items()}
    if backend.point is not None:
        settings["sharded"] = torch.distributed.get_world_size()
        settings["sharded_point"] = backend.point
    shown = (torch.distributed.get_rank() if backend.point is not None else rank) == 0
    n_batches = total if max_batches is None or total is None else min(total, max_batches)
    steps = Progress(
        total=None if n_batches is None else -(-n_batches // world) * estimator.evaluations,
        desc=f"{geo.name} rho={rho:g}", unit="step", enabled=progress and shown,
    )  # fmt: skip
    records: list[BatchResult] = []
    with (
        evaluation_mode(model),
        frozen_except(model, backend.trained(target)),  # no gradient for the rest
        matmuls(target.device, matmul_precision, settings),
        backend.active(),  # its owners in float32, its shards restored at the end
        steps,  # the bar is cleared even when a batch raises
    ):
        m = _measurement(model, backend, target, geo, rho, seed, autocast_dtype)
        settings["checkpointing"] = checkpointing_kept(model, lambda: m.evaluate(m.theta, first))
        m.mask = None if entries is None else entry_mask(m.space, target.layout, entries)
        m.steps = steps if steps.enabled else None
        m.callback = _counting(steps, callback) if steps.enabled else callback
        for index, batch in numbered(batches, max_batches, False, geo.name, total):
            if index % world == rank:
                records.append(estimator.estimate(m, index, batch))
                if records[-1].nonfinite and nonfinite == "error" and not distributed:
                    nonfinite_error(label_of(geo), rho, records[-1].nonfinite)
    if distributed:
        from ..distributed import gather_in_order

        records = gather_in_order(records, key=lambda r: r.index)
    return _result(records, geo, estimator, rho, settings, target, nonfinite, strict)


def _checked_estimator(estimator: Estimator | None) -> Estimator:
    if estimator is None:
        return WorstCase()
    if not isinstance(estimator, (WorstCase, AverageCase)):
        raise TypeError(f"estimator must be WorstCase(...) or AverageCase(...), got {estimator!r}")
    return estimator


def _check_options(nonfinite: str, autocast_dtype, matmul_precision: str) -> None:
    if nonfinite not in ("error", "inf"):
        raise ValueError(f"nonfinite must be 'error' or 'inf', got {nonfinite!r}")
    if autocast_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(
            f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {autocast_dtype!r}"
        )
    if matmul_precision not in ("highest", "as-set"):
        raise ValueError(
            f"matmul_precision must be 'highest' or 'as-set', got {matmul_precision!r}"
        )


def _radius(rho: object, geo: Geometry, parameters) -> float:
    """``rho``, checked, or the measure's default radius (:data:`DEFAULT_RHO`)."""
    from .catalog import DEFAULT_RHO

    if rho is None:
        label = label_of(geo)
        name = f"{label}-attn" if parameters == "pairs" else label
        if name not in DEFAULT_RHO:
            raise ValueError(
                f"{name!r} is not a named measure and has no default radius: pass rho, "
                f"or use one of {', '.join(DEFAULT_RHO)}"
            )
        rho = DEFAULT_RHO[name]
    return checked_rho(rho)


def _settings(
    geo, estimator, target: Target, parameters, seed, autocast_dtype, half, split=False
) -> dict:
    """What the result records of how it was measured."""
    worst = isinstance(estimator, WorstCase)

    def name(dtype) -> str:
        return str(dtype).removeprefix("torch.")

    if autocast_dtype is not None:
        precision = f"{name(autocast_dtype)} autocast"
    elif half is not None:
        precision = f"float32 in the perturbed modules, {name(half)} elsewhere"
        if split:  # the perturbed matrices' products in half-precision parts
            precision = f"{name(half)} products of the perturbed matrices in parts, {precision}"
    else:
        precision = name(target.dtype)
    if target.narrow and autocast_dtype is None:  # a float32 router beside float64 weights
        own = sorted({name(d) for d in target.narrow.values()})
        precision += f"; {len(target.narrow)} parameters in {', '.join(own)}, as their modules"
    return dict(
        metric=geo.metric.name if geo.metric is not None else None,
        estimator=repr(estimator),
        n_iters=estimator.n_iters if worst else None,
        restart=RESTART if worst else None,
        n_samples=None if worst else estimator.n_samples,
        seed=seed,
        starts=estimator.starts if worst else None,
        eps=getattr(geo.metric, "eps", 0.0),
        p=geo.p,
        elementwise_step="exp" if geo.exp_elementwise else "straight",
        n_pairs=len(target.pairs),
        n_perturbed=sum(p.numel() for _, p in target.named),
        parameters="pairs" if parameters == "pairs" else None,
        autocast=None if autocast_dtype is None else name(autocast_dtype),
        dtype=name(target.dtype),
        precision=precision,
        gradient=name(gradient_dtype(geo, target.dtype, half)) if worst else None,
    )


def _measurement(model, backend, target: Target, geo, rho, seed, autocast_dtype) -> Measurement:
    """The :class:`Measurement` of ``target``: its space, and its loss through
    ``backend`` in the precision asked for (under autocast the floor is measured
    against float32)."""
    space = PerturbationSpace(
        target.theta, target.layout, target.pairs, geo, shards=target.shards,
        dtype=target.dtype,
    )  # fmt: skip
    # the rest of a half-precision model computes in its own precision, ``half``; a
    # parameter narrower than the perturbation's dtype computes in its own
    floor_dtype = backend.half or max(
        [target.dtype, *target.narrow.values()], key=lambda d: torch.finfo(d).eps
    )
    return Measurement(
        backend, space, target.layout, rho, seed, autocast_for(target.device, autocast_dtype),
        None if autocast_dtype is not None else floor_dtype,
        grad_dtype=backend.half,  # the gradient in the model's precision, as its training step's
        model=model,
    )  # fmt: skip


def _result(records, geo, estimator, rho, settings, target, nonfinite, strict) -> SharpnessResult:
    """The mean over batches of the per-batch records, checked against the floor."""
    if not records:
        raise ValueError("no batches: `batches` yielded nothing to measure on")
    label = label_of(geo)
    broken = [where for r in records for where in r.nonfinite]
    if broken and nonfinite == "error":
        nonfinite_error(label, rho, broken)
    values = [r.value for r in records]
    losses = [r.loss for r in records]
    floor = sum(r.floor for r in records) / len(records)
    value = sum(values) / len(values)
    check_floor(label, rho, value, floor, settings["precision"], strict)
    several = isinstance(estimator, WorstCase) and estimator.runs[0] > 1
    return SharpnessResult(
        value=value,
        per_batch=values,
        loss=sum(losses) / len(losses),
        per_batch_loss=losses,
        geometry=label,
        kind=estimator.kind,
        rho=rho,
        settings=settings,
        traces=[r.trace for r in records if r.trace is not None],
        per_batch_starts=[r.starts for r in records] if several else [],
        symmetry=symmetry_report(target, geo),
        nonfinite=broken,
        floor=floor,
    )


def block_sharpness(
    model: nn.Module,
    batches: Iterable,
    loss_fn: LossFunction,
    measure: str | Geometry | None = None,
    rho: float | None = None,
    estimator: Estimator | None = None,
    *,
    per: str = "layer",
    symmetries: Symmetries | None = None,
    **options,
) -> BlockSharpness:
    """The :func:`sharpness` of each block of parameters with all others fixed, in the
    same geometry and radius: ``per="layer"``, ``"module"`` or ``"head"`` (blocks:
    :func:`~geosharp.measures.blocks.parameter_blocks`; attention pairs are kept whole,
    so geodesic block values are symmetry-invariant; ``"head"``: the rows and columns
    of each attention head's pair blocks). ``options``: those of :func:`sharpness` but
    ``parameters`` and ``entries``. It costs one measure per block."""
    if per not in PER:
        raise ValueError(f"per must be one of {', '.join(map(repr, PER))}, got {per!r}")
    for key in ("parameters", "entries"):
        if options.get(key) is not None:
            raise ValueError(f"block_sharpness measures blocks of its own: drop {key}=")
    _, subset = geometry_of(measure, None)
    if subset is not None:
        raise ValueError(f"block_sharpness measures every block: use {measure!r} without '-attn'")
    check_model(model)
    if is_sharded(model):
        raise UsageError(
            "block_sharpness is not available on a sharded model: measure the blocks one by "
            "one with sharpness(..., parameters=[...]) (or on the unsharded model)"
        )
    batches, _, first = peek(batches)
    batches = list(batches)  # read once per block
    if symmetries is None:  # the same blocks for every measure
        symmetries = find_symmetries(model, first, loss_fn=loss_fn, warn=False)
    args = (model, batches, loss_fn, measure, rho, estimator)
    pairs = symmetries.pairs
    if per == "head":
        heads = head_entries(pairs)
        if not heads:
            raise ValueError("per='head': no attention pairs were found, so there are no heads")
        out = BlockSharpness(per, parameters={n: list(e) for n, e in heads.items()})
        for name, chosen in heads.items():
            out.blocks[name] = _block(name, args, symmetries=symmetries, entries=chosen, **options)
        return out
    groups = parameter_blocks(model, per, pairs)
    out = BlockSharpness(per, parameters=groups)
    for name, names in groups.items():
        out.blocks[name] = _block(name, args, symmetries=symmetries, parameters=names, **options)
    return out


def _block(name: str, args: tuple, **options) -> SharpnessResult:
    """One block's :func:`sharpness`; its floor's warning or error names the block."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = sharpness(*args, **options)
        except FloorError as err:
            raise err.of(name) from None
    for w in caught:  # said again from the caller's call, the floor's with its block
        near = issubclass(w.category, PrecisionWarning) and "round-off floor" in str(w.message)
        message = f"[{name}] {w.message}" if near else w.message
        warn_user(message, w.category)
    return result


def _counting(steps: Progress, callback):
    """An Auto-PGD callback that counts each evaluation on ``steps``, then calls
    ``callback`` (if any)."""

    def count(event: str, i: int, iterate) -> None:
        if event == "evaluated":
            steps.update()
        if callback is not None:
            callback(event, i, iterate)

    return count
