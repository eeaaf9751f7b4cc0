r"""One Auto-PGD step, fused: what :func:`~geosharp.measures.apgd.auto_pgd` needs beyond
the manifold interface of :class:`~geosharp.geometry.PerturbationSpace`.

Written against the interface alone, a step (pull the gradient back, ``d =
proju(egrad2rgrad(g))``, two dot products and two norms, two combinations, two ball
projections) reads parameter-sized vectors a dozen times. :class:`StepKernel` takes it
in two passes, run by run over the factors: :meth:`~StepKernel.ascent_` (the pullback,
``d`` and its dot products with ``xi`` and ``xi_prev``) and :meth:`~StepKernel.combine_`
(the next ``xi`` and, on a straight element-wise step, its point ``theta + xi``); the
balls (:class:`L2Ball`, :class:`Box`) turn the Gram matrix of ``xi, d, xi_prev`` into
the coefficients, as 0-d tensors, so nothing waits for the device. On a straight step
beside a narrower gradient the iterate is held as its point (``held``):
:meth:`~StepKernel.held_direction_` reads ``xi`` back from it, and
:meth:`~StepKernel.held_combine_` / :meth:`~StepKernel.held_box_` write the next one
into it.

The reference Auto-PGD of ``tests/test_apgd_reference.py``, written against the
interface alone, is the oracle: the loop and this kernel take its steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..geometry.space import PerturbationSpace, Retraction

__all__ = ["Box", "L2Ball", "StepKernel"]


class StepKernel:
    """Auto-PGD's fused, in-place passes over the factors of a space (see the module's
    docstring); every entry of a result is that of the interface's composition."""

    def __init__(self, space: PerturbationSpace):
        self.space, self.elementwise, self.pairs = space, space.elementwise, space.pairs
        self.ball_pairs, self.reduce = space.ball_pairs, space.reduce

    @property
    def fused_step(self) -> bool:
        """Whether :meth:`combine_` can write the point's element-wise entries (the
        straight element-wise step)."""
        return not self.elementwise.exp

    def direction_(self, egrad: Tensor, *others: Tensor) -> tuple[Tensor, list[Tensor]]:
        r"""Start ``d = proju(egrad2rgrad(egrad))`` in place: pair entries of ``egrad``
        become those of ``d``, element-wise entries ``c * egrad`` (``d = c^2 egrad``
        there: :meth:`combine_` applies the second ``c``). Returns ``||d||^2`` as
        ``<d, egrad>`` (the Riemannian gradient represents ``egrad`` in the metric and
        ``d`` is horizontal) and the Euclidean ``<y, egrad>`` of each ``y`` of
        ``others``, read in the same pass (float64, 0-d each)."""
        sq, dots = self.elementwise.direction_(egrad, others)
        sums = self.reduce(torch.stack([sq, *dots]))
        if self.ball_pairs is not None:  # after: the element-wise pass keeps the pair entries
            sums[0] += self.ball_pairs.direction_(egrad)
        return sums[0], list(sums[1:])

    def ascent_(
        self, step: Retraction, grad: Tensor, *others: Tensor
    ) -> tuple[Tensor, list[Tensor]]:
        """``pullback_`` then :meth:`direction_`: ``grad``, the Euclidean gradient at the
        point of ``step``, becomes the ascent direction ``d`` of its pullback ``g``, in
        place; returns ``||d||^2`` and ``<y, g>`` for each ``y`` of ``others``. Where the
        pairs are measured in their metric and stepped along their geodesic, each
        stack's blocks are pulled back and turned into ``d`` in one pass (read once,
        written once), and the element-wise pass leaves their entries alone."""
        space = self.space
        if self.ball_pairs is None or not space.geometry.geodesic_step:
            space.pullback_(step, grad)
            return self.direction_(grad, *others)
        with torch.no_grad():
            space.pullback_(step, grad, pairs=False)
            sq, dots = self.elementwise.direction_(grad, others, claimed=False)
            pair_sq, pair_dots = self.ball_pairs.ascent_(step.xi, grad, step.saved, others)
            sums = [sq + pair_sq, *(a + b for a, b in zip(dots, pair_dots))]
            sums = self.reduce(torch.stack(sums))
        return sums[0], list(sums[1:])

    def combine_(
        self,
        out: Tensor,
        kd: Tensor,
        x: Tensor,
        kx: Tensor,
        xp: Tensor | None = None,
        kxp: Tensor | None = None,
        point: Tensor | None = None,
    ) -> Tensor:
        """``out <- kd d + kx x + kxp xp`` where ``out`` comes from :meth:`direction_`
        (scalars: 0-d tensors). With ``point`` (where :attr:`fused_step`), also writes
        the element-wise entries of the result's point into ``point`` in the same pass:
        ``retr_(..., written=True)`` completes it. ``point`` may be ``xp``'s buffer."""
        return self.elementwise.combine_(out, kd, x, kx, xp, kxp, point)

    def retraction(self, xi: Tensor) -> Retraction:
        """What ``retr_`` at ``xi`` saves for the pullback, made again without writing a
        point (the pairs' ``h x h`` matrices)."""
        saved: list[object] = []
        if self.pairs is not None and self.space.geometry.geodesic_step:
            with torch.no_grad():
                saved = self.pairs.saved(xi, straighten=self.elementwise.exp)
        return Retraction(xi, saved)

    # -- the iterate held as its point, beside a narrower gradient ----------------------

    def hold_(self, x: Tensor, point: bool = True) -> Tensor:
        """``x <- theta + x`` (``point``) or back ``x <- x - theta``, in place (a straight
        step on every entry: :attr:`Geometry.holds_point
        <geosharp.geometry.Geometry.holds_point>`)."""
        with torch.no_grad():
            return self.elementwise.hold_(x, point)

    def tangent(self, x: Tensor) -> Tensor:
        """The tangent of a buffer that holds its point, as a new vector."""
        return self.hold_(x.clone(), point=False)

    def held_direction_(
        self, x: Tensor, grad: Tensor, *others: Tensor
    ) -> tuple[Tensor, list[Tensor]]:
        """:meth:`ascent_` with ``grad`` the gradient at the point that ``x`` holds: ``x``
        read back as the tangent first; ``grad`` is read, never written (returns
        ``||d||^2``, ``<x, grad>`` and ``<y, grad>`` for each ``y`` of ``others``)."""
        with torch.no_grad():
            sq, dots = self.elementwise.held_direction_(grad, x, others)
            sums = self.reduce(torch.stack([sq, *dots]))
        return sums[0], list(sums[1:])

    def held_combine_(
        self,
        grad: Tensor,
        kd: Tensor,
        x: Tensor,
        kx: Tensor,
        xp: Tensor | None,
        kxp: Tensor | None,
        out: Tensor,
    ) -> Tensor:
        """``out <- theta + kd d + kx x + kxp xp`` with ``d = c^2 grad``: the next iterate,
        held as its point (``out`` may be ``xp``'s buffer)."""
        with torch.no_grad():
            return self.elementwise.held_combine_(grad, kd, x, kx, xp, kxp, out)

    def held_box_(
        self, x: Tensor, grad: Tensor, xp: Tensor | None, out: Tensor, eta, a, rho
    ) -> Tensor:
        """The L-infinity step from the point that ``x`` holds (read back as the tangent;
        ``out`` may be ``xp``'s buffer): the next iterate, held as its point."""
        with torch.no_grad():
            return self.elementwise.held_box_(grad, x, xp, out, eta, a, rho)


