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

The loop makes one forward and one backward per step (the objective returns the
loss and its gradient together) and no host synchronisation outside checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..geometry.space import PerturbationSpace

__all__ = ["APGDTrace", "auto_pgd", "checkpoints"]

Objective = Callable[[Tensor], tuple[Tensor, Tensor]]


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


class _Ball:
    """Direction and projection for the L2 (metric) or L-infinity (box) ball; both work
    in place so that a step allocates no parameter-sized buffer besides its result."""

    def __init__(self, space: PerturbationSpace, rho: float):
        self.space, self.rho = space, rho
        self.box = space.geometry.p == float("inf")
        if self.box:
            self.upper = rho * space.scale
            self.lower = -self.upper

    def direction_(self, egrad: Tensor) -> Tensor:
        """Overwrite ``egrad`` with the ascent direction."""
        space = self.space
        if self.box:
            return egrad.sign_().mul_(space.scale)
        d = space.proju_(space.egrad2rgrad_(egrad))
        return d.div_(space.norm(d).clamp_min(1e-30).to(d.dtype))

    def project_(self, xi: Tensor) -> Tensor:
        """Project ``xi`` onto the ball (and the horizontal space), in place."""
        space = self.space
        if self.box:
            return torch.minimum(torch.maximum(xi, self.lower, out=xi), self.upper, out=xi)
        shrink = (self.rho / space.norm(xi).clamp_min(1e-30)).clamp(max=1.0)
        return space.proju_(xi.mul_(shrink.to(xi.dtype)))


def auto_pgd(
    objective: Objective,
    space: PerturbationSpace,
    rho: float,
    n_iters: int,
    xi0: Tensor | None = None,
    momentum: float = 0.75,
) -> tuple[Tensor, Tensor, APGDTrace]:
    """Maximise ``objective`` over the ``rho``-ball of ``space``.

    ``objective(xi)`` returns ``(value, euclidean_gradient)``; it may keep no reference
    to the gradient, which is overwritten. Returns the best value (a 0-d tensor), the
    best ``xi`` and the :class:`APGDTrace`.
    """
    ball = _Ball(space, rho)
    xi = torch.zeros_like(space.theta) if xi0 is None else ball.project_(xi0.clone())
    value, grad = objective(xi)
    best_value, best_xi, best_grad = value, xi.clone(), grad.clone()
    xi_prev = xi
    eta = 2.0 * rho
    marks = set(checkpoints(n_iters))
    last_mark, increases = 0, torch.zeros((), device=xi.device)
    reduced_last, best_at_mark = True, best_value
    values, bests, etas, restarts = [value], [best_value], [eta], []

    for i in range(n_iters):
        # z = P(xi + eta d); xi_new = P(xi + a (z - xi) + (1 - a)(xi - xi_prev))
        z = ball.project_(torch.add(xi, ball.direction_(grad), alpha=eta))
        del grad
        a = momentum if i > 0 else 1.0
        if a != 1.0:
            z.mul_(a).add_(xi, alpha=2.0 * (1.0 - a)).sub_(xi_prev, alpha=1.0 - a)
            ball.project_(z)
        xi_prev, xi = xi, z
        new_value, grad = objective(xi)
        increases = increases + (new_value > value)
        value = new_value
        improved = value > best_value
        best_value = torch.where(improved, value, best_value)
        torch.where(improved, xi, best_xi, out=best_xi)
        torch.where(improved, grad, best_grad, out=best_grad)
        values.append(value)
        bests.append(best_value)

        step = i + 1
        if step in marks:
            too_few = increases.item() < 0.75 * (step - last_mark)
            stalled = (not reduced_last) and bool(best_at_mark == best_value)
            reduced_last = too_few or stalled
            if reduced_last:
                eta /= 2.0
                xi = xi_prev = best_xi.clone()
                grad = best_grad.clone()
                value = best_value
                restarts.append(step)
            best_at_mark, last_mark = best_value, step
            increases = torch.zeros((), device=xi.device)
        etas.append(eta)

    trace = APGDTrace(
        losses=torch.stack(values).tolist(),
        best=torch.stack(bests).tolist(),
        step_sizes=etas,
        restarts=restarts,
    )
    return best_value, best_xi, trace
