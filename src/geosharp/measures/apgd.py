"""Auto-PGD (Croce & Hein 2020) on a tangent vector, as in the paper's Algorithm 1.

Maximises ``f(xi)`` over the ball ``||xi|| <= rho`` of a
:class:`~geosharp.geometry.PerturbationSpace` (MATH.md section 6):

1. start at ``xi0`` (0 or a random vector of norm ``rho``);
2. ``z = Pi(xi + eta d)`` with ``d`` the normalised, horizontal Riemannian gradient
   (L2) or the scaled sign of the gradient (L-infinity);
3. ``xi <- Pi(xi + a (z - xi) + (1 - a)(xi - xi_prev))``, momentum ``a = 0.75``
   (``a = 1`` on the first step), ``Pi`` the ball projection followed by the
   horizontal projection;
4. ``eta = 2 rho``, halved at the checkpoints ``p_0 = 0, p_1 = 0.22,
   p_{j+1} = p_j + max(p_j - p_{j-1} - 0.03, 0.06)`` when fewer than 75% of the steps
   since the last checkpoint increased the objective, or when the step size was not
   reduced at the last checkpoint and the best value has not changed since; a
   reduction restarts from the best point.

The loop makes ``n_iters + 1`` evaluations, each one forward and one backward (the
objective returns the loss and its gradient together), and reads from the device once
per checkpoint only. Its parameter-sized buffers are recycled, never allocated per
step: the point, whose gradient is written over it (one buffer for both, the training
step's own), the perturbation ``xi`` and its previous and best values; nothing small
is kept from one step to the next either (a retraction's ``h x h`` matrices would pin
the C heap under the next step's block temporaries). On the host the best value is
the iterate's own buffer while it is the best (kept from recycling until a better one
replaces it): no copy on an improving step. A half-precision model's straight step
keeps its gradient in bfloat16, as wide as the model's training step's, and the
iterate in its point's buffer instead (``grad_dtype``, :func:`gradient_dtype`): the
same three float32 vectors beside a gradient half as wide.

The best point's gradient is not kept: a restart that goes back to a best point other
than the current one evaluates it again, and that evaluation is the next iteration's
(no step is taken in it). The reference implementation keeps the gradient instead (one
parameter-sized vector more) and steps from the best point at once
(``keep_best_gradient=True``); here a restart away from the current point costs one
step of the budget instead of that vector (on the demo's ViT the values agreed within a
relative 3e-6, ``benchmarks/restart_budget.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..geometry.space import Geometry, PerturbationSpace, Retraction


class PointOverwritten(RuntimeError):
    """A gradient written over its point (``loss_grad(point, point)``) while backward
    could still read the point: :func:`auto_pgd` evaluates again with separate
    buffers."""


__all__ = [
    "RESTART",
    "APGDTrace",
    "Iterate",
    "PointOverwritten",
    "auto_pgd",
    "checkpoints",
    "gradient_dtype",
]

RESTART = "revisit"
"""How :func:`auto_pgd` restarts away from the current point (recorded in results): the
best point evaluated again in the next iteration, not stepped from with a kept gradient
(``"kept gradient"``, the reference's; that version's results did not record it)."""

# loss_grad(point, out) -> (loss at point, its gradient written into `out`)
LossGrad = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]

_HOST_DEVICES = ("cpu",)  # devices whose tensors the host reads without waiting


def checkpoints(n_iters: int) -> list[int]:
    """Iterations ``ceil(p_j n_iters)`` at which Auto-PGD may halve its step.

    >>> checkpoints(100)
    [22, 41, 57, 70, 80, 87, 93, 99]
    """
    p = [0.0, 0.22]
    while True:
        nxt = p[-1] + max(p[-1] - p[-2] - 0.03, 0.06)
        if nxt > 1:
            break
        p.append(nxt)
    out = sorted({math.ceil(round(q * n_iters, 9)) for q in p[1:]})
    return [w for w in out if 0 < w < n_iters]


@dataclass
class APGDTrace:
    """Per-step record: objective at each iterate, best so far, step size."""

    losses: list[float] = field(default_factory=list)
    best: list[float] = field(default_factory=list)
    step_sizes: list[float] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "losses": self.losses,
            "best": self.best,
            "step_sizes": self.step_sizes,
            "restarts": self.restarts,
        }


class _Buffers:
    """Parameter-sized buffers handed around instead of allocated (a new vector of
    hundreds of megabytes costs its page faults on every step)."""

    def __init__(self, space: PerturbationSpace):
        self.space, self.free = space, []

    def take(self) -> Tensor:
        return self.free.pop() if self.free else self.space.empty()

    def give(self, *tensors: Tensor) -> None:
        for t in tensors:
            if len(self.free) < 3 and all(t is not f for f in self.free):
                self.free.append(t)


class _L2Ball:
    r"""The metric ball. One step needs two dot products with the gradient and no norm
    of a new vector: with ``d`` the horizontal Riemannian gradient,

    .. math:: \langle \xi, d \rangle_g = \langle \xi, \nabla L \rangle, \qquad
              \|d\|_g^2 = \langle d, \nabla L \rangle

    (``xi`` horizontal), and the norms of ``z = xi + c d`` and of the momentum point
    ``alpha xi + beta d + gamma xi_prev`` follow from the Gram matrix of ``xi, d,
    xi_prev``, whose other entries are carried from step to step as 0-d tensors. A step
    reads the vectors twice, run by run (:meth:`PerturbationSpace.direction_`: the two dot
    products and ``||d||^2``; :meth:`PerturbationSpace.combine_`: the new ``xi`` and, for a
    straight element-wise step, its point ``theta + xi``), with no host synchronisation.
    """

    def __init__(self, space: PerturbationSpace, rho: float, held: bool = False):
        self.space, self.rho, self.held = space, rho, held

    def start(self, xi: Tensor | None) -> None:
        self.xx = torch.zeros((), dtype=torch.float64, device=self.space.device)
        if xi is not None:
            self.xx = self.space.inner(xi, xi)
        self.pp, self.xp = self.xx, self.xx  # xi_prev = xi

    def project_(self, xi: Tensor) -> Tensor:
        space = self.space
        shrink = (self.rho / space.norm(xi).clamp_min(1e-30)).clamp(max=1.0)
        return space.proju_(xi.mul_(shrink.to(xi.dtype)))

    def step_(
        self,
        step: Retraction,
        xi_prev: Tensor,
        grad: Tensor,
        eta: float,
        a: float,
        point: Tensor | None,
    ) -> tuple[Tensor, bool]:
        """Overwrite ``grad``, the Euclidean gradient at the point of ``step`` (the
        retraction of ``xi = step.xi``), with the next iterate (see :func:`auto_pgd`);
        where the space allows, write the element-wise entries of its point into
        ``point`` in the same pass (returned: whether it did). ``held``: ``grad`` is
        read only and the next iterate is written into ``point``, held as its point."""
        space, rho, xi = self.space, self.rho, step.xi
        same = xi_prev is xi
        if self.held:
            dd, dots = space.held_direction_(xi, grad, *(() if same else (xi_prev,)))
            xd, pd = dots[0], dots[-1]
        elif same:
            dd, (xd,) = space.ascent_(step, grad, xi)
            pd = xd
        else:
            dd, (xd, pd) = space.ascent_(step, grad, xi, xi_prev)
        c = eta / dd.clamp_min(0).sqrt().clamp_min(1e-30)  # z = xi + c d, d unnormalised
        zz = (self.xx + 2 * c * xd + c * c * dd).clamp_min(0)
        s1 = (rho / zz.sqrt().clamp_min(1e-30)).clamp(max=1.0)
        if a == 1.0:  # no momentum: the projected z
            alpha, beta, gamma = s1, s1 * c, None
            s2 = torch.ones_like(s1)
            nn = s1 * s1 * zz
        else:  # a P(z) + (1 - a)(2 xi - xi_prev), projected again
            alpha, beta, gamma = a * s1 + 2 * (1 - a), a * s1 * c, -(1 - a)
            nn = (
                alpha * alpha * self.xx
                + beta * beta * dd
                + gamma * gamma * self.pp
                + 2 * alpha * beta * xd
                + 2 * alpha * gamma * self.xp
                + 2 * beta * gamma * pd
            ).clamp_min(0)
            s2 = (rho / nn.sqrt().clamp_min(1e-30)).clamp(max=1.0)
            nn = s2 * s2 * nn
        new_x = s2 * (alpha * self.xx + beta * xd + (gamma * self.xp if gamma else 0.0))
        kx, kd = (s2 * alpha).to(xi.dtype), (s2 * beta).to(xi.dtype)
        kp = None if gamma is None or same else (s2 * gamma).to(xi.dtype)
        if gamma is not None and same:  # xi_prev is xi: fold it in
            kx = (s2 * (alpha + gamma)).to(xi.dtype)
        xp = None if same else xi_prev
        if self.held:
            out, written = space.held_combine_(grad, kd, xi, kx, xp, kp, point), True
        else:
            written = point is not None and space.fused_step
            out = space.combine_(grad, kd, xi, kx, xp, kp, point if written else None)
        self.xx, self.pp, self.xp = nn, self.xx, new_x
        return out, written

    def restart(self, norm_sq: Tensor) -> None:
        self.xx = self.pp = self.xp = norm_sq


class _Box:
    """The L-infinity box ``|xi_j| <= rho c_j`` (Andriushchenko et al. 2023)."""

    def __init__(self, space: PerturbationSpace, rho: float, held: bool = False):
        self.space, self.rho, self.held = space, rho, held

    def start(self, xi: Tensor | None) -> None:
        self.xx = torch.zeros((), dtype=torch.float64, device=self.space.device)

    def project_(self, xi: Tensor) -> Tensor:
        return self.space.clamp_box_(xi, self.rho)

    def step_(
        self,
        step: Retraction,
        xi_prev: Tensor,
        grad: Tensor,
        eta: float,
        a: float,
        point: Tensor | None,
    ) -> tuple[Tensor, bool]:
        if self.held:
            xp = None if a == 1.0 else xi_prev
            return self.space.held_box_(step.xi, grad, xp, point, eta, a, self.rho), True
        xi = step.xi
        self.space.pullback_(step, grad)
        z = self.space.scale_(grad.sign_()).mul_(eta).add_(xi)
        self.project_(z)
        if a != 1.0:
            z.mul_(a).add_(xi, alpha=2.0 * (1.0 - a)).sub_(xi_prev, alpha=1.0 - a)
            self.project_(z)
        return z, False

    def restart(self, norm_sq: Tensor) -> None:
        pass


def gradient_dtype(
    geometry: Geometry,
    dtype: torch.dtype,
    grad_dtype: torch.dtype | None,
    keep_best_gradient: bool = False,
) -> torch.dtype:
    """The dtype :func:`auto_pgd` keeps the gradient in, on tangents of ``dtype``: one
    as wide as ``grad_dtype`` where that is narrower, on a straight element-wise step
    (:attr:`Geometry.holds_point <geosharp.geometry.Geometry.holds_point>`), else
    ``dtype``. Of float32's range: bfloat16 for float16 (whose range, to 65504, could
    overflow a gradient, and whose normal numbers end at 6e-5).

    >>> from geosharp.geometry import Geometry
    >>> gradient_dtype(Geometry.named("adaptive"), torch.float32, torch.bfloat16)
    torch.bfloat16
    >>> gradient_dtype(Geometry.named("adaptive"), torch.float32, torch.float16)
    torch.bfloat16
    >>> gradient_dtype(Geometry.named("geodesic"), torch.float32, torch.bfloat16)
    torch.float32
    """
    if grad_dtype is None or not geometry.holds_point or keep_best_gradient:
        return dtype
    narrow = torch.finfo(grad_dtype)
    if narrow.bits >= torch.finfo(dtype).bits:
        return dtype
    if narrow.max < torch.finfo(torch.float32).max / 2:  # float16: its width, float32's range
        return torch.bfloat16 if narrow.bits == 16 else dtype
    return grad_dtype


class Iterate:
    """What an :func:`auto_pgd` callback is shown: :attr:`xi`, the tangent (not to be
    written; a new vector while the loop holds the iterate as its point)."""

    __slots__ = ("_buffer", "_space")

    def __init__(self, buffer: Tensor, space: PerturbationSpace | None = None):
        self._buffer, self._space = buffer, space  # space: the buffer holds the point

    @property
    def xi(self) -> Tensor:
        return self._buffer if self._space is None else self._space.tangent(self._buffer)


def auto_pgd(
    loss_grad: LossGrad,
    space: PerturbationSpace,
    rho: float,
    n_iters: int,
    xi0: Tensor | None = None,
    momentum: float = 0.75,
    callback: Callable[[str, int, Iterate], None] | None = None,
    keep_best_gradient: bool = False,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, APGDTrace]:
    """Maximise ``xi -> loss(space.retr(xi))`` over the ``rho``-ball of ``space``.

    ``loss_grad(point, out)`` returns the loss at the parameter vector ``point`` and
    writes its Euclidean gradient into the buffer ``out`` (returning it); it may keep no
    reference to either. The loop retracts (:meth:`PerturbationSpace.retr_`), pulls the
    gradient back to the tangent and turns it into the ascent direction
    (:meth:`PerturbationSpace.ascent_`) and steps.
    Returns the best value (a 0-d tensor), the best ``xi`` and the :class:`APGDTrace`.

    Memory beyond the space and one training step (whose gradient buffer the point
    shares): three parameter-sized vectors, ``xi`` and its previous and best values;
    four with ``keep_best_gradient=True``, the reference's restart (see the module's
    docstring). ``loss_grad`` may be given the point as its ``out`` (the gradient then
    replaces the point); where it raises :class:`PointOverwritten`, the point is formed
    again and evaluated with separate buffers from then on.

    ``grad_dtype`` narrower than the space's (a half-precision model's, whose training
    step's gradient it is), on a straight element-wise step: the gradient is kept in
    that width (:func:`gradient_dtype`: bfloat16 for float16, of float32's range), in
    a buffer of its own, and the iterate in the buffer of its point ``theta + xi``,
    where the forward reads it and the step reads it back (``xi`` to the point's
    round-off): the same three vectors beside a gradient of that width (the point and
    the gradient otherwise share a vector of the space's width). The gradient only steers the
    search; every value is the loss at a point of the ball.

    ``callback(event, i, iterate)``, if given, is called with ``"start"`` and ``"end"``
    (the start and the best point), ``"evaluate"`` before and ``"evaluated"`` after each
    call of ``loss_grad``, and ``"step"`` after the ``i``-th update (none in an
    iteration that evaluates the best point again); for diagnostics and benchmarks.
    ``iterate.xi`` is the tangent (:class:`Iterate`; it must not be written).

    On a GPU the loop never waits for the device outside the checkpoints (the best point
    is kept with ``torch.where``); on the CPU, where nothing is asynchronous, it reads
    the comparison and copies only on improvement.
    """
    box = space.geometry.p == float("inf")
    width = gradient_dtype(space.geometry, space.dtype, grad_dtype, keep_best_gradient)
    held = width != space.dtype
    ball = _Box(space, rho, held) if box else _L2Ball(space, rho, held)
    notify = (
        (lambda event, i, x, point=False: callback(event, i, Iterate(x, space if point else None)))
        if callback is not None
        else (lambda event, i, x, point=False: None)
    )
    buffers = _Buffers(space)
    shared = True  # the gradient is written over the point (one buffer for both)
    # held: the gradient's own buffer, in its dtype; the current iterate holds its point
    gradient = torch.empty(space.numel, dtype=width, device=space.device) if held else None

    def evaluate(
        x: Tensor, i: int, point: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Retraction]:
        """The loss and Euclidean gradient at ``x``'s point, and its retraction (for the
        pullback, done with the step: :meth:`PerturbationSpace.ascent_`);
        ``point``: a buffer whose element-wise entries of the point the step wrote
        already."""
        nonlocal shared
        if held:  # ``point``: x holds its point already
            if point is None:
                space.hold_(x)
            notify("evaluate", i, x, True)
            value, grad = loss_grad(x, gradient)
            notify("evaluated", i, x, True)
            return value, grad, Retraction(x, [])  # x holds its point
        written = point is not None
        point = buffers.take() if point is None else point
        step = space.retr_(x, point, written=written)
        notify("evaluate", i, x)
        try:
            value, grad = loss_grad(point, point if shared else buffers.take())
        except PointOverwritten:  # backward read the point after replacing it
            shared = False
            step = space.retr_(x, point)
            value, grad = loss_grad(point, buffers.take())
            buffers.give(point)
        notify("evaluated", i, x)
        return value, grad, step

    xi = space.empty().zero_() if xi0 is None else ball.project_(xi0.clone())
    ball.start(None if xi0 is None else xi)
    notify("start", 0, xi)
    value, grad, step = evaluate(xi, 0)
    on_host = xi.device.type in _HOST_DEVICES
    # on the host the best point is the iterate itself where it is the best (no copy):
    # its buffer is kept, not recycled, until a better one replaces it
    best_value, best_xi = value, xi if on_host else xi.clone()
    best_grad = grad.clone() if keep_best_gradient else None
    improved = torch.ones((), dtype=torch.bool, device=xi.device)  # current point is best
    best_sq = ball.xx
    xi_prev = xi
    eta = 2.0 * rho
    marks = set(checkpoints(n_iters))
    last_mark, increases = 0, torch.zeros((), device=xi.device)
    reduced_last, best_at_mark = True, best_value
    values, bests, etas, restarts = [value], [best_value], [eta], []

    revisit = False  # xi was set back to the best point, whose gradient is not kept
    for i in range(n_iters):
        if revisit:  # this iteration evaluates the best point again, without a step
            revisit = False  # held on a GPU: xi holds the best point's point already
            new_value, grad, step = evaluate(xi, i + 1, xi if held and not on_host else None)
        else:
            # z = P(xi + eta d); xi_new = P(xi + a (z - xi) + (1 - a)(xi - xi_prev)),
            # a = 1 first
            a = momentum if i > 0 else 1.0
            # the point's buffer: xi_prev's where nothing else holds it (read before written)
            free_prev = xi_prev is not xi and xi_prev is not best_xi
            point = xi_prev if free_prev else buffers.take()
            new_xi, written = ball.step_(step, xi_prev, grad, eta, a, point)
            step = None  # its h x h matrices, kept, would pin the C heap under later blocks
            if not written:
                buffers.give(point)
            xi_prev, xi = xi, new_xi
            notify("step", i + 1, xi, held)
            new_value, grad, step = evaluate(xi, i + 1, point if written else None)
        increases = increases + (new_value > value)
        value = new_value
        improved = value > best_value
        best_value = torch.where(improved, value, best_value)
        best_sq = torch.where(improved, ball.xx, best_sq)
        if on_host:
            if bool(improved):
                if best_xi is not xi_prev:  # held for itself alone: free
                    buffers.give(best_xi)
                best_xi = xi
                if best_grad is not None:  # the step writes over the gradient: a copy
                    best_grad.copy_(grad)
        else:
            torch.where(improved, xi, best_xi, out=best_xi)
            if best_grad is not None:
                torch.where(improved, grad, best_grad, out=best_grad)
        values.append(value)
        bests.append(best_value)

        done = i + 1
        if done in marks:  # the one read from the device per checkpoint
            flags = torch.stack([increases, best_at_mark == best_value, improved])
            n_up, same_best, at_best = flags.double().tolist()
            too_few = n_up < 0.75 * (done - last_mark)
            stalled = (not reduced_last) and bool(same_best)
            reduced_last = too_few or stalled
            if reduced_last:  # halve the step and go back to the best point
                eta /= 2.0
                if xi_prev is not xi and xi_prev is not best_xi:
                    buffers.give(xi_prev)
                xi_prev = xi
                if not at_best:
                    xi.copy_(best_xi)
                    if best_grad is not None:
                        grad.copy_(best_grad)  # its retraction's matrices made again
                        value, step = best_value, space.retraction(xi)
                    else:  # the next iteration evaluates it: its value rose from xi's
                        if not held:
                            buffers.give(grad)
                        grad = step = None
                        revisit = True
                ball.restart(best_sq)
                restarts.append(done)
            best_at_mark, last_mark = best_value, done
            increases = torch.zeros((), device=xi.device)
        etas.append(eta)

    if held and (best_xi is xi or not on_host):  # it holds its point
        space.hold_(best_xi, point=False)
    if callback is not None:
        callback("end", n_iters, Iterate(best_xi))
    trace = APGDTrace(
        losses=torch.stack(values).tolist(),
        best=torch.stack(bests).tolist(),
        step_sizes=etas,
        restarts=restarts,
    )
    return best_value, best_xi, trace