class L2Ball:
    r"""The metric ball. One step needs two dot products with the gradient and no norm
    of a new vector: with ``d`` the horizontal Riemannian gradient,

    .. math:: \langle \xi, d \rangle_g = \langle \xi, \nabla L \rangle, \qquad
              \|d\|_g^2 = \langle d, \nabla L \rangle

    (``xi`` horizontal), and the norms of ``z = xi + c d`` and of the momentum point
    ``alpha xi + beta d + gamma xi_prev`` follow from the Gram matrix of ``xi, d,
    xi_prev``, whose other entries are carried from step to step as 0-d tensors.
    """

    def __init__(self, kernel: StepKernel, rho: float, held: bool = False):
        self.kernel, self.space, self.rho, self.held = kernel, kernel.space, rho, held

    def start(self, xi: Tensor | None) -> None:
        self.xx = torch.zeros((), dtype=torch.float64, device=self.space.device)
        if xi is not None:
            self.xx = self.space.inner(xi, xi)
        self.pp, self.xp = self.xx, self.xx  # xi_prev = xi

    def project_(self, xi: Tensor) -> Tensor:
        space = self.space
        shrink = (self.rho / space.norm(xi).clamp_min(1e-30)).clamp(max=1.0)
        return space.proju_(xi.mul_(shrink.to(xi.dtype)))

    def _direction(self, xi: Tensor, xi_prev: Tensor, grad: Tensor, step: Retraction):
        """``(||d||^2, <xi, g>, <xi_prev, g>)``, ``grad`` turned into ``d`` unless held."""
        kernel, same = self.kernel, xi_prev is xi
        if self.held:
            dd, dots = kernel.held_direction_(xi, grad, *(() if same else (xi_prev,)))
            return dd, dots[0], dots[-1]
        if same:
            dd, (xd,) = kernel.ascent_(step, grad, xi)
            return dd, xd, xd
        dd, (xd, pd) = kernel.ascent_(step, grad, xi, xi_prev)
        return dd, xd, pd

    def _coefficients(self, dd: Tensor, xd: Tensor, pd: Tensor, eta: float, a: float):
        """``(alpha, beta, gamma)`` of the next ``xi = alpha xi + beta d + gamma
        xi_prev`` (``gamma`` ``None`` without momentum), and its squared norm."""
        rho = self.rho
        c = eta / dd.clamp_min(0).sqrt().clamp_min(1e-30)  # z = xi + c d, d unnormalised
        zz = (self.xx + 2 * c * xd + c * c * dd).clamp_min(0)
        s1 = (rho / zz.sqrt().clamp_min(1e-30)).clamp(max=1.0)
        if a == 1.0:  # no momentum: the projected z
            return s1, s1 * c, None, torch.ones_like(s1), s1 * s1 * zz
        # a P(z) + (1 - a)(2 xi - xi_prev), projected again
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
        return alpha, beta, gamma, s2, s2 * s2 * nn

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
        retraction of ``xi = step.xi``), with the next iterate; where the space allows,
        write the element-wise entries of its point into ``point`` in the same pass
        (returned: whether it did). ``held``: ``grad`` is read only and the next iterate
        is written into ``point``, held as its point."""
        xi, same = step.xi, xi_prev is step.xi
        dd, xd, pd = self._direction(xi, xi_prev, grad, step)
        alpha, beta, gamma, s2, nn = self._coefficients(dd, xd, pd, eta, a)
        new_x = s2 * (alpha * self.xx + beta * xd + (gamma * self.xp if gamma else 0.0))
        kx, kd = (s2 * alpha).to(xi.dtype), (s2 * beta).to(xi.dtype)
        kp = None if gamma is None or same else (s2 * gamma).to(xi.dtype)
        if gamma is not None and same:  # xi_prev is xi: fold it in
            kx = (s2 * (alpha + gamma)).to(xi.dtype)
        xp = None if same else xi_prev
        if self.held:
            out, written = self.kernel.held_combine_(grad, kd, xi, kx, xp, kp, point), True
        else:
            written = point is not None and self.kernel.fused_step
            out = self.kernel.combine_(grad, kd, xi, kx, xp, kp, point if written else None)
        self.xx, self.pp, self.xp = nn, self.xx, new_x
        return out, written

    def restart(self, norm_sq: Tensor) -> None:
        self.xx = self.pp = self.xp = norm_sq


class Box:
    """The L-infinity box ``|xi_j| <= rho c_j`` (Andriushchenko et al. 2023)."""

    def __init__(self, kernel: StepKernel, rho: float, held: bool = False):
        self.kernel, self.space, self.rho, self.held = kernel, kernel.space, rho, held

    def start(self, xi: Tensor | None) -> None:
        self.xx = torch.zeros((), dtype=torch.float64, device=self.space.device)

    def project_(self, xi: Tensor) -> Tensor:
        return self.space.elementwise.clamp_box_(xi, self.rho)

    def step_(
        self,
        step: Retraction,
        xi_prev: Tensor,
        grad: Tensor,
        eta: float,
        a: float,
        point: Tensor | None,
    ) -> tuple[Tensor, bool]:
        """:meth:`L2Ball.step_` with ``z = clamp(xi + eta c sign(g))``."""
        if self.held:
            xp = None if a == 1.0 else xi_prev
            return self.kernel.held_box_(step.xi, grad, xp, point, eta, a, self.rho), True
        xi = step.xi
        self.space.pullback_(step, grad)
        z = self.space.elementwise.scale_(grad.sign_()).mul_(eta).add_(xi)
        self.project_(z)
        if a != 1.0:
            z.mul_(a).add_(xi, alpha=2.0 * (1.0 - a)).sub_(xi_prev, alpha=1.0 - a)
            self.project_(z)
        return z, False

    def restart(self, norm_sq: Tensor) -> None:
        pass
