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

import contextlib
import functools
import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ..errors import PrecisionWarning, SymmetryWarning, UsageError, real_number
from ..geometry.sharded import Shards
from ..geometry.space import Geometry, PerturbationSpace
from ..io import dumps
from ..layout import ParameterLayout
from ..params import (
    LossFunction,
    aliases,
    checkpoint_errors,
    evaluation_mode,
    frozen_except,
    functional_loss,
    require_grad,
    scalar_loss,
)
from ..progress import Progress
from ..symmetry.discovery import find_symmetries
from ..symmetry.pairs import Symmetries
from .apgd import APGDTrace, Iterate, auto_pgd
from .blocks import PER, BlockSharpness, head_entries, parameter_blocks
from .estimators import AverageCase, Estimator, WorstCase, estimator_from
from .fsdp import (
    ShardedModel,
    check_shardable,
    is_sharded,
    local_shards,
    reshard,
    symmetries_of,
)

__all__ = ["SharpnessResult", "sharpness"]


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


_GEOMETRY_KEYS = ("geometry", "metric", "eps", "p", "elementwise_step")
_ESTIMATOR_KEYS = ("kind", "n_iters", "n_samples", "starts", "random_start")


@torch.enable_grad()  # it owns its computation: also under the caller's no_grad()
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
    max_batches: int | None = None,
    progress: bool = False,
    autocast_dtype: torch.dtype | None = None,
    distributed: bool = False,
    callback: Callable[[str, int, Iterate], None] | None = None,
    low_memory: bool = False,
    strict: bool = False,
    nonfinite: str = "error",
    per: str | None = None,
    entries: Mapping[str, Tensor] | None = None,
    matmul_precision: str = "highest",
    **flat,
) -> SharpnessResult | BlockSharpness:
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
        low_memory: three parameter-sized vectors fewer: no stored element-wise scale
            (computed piece by piece), and in Auto-PGD (see
            :func:`~geosharp.measures.auto_pgd`) the best point's gradient is
            recomputed at a restart away from the current point (a forward+backward
            more there) and each gradient's buffer is new (on the CPU its memory is then
            the training step's own). Same values.
        strict: raise instead of warning when a geodesic measure would treat attention
            modules whose symmetry geosharp does not understand element-wise, or when
            the value is within 10x of the loss's round-off floor (``result.floor``).
        nonfinite: what a perturbed loss that is not finite (NaN or infinite: the radius
            reaches where the model breaks down) makes of the value: ``"error"`` (the
            default) raises a ``FloatingPointError`` naming the batch and step;
            ``"inf"`` reports ``inf`` for that batch, and where in
            ``result.nonfinite``. Never a finite number: the supremum over a ball that
            holds such a point is not one.
        per: ``"layer"``, ``"module"`` or ``"head"``: the sharpness of each block of parameters with
            all others fixed, in the same geometry and radius, as a
            :class:`~geosharp.measures.blocks.BlockSharpness` (blocks:
            :func:`~geosharp.measures.blocks.parameter_blocks`; attention pairs are kept
            whole, so geodesic block values are symmetry-invariant). ``"head"``: each
            attention head (the rows and columns of its pair blocks). It costs one
            measure per block.
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
        **flat: the keywords of earlier versions, still accepted. The geometry piece by
            piece: ``geometry`` (``"euclidean"``, ``"adaptive"``, ``"geodesic"``,
            ``"geodesic-norm-only"``, ``"geodesic-curvature-only"``), ``metric``
            (``"inv"``, ``"mix"``), ``eps`` (``P + eps I`` in ``inv``), ``p`` (2 or
            ``float('inf')``), ``elementwise_step`` (``"straight"`` or ``"exp"``), as
            in :meth:`Geometry.named`; with a named ``measure`` only ``eps`` and
            ``elementwise_step``. The estimator piece by piece: ``kind`` (``"worst"``
            or ``"average"``), ``n_iters``, ``starts``, ``random_start`` (the same as
            ``starts="random"``), ``n_samples``.

    Half-precision (``bfloat16``/``float16``) models are measured in float32: a
    relative perturbation of ``rho`` spread over all weights is far below their
    resolution and would round away (sharpness exactly 0). The perturbation and the
    forward/backward then run on float32 copies of the weights (the model itself is
    not touched); pass ``autocast_dtype`` to run the matrix products in half precision.

    Batch ``i`` draws its random start or directions from its own generator (seeded
    with ``seed`` for the first batch and with a mix of ``seed`` and ``i`` after), so a
    batch's value does not depend on which process measures it.
    """
    from .catalog import DEFAULT_RHO

    unknown = sorted(set(flat) - {*_GEOMETRY_KEYS, *_ESTIMATOR_KEYS})
    if unknown:
        raise TypeError(f"sharpness() got unexpected keyword argument(s): {', '.join(unknown)}")
    if nonfinite not in ("error", "inf"):
        raise ValueError(f"nonfinite must be 'error' or 'inf', got {nonfinite!r}")
    if per is not None:
        return _per_block(per, locals())
    if entries is not None and parameters is None:
        parameters = list(entries)
    estimator = _estimator(estimator, {k: flat[k] for k in _ESTIMATOR_KEYS if k in flat})
    geo, parameters = _geometry(
        measure, {k: flat[k] for k in _GEOMETRY_KEYS if k in flat}, parameters
    )
    if autocast_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(
            f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {autocast_dtype!r}"
        )
    pairs_only = isinstance(parameters, str) and parameters == "pairs"
    label = _label(geo)
    if rho is None:
        name = f"{label}-attn" if pairs_only else label
        if name not in DEFAULT_RHO:
            raise ValueError(
                f"{name!r} is not a named measure and has no default radius: pass rho, "
                f"or use one of {', '.join(DEFAULT_RHO)}"
            )
        rho = DEFAULT_RHO[name]
    rho = _checked_rho(rho)
    rank, world = _process_group(distributed)
    batches, total, first = _peeked(batches)
    target = _target(
        model,
        geo,
        parameters,
        symmetries,
        probe=(first, loss_fn),
        strict=strict,
        unsupported=(entries, distributed),
    )
    report = _symmetry_report(target, geo)
    named, pairs, layout, dtype = target.named, target.pairs, target.layout, target.dtype
    theta, upcast, device = target.theta, target.upcast, target.device
    worst = isinstance(estimator, WorstCase)
    settings = dict(
        metric=geo.metric.name if geo.metric is not None else None,
        estimator=repr(estimator),
        n_iters=estimator.n_iters if worst else None,
        n_samples=None if worst else estimator.n_samples,
        seed=seed,
        starts=estimator.starts if worst else None,
        eps=getattr(geo.metric, "eps", 0.0),
        p=geo.p,
        elementwise_step="exp" if geo.exp_elementwise else "straight",
        n_pairs=len(pairs),
        parameters="pairs" if pairs_only else None,
        autocast=None if autocast_dtype is None else str(autocast_dtype).removeprefix("torch."),
        dtype=str(dtype).removeprefix("torch."),
    )
    autocast = _autocast(device, autocast_dtype)
    if matmul_precision not in ("highest", "as-set"):
        raise ValueError(
            f"matmul_precision must be 'highest' or 'as-set', got {matmul_precision!r}"
        )
    # a half-precision model: float32 where the perturbation lives, the rest as it is
    mixed = (
        _MixedPrecision.plan(model, named, named[0][1].dtype)
        if upcast and target.shards is None and autocast_dtype is None
        else None
    )
    settings["precision"] = (
        f"{str(autocast_dtype).removeprefix('torch.')} autocast"
        if autocast_dtype is not None
        else (
            f"float32 in the perturbed modules, {str(mixed.half).removeprefix('torch.')} elsewhere"
            if mixed is not None
            else str(dtype).removeprefix("torch.")
        )
    )
    if entries is not None:
        settings["entries"] = {n: len(i) for n, i in entries.items()}

    # (batch index, value, unperturbed loss, trace, value of each start, where a
    # perturbed loss was not finite)
    records = []
    sharded, shown = None, rank == 0  # progress on one process
    if target.shards is not None:
        sharded = ShardedModel(model, named, target.local, layout, loss_fn)
        shown = torch.distributed.get_rank() == 0
        settings["sharded"] = torch.distributed.get_world_size()
    with (
        evaluation_mode(model),
        # no gradient for what is not perturbed (a sharded model keeps its flags)
        frozen_except(model, [n for n, _ in named])
        if sharded is None
        else contextlib.nullcontext(),
        _matmuls(device, matmul_precision, settings),
        _restoring(sharded, theta),
        contextlib.ExitStack() as stack,
    ):
        space = PerturbationSpace(
            theta, layout, pairs, geo, cache_scale=not low_memory, shards=target.shards
        )
        mask = None if entries is None else _entry_mask(space, layout, entries)
        if sharded is not None:
            evaluate = sharded.evaluate
            theta = layout.unflatten(theta)
        else:
            base = None
            if mixed is not None:
                base = mixed.base
                stack.enter_context(mixed.active())
            elif upcast:
                base = _float32_copies(model, named)
            evaluate = functional_loss(model, loss_fn, base)
        n_batches = total if max_batches is None or total is None else min(total, max_batches)
        mine = None if n_batches is None else -(-n_batches // world)  # this rank's share
        steps = Progress(
            total=None if mine is None else mine * _evaluations(estimator),
            desc=f"{geo.name} rho={rho:g}",
            unit="step",
            enabled=progress and shown,
        )
        if steps.enabled:
            callback = _counting(steps, callback)
        with steps:  # the bar is cleared even when a batch raises
            for index, batch in _limited(batches, max_batches, False, geo.name, total):
                if index % world != rank:
                    continue
                generator = torch.Generator(device=device).manual_seed(_batch_seed(seed, index))
                with autocast():
                    loss0 = evaluate(theta, batch)
                loss0 = _checked_loss(loss0, "unperturbed")
                if autocast_dtype is not None:  # what the precision does to the loss itself
                    with torch.no_grad():
                        floor = abs(loss0 - float(evaluate(theta, batch)))
                else:
                    # the rest of a half-precision model computes in its own precision
                    floor = torch.finfo(mixed.half if mixed else dtype).eps * abs(loss0)

                trace, per_start, broken = None, [], []
                if worst:
                    objective = (
                        _LossGrad(evaluate, layout, batch, autocast, mask)
                        if sharded is None
                        else sharded.loss_grad(batch, autocast)
                    )
                    best = -math.inf
                    n_starts, first_random = estimator.runs
                    for start in range(n_starts):
                        xi0 = None
                        if start > 0 or first_random:
                            xi0 = _scale_to(space, _masked(space.random(generator), mask), rho)
                        value, _, run = auto_pgd(
                            objective,
                            space,
                            rho,
                            estimator.n_iters,
                            xi0,
                            callback=callback,
                            low_memory=low_memory,
                        )
                        per_start.append(float(value) - loss0)
                        if float(value) > best:
                            best, trace = float(value), run
                        step = next(
                            (i for i, v in enumerate(run.losses) if not math.isfinite(v)), None
                        )
                        if step is not None:
                            where = f"batch {index}" + (f", start {start}" if n_starts > 1 else "")
                            broken.append(f"{where}, Auto-PGD step {step}: loss {run.losses[step]}")
                            per_start[-1] = math.inf
                    del objective
                    value = math.inf if broken else best - loss0
                else:
                    summed = 0.0
                    point = space.empty()
                    with torch.no_grad(), autocast():
                        for sample in range(estimator.n_samples):
                            xi = _scale_to(space, _masked(space.random(generator), mask), rho)
                            space.retr_(xi, point)
                            loss = float(evaluate(layout.unflatten(point), batch))
                            steps.update()
                            if not math.isfinite(loss):
                                broken.append(f"batch {index}, direction {sample}: loss {loss}")
                            summed += loss
                    del point
                    value = summed / estimator.n_samples - loss0
                    if not math.isfinite(value):
                        value = math.inf
                records.append((index, value, loss0, trace, per_start, broken, floor))
                if broken and nonfinite == "error" and not distributed:
                    _nonfinite_error(label, rho, broken)

    if distributed:
        from ..distributed import gather_in_order

        records = gather_in_order(records)
    broken = [where for r in records for where in r[5]]
    if broken and nonfinite == "error":
        _nonfinite_error(label, rho, broken)
    values = [r[1] for r in records]
    losses = [r[2] for r in records]
    traces = [r[3] for r in records if r[3] is not None]
    per_batch_starts = [r[4] for r in records] if worst and estimator.runs[0] > 1 else []
    if not values:
        raise ValueError("no batches: `batches` yielded nothing to measure on")
    floor = sum(r[6] for r in records) / len(records)
    value = sum(values) / len(values)
    _check_floor(label, rho, value, floor, settings["precision"], strict)
    return SharpnessResult(
        value=value,
        per_batch=values,
        loss=sum(losses) / len(losses),
        per_batch_loss=losses,
        geometry=label,
        kind=estimator.kind,
        rho=rho,
        settings=settings,
        traces=traces,
        per_batch_starts=per_batch_starts,
        symmetry=report,
        nonfinite=broken,
        floor=floor,
    )


def _per_block(per: str, arguments: dict) -> BlockSharpness:
    """:func:`sharpness` of each block of :func:`parameter_blocks` with the rest fixed."""
    import inspect

    names = set(inspect.signature(sharpness).parameters) - {"per", "flat"}
    if arguments["entries"] is not None:
        raise ValueError("per measures blocks of its own: drop entries=")
    args = {k: v for k, v in arguments.items() if k in names}
    args.update(arguments["flat"])
    if per not in PER:
        raise ValueError(f"per must be one of {', '.join(map(repr, PER))}, got {per!r}")
    if args["parameters"] is not None:
        raise ValueError("per measures every block of parameters: drop parameters=")
    _, subset = _geometry(args["measure"], {k: args[k] for k in _GEOMETRY_KEYS if k in args}, None)
    if subset is not None:
        raise ValueError(f"per measures every block: use {args['measure']!r} without '-attn'")
    check_model(args["model"])
    if is_sharded(args["model"]):
        raise UsageError(
            "per= is not available on a sharded model: measure the blocks one by one with "
            "parameters=[...] (or per= on the unsharded model)"
        )
    batches, _, first = _peeked(args["batches"])
    args["batches"] = list(batches)  # read once per block
    if args["symmetries"] is None:  # the same blocks for every measure
        args["symmetries"] = find_symmetries(
            args["model"], first, loss_fn=args["loss_fn"], warn=False
        )
    pairs = args["symmetries"].pairs
    if per == "head":
        heads = head_entries(pairs)
        if not heads:
            raise ValueError("per='head': no attention pairs were found, so there are no heads")
        out = BlockSharpness(per, parameters={n: list(e) for n, e in heads.items()})
        for name, entries in heads.items():
            out.blocks[name] = sharpness(**{**args, "entries": entries})
        return out
    groups = parameter_blocks(args["model"], per, pairs)
    out = BlockSharpness(per, parameters=groups)
    for name, names in groups.items():
        out.blocks[name] = sharpness(**{**args, "parameters": names})
    return out


def _evaluations(estimator) -> int:
    """Forward(+backward) passes per batch: each Auto-PGD start takes ``n_iters + 1``."""
    if estimator.kind == "worst":
        return estimator.runs[0] * (estimator.n_iters + 1)
    return estimator.n_samples


def _counting(steps: Progress, callback):
    """An Auto-PGD callback that counts each evaluation on ``steps``, then calls
    ``callback`` (if any)."""

    def count(event: str, i: int, iterate) -> None:
        if event == "evaluated":
            steps.update()
        if callback is not None:
            callback(event, i, iterate)

    return count


@contextlib.contextmanager
def _restoring(sharded: ShardedModel | None, theta):
    """Write ``theta`` back into a sharded model's shards at the end, also on error."""
    try:
        yield
    finally:
        if sharded is not None:
            sharded.restore(theta)


