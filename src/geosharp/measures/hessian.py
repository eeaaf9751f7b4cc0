r"""``hessian_trace``: the trace of the loss's Hessian in a measure's geometry.

Along the perturbation path of a measure's geometry (:mod:`geosharp.geometry.space`),
``gamma_{t xi}(1) = theta + t xi + t^2/2 a(xi) + O(t^3)``, the loss bends as

.. math::

    \operatorname{Hess} f(\xi, \xi) = \frac{d^2}{dt^2} f(\gamma_{t\xi}(1))\Big|_{t=0}
    = \xi^\top \nabla^2 f\, \xi + \langle \nabla f, a(\xi) \rangle .

For the geodesic measures ``a`` is the geodesic acceleration of the pair metric, so on
horizontal ``xi`` this is the Riemannian Hessian of the loss on the quotient (the
Christoffel term is ``<grad f, a>``); for adaptive (straight step, ``c = |theta|``) it
is ``xi^T H xi`` in the metric ``sum (xi_j / c_j)^2``, for Euclidean the plain Hessian.
Its trace over a metric-orthonormal basis of the (horizontal) tangent space is
estimated by Hutchinson's method,

.. math::

    \operatorname{tr} \operatorname{Hess} f = \mathbb{E}_z\, \operatorname{Hess} f(z, z),
    \qquad z \sim \mathcal{N}(0, G^{-1}) \text{ projected onto the horizontal space},

with the probes of :meth:`~geosharp.geometry.PerturbationSpace.random`, drawn
equivariantly: networks related by a symmetry get related probes, so the geodesic
estimate is invariant probe by probe, not only in expectation. Hessian-vector products
use double backward: ``torch.nn.functional.scaled_dot_product_attention`` runs with its
math backend inside (the fused kernels have no double backward), which covers
``nn.MultiheadAttention`` and Hugging Face's ``"sdpa"`` and ``"eager"`` attention;
other fused kernels (flash-attention packages) must be switched off by the user.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import UsageError
from ..geometry.space import Geometry, PerturbationSpace
from ..io import dumps
from ..params import (
    LossFunction,
    checkpoint_errors,
    evaluation_mode,
    frozen_except,
    grad_owned,
    keeping_tensors,
)
from ..symmetry.pairs import Symmetries
from .backends import choose_backend
from .fsdp import is_sharded
from .problem import (
    batch_seed,
    checked_loss,
    find_target,
    geometry_of,
    label_of,
    numbered,
    peek,
    refuse_legacy,
)

__all__ = ["HessianTraceResult", "hessian_trace"]


@dataclass
class HessianTraceResult:
    """A Hutchinson estimate of the Hessian's trace in one geometry.

    ``value`` is the mean over probes of ``Hess f(z, z)`` for the mean loss over the
    batches, ``stderr`` its standard error (standard deviation over probes divided by
    the square root of their number), ``per_probe`` each probe's value, ``loss`` the
    mean loss."""

    value: float
    stderr: float
    per_probe: list[float]
    loss: float
    geometry: str
    n_probes: int
    n_batches: int
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        """Strict JSON: a non-finite value is ``null`` (``nonfinite`` says why)."""
        return dumps(self.to_dict(), **{"indent": None, **kwargs})

    def __str__(self) -> str:
        return (
            f"Hessian trace ({self.geometry}) = {self.value:.6g} +- {self.stderr:.2g} "
            f"({self.n_probes} probes, {self.n_batches} batches)"
        )


@grad_owned  # also under the caller's no_grad() or inference_mode()
@keeping_tensors
def hessian_trace(
    model: nn.Module,
    batches: Iterable,
    loss_fn: LossFunction,
    measure: str | Geometry | None = None,
    n_probes: int = 100,
    *,
    probe_batch: int = 1,
    seed: int = 0,
    symmetries: Symmetries | None = None,
    parameters: Sequence[str] | str | None = None,
    max_batches: int | None = None,
    progress: bool = False,
    **legacy,
) -> HessianTraceResult:
    """Estimate the trace of the Hessian of the mean batch loss in ``measure``'s
    geometry, by ``n_probes`` Hutchinson probes.

    ``measure`` (a name or a :class:`~geosharp.geometry.Geometry`), ``parameters``,
    ``symmetries``, ``seed``, ``max_batches`` and ``progress`` are those of
    :func:`~geosharp.sharpness` (default: ``"geodesic-inv"``); the radius plays no role.
    Probe ``k`` is drawn from its own generator (seeded from ``seed`` and ``k``) and is
    the same for every batch. Each batch costs one forward, one backward with its graph
    kept, and one double-backward per probe, or per ``probe_batch`` probes: with
    ``probe_batch > 1`` the Hessian-vector products of that many probes come from one
    vectorised backward (``is_grads_batched``; memory: ``probe_batch`` parameter-sized
    vectors more), equal to the one-by-one values to round-off. The model is left bit-
    identical, also when this raises.

    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 1, bias=False))
    >>> x = torch.eye(3)
    >>> batches = [(x, torch.zeros(3, 1))]
    >>> mse = lambda m, b: (m(b[0]) - b[1]).pow(2).sum()  # Hessian 2 I
    >>> r = hessian_trace(net, batches, mse, "euclidean", n_probes=400)
    >>> abs(r.value - 6.0) < 3 * r.stderr  # tr(2 I) = 6
    True
    """
    refuse_legacy("hessian_trace", legacy)
    for key, value in (("n_probes", n_probes), ("probe_batch", probe_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    geo, parameters = geometry_of(measure, parameters)
    if geo.p != 2:
        raise ValueError("the Hessian trace needs a round ball (p=2), not the L-infinity box")
    batches, total, first = peek(batches)
    if is_sharded(model):
        raise UsageError(
            "hessian_trace needs a double backward, which torch does not support through "
            "FSDP2: compute it on the unsharded model"
        )
    target = find_target(model, geo, parameters, symmetries, probe=(first, loss_fn))
    layout, theta = target.layout, target.theta
    sums = torch.zeros(n_probes, dtype=torch.float64)
    losses = []
    with (
        evaluation_mode(model),
        frozen_except(model, [n for n, _ in target.named]),
        sdpa_kernel(SDPBackend.MATH),
    ):
        space = PerturbationSpace(theta, layout, target.pairs, geo, dtype=target.dtype)
        # a double backward: a half-precision model whole in float32
        evaluate = choose_backend(model, target, loss_fn, first, owners=False).evaluate
        for index, batch in numbered(batches, max_batches, progress, "hessian trace", total):
            del index
            params = {n: t.detach().to(target.dtype).requires_grad_() for n, t in theta.items()}
            # the Hessian-vector products differentiate through the forward: under
            # activation checkpointing it is recomputed then, with the same parameters
            with evaluate.holding(params):
                leaves = list(params.values())
                with checkpoint_errors() as checkpoints:
                    loss = evaluate.loss(batch)
                    grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
                checkpoints.refuse_unreached([n for n, g in zip(params, grads) if g is None])
                losses.append(checked_loss(loss, "unperturbed"))
                if all(g is None for g in grads):
                    raise ValueError("the loss does not depend on the parameters to measure")
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
                # the Christoffel term <grad f, a(z)>; a = 0 on a straight step
                flat_grad = None
                if not space.geometry.straight:
                    flat_grad = torch.cat([g.detach().reshape(-1) for g in grads])
                curved = [(n, g, p) for (n, p), g in zip(params.items(), grads) if g.requires_grad]
                for start in range(0, n_probes, probe_batch):
                    ks = range(start, min(n_probes, start + probe_batch))
                    zs = []
                    for k in ks:
                        generator = torch.Generator(device=target.device)
                        zs.append(space.random(generator.manual_seed(batch_seed(seed, k))))
                    views = [layout.unflatten(z) for z in zs]
                    totals = [0.0] * len(zs)
                    if flat_grad is not None:
                        totals = [float(space.dot(flat_grad, space.acceleration(z))) for z in zs]
                    if curved:  # else the loss is linear in the parameters
                        hzs = _hessian_vector_products(curved, views, retain=ks[-1] + 1 < n_probes)
                        for j, hz in enumerate(hzs):
                            for (n, *_), h in zip(curved, hz):
                                if h is not None:
                                    v = views[j][n].reshape(-1)
                                    totals[j] += float(space.dot(h.reshape(-1), v))
                    for k, total in zip(ks, totals):
                        sums[k] += total
                del grads, flat_grad, curved
    if not losses:
        raise ValueError("no batches: `batches` yielded nothing to measure on")
    per_probe = (sums / len(losses)).tolist()
    mean = sum(per_probe) / n_probes
    if n_probes > 1:
        var = sum((v - mean) ** 2 for v in per_probe) / (n_probes - 1)
        stderr = math.sqrt(var / n_probes)
    else:
        stderr = float("nan")
    return HessianTraceResult(
        value=mean,
        stderr=stderr,
        per_probe=per_probe,
        loss=sum(losses) / len(losses),
        geometry=label_of(geo),
        n_probes=n_probes,
        n_batches=len(losses),
        settings=dict(
            metric=geo.metric.name if geo.metric is not None else None,
            seed=seed,
            elementwise_step="exp" if geo.exp_elementwise else "straight",
            n_pairs=len(target.pairs),
            dtype=str(target.dtype).removeprefix("torch."),
        ),
    )


def _hessian_vector_products(curved, views, retain: bool) -> list:
    """``H v`` per probe's views ``{name: tensor}``, restricted to the ``curved``
    ``(name, gradient with graph, leaf)``: one double backward for one probe, one
    vectorised backward (``is_grads_batched``) for several."""
    leaves = [p for *_, p in curved]
    if len(views) == 1:
        directional = sum((g * views[0][n]).sum() for n, g, _ in curved)
        return [torch.autograd.grad(directional, leaves, retain_graph=retain, allow_unused=True)]
    stacked = [torch.stack([v[n] for v in views]) for n, *_ in curved]
    out = torch.autograd.grad(
        [g for _, g, _ in curved],
        leaves,
        grad_outputs=stacked,
        retain_graph=retain,
        is_grads_batched=True,
        allow_unused=True,
    )
    return [[None if h is None else h[j] for h in out] for j in range(len(views))]
