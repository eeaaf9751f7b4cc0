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

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..geometry.space import Geometry, PerturbationSpace
from ..params import LossFunction, ParameterLayout, evaluation_mode, functional_loss
from ..symmetry.discovery import find_symmetries
from ..symmetry.pairs import Symmetries
from .apgd import APGDTrace, auto_pgd

__all__ = ["SharpnessResult", "sharpness"]


@dataclass
class SharpnessResult:
    """Sharpness of a model on a set of batches.

    ``value`` is the mean over batches of (best or mean perturbed loss minus the
    unperturbed loss); ``per_batch`` holds each batch's value, ``loss`` the mean
    unperturbed loss, ``traces`` the Auto-PGD trace of each batch (worst case).
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

    def to_dict(self) -> dict:
        out = asdict(self)
        out["traces"] = [t.to_dict() for t in self.traces]
        return out

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        return (
            f"{self.kind}-case {self.geometry} sharpness (rho={self.rho:g}): {self.value:.6g} "
            f"over {len(self.per_batch)} batch(es); unperturbed loss {self.loss:.6g}"
        )


def sharpness(
    model: nn.Module,
    batches: Iterable,
    loss_fn: LossFunction,
    geometry: str = "geodesic",
    metric: str = "inv",
    rho: float = 0.1,
    kind: str = "worst",
    n_iters: int = 20,
    n_samples: int = 10,
    seed: int = 0,
    random_start: bool = False,
    eps: float = 0.0,
    p: float = 2.0,
    elementwise_step: str = "straight",
    symmetries: Symmetries | None = None,
    parameters: Sequence[str] | None = None,
    max_batches: int | None = None,
    progress: bool = False,
) -> SharpnessResult:
    """Measure the sharpness of ``model`` on ``batches``.

    Args:
        model: any ``nn.Module``; it is put in eval mode for the measure and left
            bit-identical afterwards (flags restored, tensors never written), also
            when this function raises.
        batches: an iterable of batches (a ``DataLoader``, a list, ...).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor``; call the model inside it
            (so dict inputs of Hugging Face models work).
        geometry: ``"euclidean"``, ``"adaptive"``, ``"geodesic"``,
            ``"geodesic-norm-only"`` or ``"geodesic-curvature-only"``.
        metric: pair metric of the geodesic geometries, ``"inv"`` or ``"mix"``.
        rho: radius of the ball (relative for adaptive/``inv``, absolute for ``mix``
            and Euclidean).
        kind: ``"worst"`` (Auto-PGD) or ``"average"`` (random directions).
        n_iters: Auto-PGD steps per batch (worst case).
        n_samples: random directions per batch (average case).
        seed: seed of a private generator (random start, average case); global RNG
            state is not touched.
        random_start: start Auto-PGD from a random vector of norm ``rho`` (else 0).
        eps: relaxation ``P + eps I`` of the ``inv`` metric.
        p: 2, or ``float('inf')`` for the L-infinity adaptive sharpness of
            Andriushchenko et al. (2023).
        elementwise_step: ``"straight"`` (``theta + xi``) or ``"exp"`` (exact GL(1)
            geodesic ``theta exp(xi / theta)``) for element-wise parameters.
        symmetries: the model's symmetries (default: :func:`find_symmetries`).
        parameters: names of the parameters to perturb (default: all that require
            grad). Pairs with a parameter outside this set are not used.
        max_batches: use at most this many batches.
        progress: show a progress bar over batches.
    """
    _check_arguments(rho, kind, n_iters, n_samples)
    geo = Geometry.named(geometry, metric=metric, eps=eps, p=p, elementwise_step=elementwise_step)
    named = _perturbed_parameters(model, parameters)
    if symmetries is None:
        symmetries = find_symmetries(model)
    pairs = symmetries.restrict([n for n, _ in named]).pairs if geo.metric is not None else []
    layout = ParameterLayout.from_named(named)
    theta = layout.flatten({n: t.detach() for n, t in named})
    generator = torch.Generator(device=theta.device).manual_seed(seed)
    settings = dict(
        metric=metric if geo.metric is not None else None,
        n_iters=n_iters,
        n_samples=n_samples,
        seed=seed,
        random_start=random_start,
        eps=eps,
        p=p,
        elementwise_step=elementwise_step,
        n_pairs=len(pairs),
    )

    with evaluation_mode(model):
        space = PerturbationSpace(theta, layout, pairs, geo)
        evaluate = functional_loss(model, loss_fn)
        values, losses, traces = [], [], []
        for batch in _limited(batches, max_batches, progress, geo.name):
            loss0 = _checked_loss(evaluate(layout.unflatten(theta), batch), "unperturbed")

            if kind == "worst":
                xi0 = None
                if random_start:
                    xi0 = _scale_to(space, space.random(generator), rho)
                best, _, trace = auto_pgd(
                    _objective(space, evaluate, layout, batch), space, rho, n_iters, xi0
                )
                if not all(math.isfinite(v) for v in trace.losses):
                    warnings.warn(
                        f"non-finite perturbed loss during Auto-PGD ({geo.name}, rho={rho:g}): "
                        "rho is probably too large",
                        stacklevel=2,
                    )
                traces.append(trace)
                value = float(best) - loss0
            else:
                total = 0.0
                with torch.no_grad():
                    for _ in range(n_samples):
                        xi = _scale_to(space, space.random(generator), rho)
                        total += float(evaluate(layout.unflatten(space.retr(xi)), batch))
                value = total / n_samples - loss0
            values.append(value)
            losses.append(loss0)

    if not values:
        raise ValueError("no batches: `batches` yielded nothing to measure on")
    return SharpnessResult(
        value=sum(values) / len(values),
        per_batch=values,
        loss=sum(losses) / len(losses),
        per_batch_loss=losses,
        geometry=geo.name if p == 2 else f"{geo.name}-linf",
        kind=kind,
        rho=rho,
        settings=settings,
        traces=traces,
    )


def _check_arguments(rho: float, kind: str, n_iters: int, n_samples: int) -> None:
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a positive finite number, got {rho!r}")
    if kind not in ("worst", "average"):
        raise ValueError(f"kind must be 'worst' or 'average', got {kind!r}")
    if n_iters < 1:
        raise ValueError(f"n_iters must be at least 1, got {n_iters}")
    if n_samples < 1:
        raise ValueError(f"n_samples must be at least 1, got {n_samples}")


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
    known = dict(named)
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"unknown parameter names: {missing}; see model.named_parameters()")
    return [(n, known[n]) for n in names]


def _limited(batches: Iterable, limit: int | None, progress: bool, label: str):
    if isinstance(batches, (Tensor, dict)):
        raise TypeError(
            "`batches` must be an iterable of batches (e.g. a DataLoader or a list); "
            "wrap a single batch in a list: [batch]"
        )
    iterator = iter(batches)
    if progress:
        from tqdm.auto import tqdm

        total = limit
        if total is None and hasattr(batches, "__len__"):
            total = len(batches)  # type: ignore[arg-type]
        bar = tqdm(iterator, total=total, desc=label, unit="batch", leave=False, disable=None)
        iterator = iter(bar)
    for i, batch in enumerate(iterator):
        if limit is not None and i >= limit:
            break
        yield batch


def _checked_loss(loss: object, where: str) -> float:
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"loss_fn must return a scalar, got shape {tuple(loss.shape)}; "
            "reduce it, e.g. with .mean()"
        )
    value = float(loss)
    if not math.isfinite(value):
        raise FloatingPointError(f"the {where} loss is {value}: check the model and the data")
    return value


def _objective(space: PerturbationSpace, evaluate, layout: ParameterLayout, batch):
    def objective(xi: Tensor) -> tuple[Tensor, Tensor]:
        xi = xi.detach().requires_grad_(True)
        loss = evaluate(layout.unflatten(space.retr(xi)), batch)
        if loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar")
        (grad,) = torch.autograd.grad(loss.reshape(()), xi)
        return loss.detach().reshape(()), grad

    return objective


def _scale_to(space: PerturbationSpace, xi: Tensor, rho: float) -> Tensor:
    return xi * (rho / space.norm(xi).clamp_min(1e-30)).to(xi.dtype)