@contextlib.contextmanager
def _matmuls(device: torch.device, precision: str, settings: dict):
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


def floor_message(label: str, rho: float, value: float, floor: float, precision: str):
    """What to say of a ``value`` within 10x of the loss's round-off ``floor`` (``None``
    when it is not)."""
    if not (math.isfinite(value) and floor > 0 and abs(value) < 10 * floor):
        return None
    return (
        f"{label} at rho={rho:g} is {value:.3g}, within 10x of the round-off floor of the loss "
        f"in {precision} ({floor:.2g}): the perturbation is near what this precision can see; "
        + (
            "measure in float32 (no autocast) or with a larger rho"
            if "autocast" in precision
            else "measure in float64 or with a larger rho"
        )
    )


def _check_floor(label: str, rho: float, value: float, floor: float, precision: str, strict: bool):
    """Warn (``strict``: raise) when ``value`` is within 10x of the loss's round-off floor."""
    message = floor_message(label, rho, value, floor, precision)
    if message is None:
        return
    if strict:
        raise UsageError(message)
    warnings.warn(message, PrecisionWarning, stacklevel=4)


def _nonfinite_error(label: str, rho: float, broken: list[str]) -> None:
    raise FloatingPointError(
        f"{label} at rho={rho:g}: a perturbed loss is not finite ({broken[0]}): the radius "
        "reaches where the model breaks down and the value is no finite number; lower rho, "
        "or report it as inf (nonfinite='inf')"
    )


