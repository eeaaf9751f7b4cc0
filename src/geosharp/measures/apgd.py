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
from .apgd_step import Box, L2Ball, StepKernel


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

    __slots__ = ("_buffer", "_kernel")

    def __init__(self, buffer: Tensor, kernel: StepKernel | None = None):
        self._buffer, self._kernel = buffer, kernel  # kernel: the buffer holds the point

    @property
    def xi(self) -> Tensor:
        return self._buffer if self._kernel is None else self._kernel.tangent(self._buffer)


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
    reference to either. Each iteration steps (:mod:`~geosharp.measures.apgd_step`: the
    pullback, the ascent direction and the ball's projections, fused), retracts
    (:meth:`PerturbationSpace.retr_`) and evaluates; the step size halves at the
    :func:`checkpoints`. Returns the best value (a 0-d tensor), the best ``xi`` and the
    :class:`APGDTrace`.

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
    round-off): the same three vectors beside a gradient of that width. The gradient
    only steers the search; every value is the loss at a point of the ball.

    ``callback(event, i, iterate)``, if given, is called with ``"start"`` and ``"end"``
    (the start and the best point), ``"evaluate"`` before and ``"evaluated"`` after each
    call of ``loss_grad``, and ``"step"`` after the ``i``-th update (none in an
    iteration that evaluates the best point again); for diagnostics and benchmarks.
    ``iterate.xi`` is the tangent (:class:`Iterate`; it must not be written).

    On a GPU the loop never waits for the device outside the checkpoints (the best point
    is kept with ``torch.where``); on the CPU, where nothing is asynchronous, it reads
    the comparison and copies only on improvement.
    """
    search = _Search(loss_grad, space, rho, callback, keep_best_gradient, grad_dtype)
    search.start(xi0)
    schedule = _StepSize(rho, n_iters, search.best_value)
    search.trace.step_sizes.append(schedule.eta)
    for i in range(n_iters):
        schedule.count(search.iterate(i, momentum if i > 0 else 1.0, schedule.eta))
        reduced = schedule.reduce(i + 1, search.best_value, search.improved)
        if reduced is not None:
            search.restart(i + 1, at_best=reduced == "at best")
        search.trace.step_sizes.append(schedule.eta)
    return search.finish(n_iters)


class _StepSize:
    """Auto-PGD's step size ``eta``: ``2 rho``, halved at a checkpoint when fewer than
    75% of the steps since the last one increased the objective, or when it was not
    halved at the last one and the best value has not changed since."""

    def __init__(self, rho: float, n_iters: int, best_value: Tensor):
        self.eta, self.marks = 2.0 * rho, set(checkpoints(n_iters))
        self.last_mark, self.reduced_last, self.best_at_mark = 0, True, best_value
        self.increases = torch.zeros((), device=best_value.device)

    def count(self, increased: Tensor) -> None:
        self.increases = self.increases + increased

    def reduce(self, done: int, best_value: Tensor, improved: Tensor) -> str | None:
        """At a checkpoint (the loop's one read from the device): whether to halve and
        restart, as ``"at best"`` (the current point is the best) or ``"back"``."""
        if done not in self.marks:
            return None
        flags = torch.stack([self.increases, self.best_at_mark == best_value, improved])
        n_up, same_best, at_best = flags.double().tolist()
        too_few = n_up < 0.75 * (done - self.last_mark)
        stalled = (not self.reduced_last) and bool(same_best)
        self.reduced_last = too_few or stalled
        self.best_at_mark, self.last_mark = best_value, done
        self.increases = torch.zeros((), device=best_value.device)
        if not self.reduced_last:
            return None
        self.eta /= 2.0
        return "at best" if at_best else "back"


class _Search:
    """The iterates of one :func:`auto_pgd` run and the buffers they live in: the
    current ``xi`` and its point (or the point alone, ``held``), ``xi_prev``, the best
    point, and the gradient (written over the point unless ``held`` or
    :class:`PointOverwritten`)."""

    def __init__(self, loss_grad, space, rho, callback, keep_best_gradient, grad_dtype):
        self.loss_grad, self.space, self.callback = loss_grad, space, callback
        self.keep_gradient = keep_best_gradient
        self.kernel = StepKernel(space)
        width = gradient_dtype(space.geometry, space.dtype, grad_dtype, keep_best_gradient)
        self.held = width != space.dtype
        box = space.geometry.p == float("inf")
        self.ball = (Box if box else L2Ball)(self.kernel, rho, self.held)
        self.buffers, self.shared = _Buffers(space), True
        # held: the gradient's own buffer, in its dtype; the current iterate holds its point
        self.gradient = None
        if self.held:
            self.gradient = torch.empty(space.numel, dtype=width, device=space.device)
        self.revisit = False  # xi was set back to the best point, whose gradient is not kept
        self.trace = APGDTrace()

    def notify(self, event: str, i: int, x: Tensor, point: bool = False) -> None:
        if self.callback is not None:
            self.callback(event, i, Iterate(x, self.kernel if point else None))

    def evaluate(self, x: Tensor, i: int, point: Tensor | None = None):
        """The loss and Euclidean gradient at ``x``'s point, and its retraction (for the
        pullback, done with the step); ``point``: a buffer whose element-wise entries of
        the point the step wrote already (held: ``x`` holds its point already)."""
        if self.held:
            if point is None:
                self.kernel.hold_(x)
            self.notify("evaluate", i, x, True)
            value, grad = self.loss_grad(x, self.gradient)
            self.notify("evaluated", i, x, True)
            return value, grad, Retraction(x, [])  # x holds its point
        buffers, written = self.buffers, point is not None
        point = buffers.take() if point is None else point
        step = self.space.retr_(x, point, written=written)
        self.notify("evaluate", i, x)
        try:
            value, grad = self.loss_grad(point, point if self.shared else buffers.take())
        except PointOverwritten:  # backward read the point after replacing it
            self.shared = False
            step = self.space.retr_(x, point)
            value, grad = self.loss_grad(point, buffers.take())
            buffers.give(point)
        self.notify("evaluated", i, x)
        return value, grad, step

    def start(self, xi0: Tensor | None) -> None:
        space = self.space
        xi = space.empty().zero_() if xi0 is None else self.ball.project_(xi0.clone())
        self.ball.start(None if xi0 is None else xi)
        self.notify("start", 0, xi)
        self.value, self.grad, self.step = self.evaluate(xi, 0)
        self.on_host = xi.device.type in _HOST_DEVICES
        # on the host the best point is the iterate itself where it is the best (no copy):
        # its buffer is kept, not recycled, until a better one replaces it
        self.best_value, self.best_xi = self.value, xi if self.on_host else xi.clone()
        self.best_grad = self.grad.clone() if self.keep_gradient else None
        self.improved = torch.ones((), dtype=torch.bool, device=xi.device)  # current is best
        self.best_sq, self.xi, self.xi_prev = self.ball.xx, xi, xi
        self.trace.losses, self.trace.best = [self.value], [self.best_value]

    def iterate(self, i: int, a: float, eta: float) -> Tensor:
        """Step with momentum ``a`` and size ``eta`` and evaluate (or evaluate the best
        point again, after a restart away from it); keep the best. Returns whether the
        value rose."""
        if self.revisit:  # held on a GPU: xi holds the best point's point already
            self.revisit = False
            again = self.xi if self.held and not self.on_host else None
            new_value, self.grad, self.step = self.evaluate(self.xi, i + 1, again)
        else:
            point = self.take_step(i, a, eta)
            new_value, self.grad, self.step = self.evaluate(self.xi, i + 1, point)
        increased, self.value = new_value > self.value, new_value
        self.keep_best()
        return increased

    def take_step(self, i: int, a: float, eta: float) -> Tensor | None:
        """``z = P(xi + eta d)``, ``xi <- P(xi + a (z - xi) + (1 - a)(xi - xi_prev))``;
        the point's buffer: ``xi_prev``'s where nothing else holds it (read before
        written). Returns it where the step wrote the point's entries, else ``None``."""
        xi, xi_prev = self.xi, self.xi_prev
        free_prev = xi_prev is not xi and xi_prev is not self.best_xi
        point = xi_prev if free_prev else self.buffers.take()
        new_xi, written = self.ball.step_(self.step, xi_prev, self.grad, eta, a, point)
        self.step = None  # its h x h matrices, kept, would pin the C heap under later blocks
        if not written:
            self.buffers.give(point)
        self.xi_prev, self.xi = xi, new_xi
        self.notify("step", i + 1, new_xi, self.held)
        return point if written else None

    def keep_best(self) -> None:
        value, xi = self.value, self.xi
        self.improved = improved = value > self.best_value
        self.best_value = torch.where(improved, value, self.best_value)
        self.best_sq = torch.where(improved, self.ball.xx, self.best_sq)
        if self.on_host:
            if bool(improved):
                if self.best_xi is not self.xi_prev:  # held for itself alone: free
                    self.buffers.give(self.best_xi)
                self.best_xi = xi
                if self.best_grad is not None:  # the step writes over the gradient: a copy
                    self.best_grad.copy_(self.grad)
        else:
            torch.where(improved, xi, self.best_xi, out=self.best_xi)
            if self.best_grad is not None:
                torch.where(improved, self.grad, self.best_grad, out=self.best_grad)
        self.trace.losses.append(value)
        self.trace.best.append(self.best_value)

    def restart(self, done: int, at_best: bool) -> None:
        """Go back to the best point (with its kept gradient, or to evaluate it again in
        the next iteration, its value rising from the current point's)."""
        xi = self.xi
        if self.xi_prev is not xi and self.xi_prev is not self.best_xi:
            self.buffers.give(self.xi_prev)
        self.xi_prev = xi
        if not at_best:
            xi.copy_(self.best_xi)
            if self.best_grad is not None:
                self.grad.copy_(self.best_grad)  # its retraction's matrices made again
                self.value, self.step = self.best_value, self.kernel.retraction(xi)
            else:
                if not self.held:
                    self.buffers.give(self.grad)
                self.grad = self.step = None
                self.revisit = True
        self.ball.restart(self.best_sq)
        self.trace.restarts.append(done)

    def finish(self, n_iters: int) -> tuple[Tensor, Tensor, APGDTrace]:
        best_xi = self.best_xi
        if self.held and (best_xi is self.xi or not self.on_host):  # it holds its point
            self.kernel.hold_(best_xi, point=False)
        self.notify("end", n_iters, best_xi)
        trace = self.trace
        trace.losses = torch.stack(trace.losses).tolist()
        trace.best = torch.stack(trace.best).tolist()
        return self.best_value, best_xi, trace