def _peeked(batches: Iterable) -> tuple[Iterable, int | None, object]:
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


def _symmetry_report(target: _Target, geo: Geometry) -> dict:
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


def _say_ignored(symmetries: Symmetries, label: str, strict: bool) -> None:
    """Warn (or, ``strict``, raise) when a geodesic measure would treat attention
    modules element-wise because their symmetry was not understood."""
    ignored, unverified = symmetries.ignored, symmetries.unverified
    if not ignored and not unverified:
        return
    if ignored:
        first, drops = next(iter(ignored.items()))
        drop = drops[0]
        reason = drop.reason if drop.kind == "all" else f"{drop.kind}: {drop.reason}"
        message = (
            f"{label}: {len(ignored)} module{'s' * (len(ignored) != 1)} measured "
            f"element-wise because geosharp does not understand their symmetry "
            f"({first or '<root>'}: {reason})"
        )
    else:
        message = (
            f"{label}: {len(unverified)} pair block{'s' * (len(unverified) != 1)} used without "
            f"a numerical check on the model ({unverified[0]}): pass symmetries found with a "
            "batch, find_symmetries(model, batch, loss_fn=...)"
        )
    message += (
        "; the value is not symmetry-correct there (see result.symmetry, "
        "find_symmetries(model).summary())"
    )
    if strict:
        raise ValueError(message + "; strict=True")
    warnings.warn(message, SymmetryWarning, stacklevel=4)  # the caller of sharpness()


def _label(geo: Geometry) -> str:
    """The geometry's name in the measure table ("geodesic-inv", "adaptive-linf", ...)."""
    return geo.name if geo.p == 2 else f"{geo.name}-linf"


@dataclass
class _Target:
    """What a measure works on: the perturbed parameters, their pairs and layout, and
    ``theta``, the model's own tensors in the measure's dtype (read, never written;
    copies only where the dtype differs: half precision is measured in float32)."""

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


def _target(
    model: nn.Module,
    geo: Geometry,
    parameters: Sequence[str] | str | None,
    symmetries: Symmetries | None,
    probe: tuple[object, LossFunction] | None = None,
    strict: bool = False,
    unsupported: tuple = (None, False),
) -> _Target:
    """The perturbed parameters and their pairs. Without ``symmetries``, they are found
    (:func:`find_symmetries`, on ``probe = (batch, loss_fn)`` when given) only where the
    measure uses pairs: its geometry has a pair factor, or ``parameters="pairs"``. A
    geometry with a pair factor on a model whose attention symmetry is partly not
    understood warns once (``strict``: raises). A sharded model (FSDP2) gives this
    process's slices (:mod:`geosharp.fsdp`); ``unsupported = (entries, distributed)``
    are refused there."""
    check_model(model)
    pairs_only = isinstance(parameters, str) and parameters == "pairs"
    sharded = is_sharded(model)
    if sharded:
        reshard(model)
        if symmetries is None:
            symmetries = symmetries_of(model)
    if symmetries is None and (geo.metric is not None or pairs_only):
        if sharded:
            raise UsageError(
                "a sharded model's symmetries are found before sharding: pass "
                "symmetries=geosharp.find_symmetries(model, batch, loss_fn=...) found on the "
                "unsharded model, or shard it with geosharp.fsdp.shard(model, symmetries)"
            )
        if probe is not None:
            batch, loss_fn = probe
            symmetries = find_symmetries(model, batch, loss_fn=loss_fn, warn=False)
        else:
            symmetries = find_symmetries(model, warn=False)
    if pairs_only:
        parameters = _pair_parameters(model, symmetries)
    named = _perturbed_parameters(model, parameters)
    pairs = (
        symmetries.restrict([n for n, _ in named]).pairs
        if geo.metric is not None and symmetries is not None
        else []
    )
    dtype = functools.reduce(torch.promote_types, (t.dtype for _, t in named))
    if geo.metric is not None and symmetries is not None:
        _say_ignored(symmetries, _label(geo), strict)
    if sharded:  # theta: a flat copy of this process's slices (the model holds the point)
        check_shardable(dtype, *unsupported)
        shards, local = local_shards(named)
        theta = torch.cat([t.detach().reshape(-1) for t in local])
        device = local[0].device
        return _Target(
            named, pairs, shards.local, dtype, False, theta, device, symmetries, shards, local
        )
    upcast = dtype in (torch.float16, torch.bfloat16)
    if upcast:
        dtype = torch.float32
    theta = {n: t.detach().to(dtype) for n, t in named}
    return _Target(
        named,
        pairs,
        ParameterLayout.from_named(named),
        dtype,
        upcast,
        theta,
        named[0][1].device,
        symmetries,
    )


def _checked_rho(rho: object) -> float:
    number = real_number(rho, "rho")
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"rho must be a positive finite number, got {rho!r}")
    return number


def _estimator(estimator: Estimator | None, flat: dict) -> Estimator:
    if estimator is None:
        return estimator_from(**flat)
    if flat:
        raise ValueError(
            f"pass the estimator or {', '.join(sorted(flat))}, not both: e.g. "
            "estimator=WorstCase(n_iters=50, starts=3)"
        )
    if not isinstance(estimator, (WorstCase, AverageCase)):
        raise TypeError(f"estimator must be WorstCase(...) or AverageCase(...), got {estimator!r}")
    return estimator


def _geometry(
    measure: str | Geometry | None, flat: dict, parameters: Sequence[str] | str | None
) -> tuple[Geometry, Sequence[str] | str | None]:
    """The geometry that ``measure`` and the flat geometry keywords describe, and the
    parameters to perturb (a ``*-attn`` measure restricts them to the pairs)."""
    from .catalog import measure_kwargs

    if isinstance(measure, Geometry):
        if flat:
            raise ValueError(
                f"measure is a Geometry: set {', '.join(sorted(flat))} in "
                "Geometry.named(...) instead"
            )
        return measure, parameters
    if measure is None:
        spec = {"geometry": "geodesic", "metric": "inv", **flat}
    else:
        if not isinstance(measure, str):
            raise TypeError(f"measure must be a name or a Geometry, got {measure!r}")
        clash = sorted({"geometry", "metric", "p"} & set(flat))
        if clash:
            raise ValueError(
                f"measure={measure!r} already sets the geometry: drop {', '.join(clash)}"
            )
        spec = {**measure_kwargs(measure), **flat}
        parameters = spec.pop("parameters", parameters)
    return Geometry.named(spec.pop("geometry"), **spec), parameters


def _pair_parameters(model: nn.Module, symmetries: Symmetries) -> list[str]:
    """The names of the parameters in ``symmetries``' pairs, in the model's order."""
    in_pairs = {n for pair in symmetries.pairs for n in pair.params}
    names = [n for n, _ in model.named_parameters() if n in in_pairs]
    if not names:
        raise ValueError(
            "parameters='pairs': no symmetric pairs were found in the model "
            "(see geosharp.find_symmetries(model).summary())"
        )
    return names


def _perturbed_parameters(
    model: nn.Module, names: Sequence[str] | None
) -> list[tuple[str, Tensor]]:
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


def _limited(
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
        yield i, batch


def _checked_loss(loss: object, where: str) -> float:
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


class _LossGrad:
    """Loss and gradient at a perturbed point for Auto-PGD, without parameter-sized
    temporaries: views of the point are swapped into the model as leaves, and each
    leaf's gradient is copied into its view of the output buffer as soon as backward
    has accumulated it, then freed. Backward frees activations as it goes, so a buffer
    whose pages are first written here (a new one, on the CPU) costs no more memory than
    the gradients of a training step."""

    def __init__(self, evaluate, layout: ParameterLayout, batch, autocast, mask=None):
        self.evaluate, self.layout = evaluate, layout
        self.batch, self.autocast, self.mask = batch, autocast, mask

    def __call__(self, point: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
        leaves, targets, filled = {}, {}, set()

        def hook(leaf: Tensor) -> None:
            targets[id(leaf)].copy_(leaf.grad)
            leaf.grad = None
            filled.add(id(leaf))

        for (name, view), target in zip(
            self.layout.unflatten(point).items(), self.layout.unflatten(out).values()
        ):
            leaf = view.detach().requires_grad_(True)
            leaf.register_post_accumulate_grad_hook(hook)
            targets[id(leaf)] = target
            leaves[name] = leaf
        # forward and backward with the point swapped in: a backward through activation
        # checkpointing recomputes the forward, which must see the point too
        holding = getattr(self.evaluate, "holding", None)
        with holding(leaves) if holding is not None else contextlib.nullcontext():
            with self.autocast():
                if holding is not None:
                    loss = self.evaluate.loss(self.batch)
                else:
                    loss = self.evaluate(leaves, self.batch)
            loss = scalar_loss(loss)
            require_grad(loss)
            with checkpoint_errors():
                loss.backward(inputs=list(leaves.values()))
        for leaf in leaves.values():  # parameters the loss does not reach
            if id(leaf) not in filled:
                targets[id(leaf)].zero_()
        if self.mask is not None:  # the entries measured; the rest stay fixed
            out.mul_(self.mask)
        return _value(loss), out


def _float32_copies(model: nn.Module, perturbed: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """float32 copies of the model's half-precision parameters and buffers that are not
    perturbed, swapped in beside the float32 perturbed point."""
    skip = {n for n, _ in perturbed}
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {
        n: t.detach().float()
        for n, t in tensors
        if n not in skip and t.dtype in (torch.float16, torch.bfloat16)
    }


@dataclass
class _MixedPrecision:
    """A half-precision model measured with float32 only where the perturbation lives:
    the modules that own perturbed parameters compute in float32 (their other
    parameters and buffers as float32 copies, ``base``; their floating inputs cast up,
    their outputs cast back to ``half``); the rest of the model computes in ``half``
    on its own weights. Possible where every such module is a leaf (holds no
    submodules): a ``Linear``, an ``Embedding``, a norm."""

    owners: list[nn.Module]
    base: dict[str, Tensor]
    half: torch.dtype

    @classmethod
    def plan(cls, model: nn.Module, perturbed: list[tuple[str, Tensor]], half):
        modules = dict(model.named_modules(remove_duplicate=False))
        ids = {id(t) for _, t in perturbed}
        # every module that holds a perturbed parameter, under any of its names (a tied
        # embedding and output head)
        names = {n for p, all_names in aliases(model) if id(p) in ids for n in all_names}
        owners = list(dict.fromkeys(n.rsplit(".", 1)[0] if "." in n else "" for n in names))
        if any(next(modules[o].children(), None) is not None for o in owners):
            return None  # a module with submodules: the whole model in float32 instead
        base = {}
        for owner in owners:
            prefix = f"{owner}." if owner else ""
            module = modules[owner]
            for local, t in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]:
                if prefix + local not in names and t.dtype == half:
                    base[prefix + local] = t.detach().float()
        return cls(list({id(m): m for m in (modules[o] for o in owners)}.values()), base, half)

    @contextlib.contextmanager
    def active(self):
        half = self.half

        def up(x):
            return x.float() if isinstance(x, Tensor) and x.dtype == half else x

        def down(x):
            return x.to(half) if isinstance(x, Tensor) and x.dtype == torch.float32 else x

        def before(_module, args, kwargs):
            return tree_map(up, args), tree_map(up, kwargs)

        def after(_module, _args, output):
            return tree_map(down, output)

        handles = []
        try:
            for module in self.owners:
                handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
                handles.append(module.register_forward_hook(after))
            yield
        finally:
            for handle in handles:
                handle.remove()


def _value(loss: Tensor) -> Tensor:
    value = loss.detach()
    return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def _process_group(distributed: bool) -> tuple[int, int]:
    if not distributed:
        return 0, 1
    from ..distributed import rank_and_world

    return rank_and_world(require=True)


def _batch_seed(seed: int, index: int) -> int:
    """``seed`` for the first batch, a splitmix64 mix of ``(seed, index)`` after."""
    if index == 0:
        return seed
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + index) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) >> 1


def _entry_mask(space: PerturbationSpace, layout: ParameterLayout, entries) -> Tensor:
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


def _masked(xi: Tensor, mask: Tensor | None) -> Tensor:
    return xi if mask is None else xi.mul_(mask)


def _scale_to(space: PerturbationSpace, xi: Tensor, rho: float) -> Tensor:
    return xi.mul_((rho / space.norm(xi).clamp_min(1e-30)).to(xi.dtype))
