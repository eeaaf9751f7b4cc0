r"""The element-wise factor of a perturbation space: every entry no pair ball claims.

.. math:: \|\xi\|_2^2 = \sum_j (\xi_j / c_j)^2 \quad\text{or}\quad
          \|\xi\|_\infty = \max_j |\xi_j| / c_j, \qquad
          c_j = |\theta_j| \text{ (relative) or } 1,

with the straight step ``theta + xi`` or the exact GL(1) geodesic
``theta exp(xi / theta)``. Entries with ``c_j = 0`` cannot move: those of a pair ball
(the pair factor measures them), and, with the relative scale, those with
``|theta_j|`` below ``sqrt(tiny)`` (``1/c`` would overflow and ``c^2`` underflow).

:class:`Elementwise` is the factor's definition (part of a
:class:`~geosharp.geometry.Geometry`); :class:`ElementwiseSpace` its implementation at
a base point, over the model's own tensors: the scale and the mask of frozen entries
are computed piece by piece where used, never kept (unless ``cache_scale``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..layout import ParameterLayout

__all__ = ["Elementwise", "ElementwiseSpace"]


@dataclass(frozen=True)
class Elementwise:
    """The element-wise factor: ``relative`` scale ``|theta|`` (else 1), ball ``p`` (2 or
    ``inf``), ``step`` ``"straight"`` (``theta + xi``) or ``"exp"``
    (``theta exp(xi / theta)``, the exact geodesic of the relative metric)."""

    relative: bool = True
    p: float = 2.0
    step: str = "straight"

    def __post_init__(self) -> None:
        if self.p not in (2, 2.0, float("inf")):
            raise ValueError(f"p must be 2 or float('inf'), got {self.p!r}")
        if self.step not in ("straight", "exp"):
            raise ValueError("elementwise_step must be 'straight' or 'exp'")
        if self.step == "exp" and not self.relative:
            raise ValueError("the exponential element-wise step needs a relative scale")


@dataclass
class _Part:
    """One parameter's entries ``[start, start + numel)`` of a flat tangent.

    ``theta``: the parameter itself, as a 1-D view; ``pairs``: its entries that a pair
    ball claims (``False`` none, ``True`` all, or a boolean mask); ``frozen``: whether
    some element-wise entry cannot move.
    """

    start: int
    theta: Tensor
    pairs: bool | Tensor = False
    frozen: bool = False

    @property
    def end(self) -> int:
        return self.start + self.theta.numel()


@dataclass
class _Run:
    """Entries ``[start, end)`` of a flat tangent, at most a chunk, over pieces of
    consecutive parameters of one ``kind``: ``"free"`` (no entry claimed: ``c`` is
    ``|theta|``, zero below the threshold where ``frozen``, or 1), ``"claimed"`` (every
    entry claimed by a pair ball) or ``"mixed"`` (one piece of a parameter partly
    claimed)."""

    start: int
    end: int
    kind: str
    pieces: list[tuple[Tensor, bool | Tensor, bool]]  # (theta piece, claimed, frozen)
    frozen: bool = False


class ElementwiseSpace:
    """:class:`Elementwise` at ``theta`` (``{name: 1-D view}`` in the layout's order),
    for tangents in ``dtype`` (default: ``theta``'s; a wider one reads ``theta`` in it
    piece by piece).

    ``claimed``: ``{name: boolean mask}`` of the entries a pair ball measures (``c = 0``
    there). Every method works piece by piece (cache-sized pieces on the CPU), so that
    no parameter-sized temporary is made.
    """

    def __init__(
        self,
        factor: Elementwise,
        params: dict[str, Tensor],
        layout: ParameterLayout,
        claimed: dict[str, Tensor],
        cache_scale: bool = False,
        dtype: torch.dtype | None = None,
    ):
        self.factor = factor
        first = params[layout.names[0]]
        self.dtype = first.dtype if dtype is None else dtype
        self.device, self.numel = first.device, layout.numel
        self._unit = not factor.relative
        self._tiny = torch.finfo(self.dtype).tiny ** 0.5
        self.parts = []
        for name, start in zip(layout.names, layout.offsets):
            part = _Part(start, params[name], claimed.get(name, False))
            if isinstance(part.pairs, Tensor):
                part.pairs = True if bool(part.pairs.all()) else part.pairs
            self.parts.append(part)
        self._set_frozen()
        self.trivial = self._unit and not claimed  # c = 1 everywhere
        # Element-wise work on CPU goes in cache-sized pieces; a GPU takes large ones.
        self.chunk = (1 << 20) if self.device.type == "cpu" else (1 << 26)
        self._set_runs()
        self._cached_scale = None
        if cache_scale and not self.trivial:
            self._cached_scale = self.scale  # one vector more, one pass less per use

    def _set_frozen(self) -> None:
        for part in self.parts:
            if not self._unit and part.pairs is not True:
                part.frozen = bool(self._frozen_mask(part.theta, part.pairs).any())

    def _set_runs(self) -> None:
        """Group the pieces into :class:`_Run` s: the in-place loop's operations go run by
        run, a few operations each, so that small parameters cost no dispatch of their
        own and a run's vectors stay in cache between them. A run holds at most an eighth
        of the entries: its scratch buffer, made by the pass that needs it and freed at
        the pass's end (:meth:`_pass_done`), is never a parameter-sized vector and is not
        held through the forward and backward between passes."""
        cap = min(self.chunk, max(1 << 10, -(-self.numel // 8)))
        runs: list[_Run] = []
        for s, e, theta, pairs, frozen in self.pieces(cap):
            kind = "claimed" if pairs is True else "mixed" if isinstance(pairs, Tensor) else "free"
            last = runs[-1] if runs else None
            if last is not None and kind == last.kind != "mixed" and e - last.start <= cap:
                last.end = e
                last.pieces.append((theta, pairs, frozen))
            else:
                runs.append(_Run(s, e, kind, [(theta, pairs, frozen)]))
            runs[-1].frozen = runs[-1].frozen or (frozen and not self._unit)
        self.runs = runs
        self._scratch = None

    def _pass_done(self) -> None:
        """Free the scratch buffer of the pass that ends."""
        self._scratch = None

    def _c(self, run: _Run, claimed: float = 0.0) -> Tensor | None:
        """``c`` on ``run`` in the pass's reused buffer (``None``: the constant ``claimed`` on a
        claimed run, 1 on a free run of the Euclidean scale)."""
        if run.kind == "claimed" or (run.kind == "free" and self._unit):
            return None
        if run.kind == "mixed":
            ((theta, pairs, frozen),) = run.pieces
            return self._scale_piece(theta, pairs, frozen, claimed)
        if self._scratch is None:
            longest = max(r.end - r.start for r in self.runs if r.kind == "free")
            self._scratch = torch.empty(longest, dtype=self.dtype, device=self.device)
        pieces = [theta for theta, _, _ in run.pieces]
        c = torch.cat(pieces, out=self._scratch[: run.end - run.start]).abs_()
        return torch.threshold_(c, self._tiny, 0.0) if run.frozen else c

    def refresh(self) -> None:
        """Recompute the frozen entries and a cached scale from the current ``theta``."""
        self._set_frozen()
        self._set_runs()
        if self._cached_scale is not None:
            self._cached_scale = None
            self._cached_scale = self.scale

    @property
    def exp(self) -> bool:
        return self.factor.step == "exp"

    # -- the base point, piece by piece --------------------------------------------------

    def pieces(self, step: int | None = None):
        """``(start, end, theta piece, claimed mask piece, frozen)`` covering the layout,
        pieces of at most ``step`` (default: :attr:`chunk`) entries."""
        step = self.chunk if step is None else step
        for part in self.parts:
            n = part.theta.numel()
            for a in range(0, n, step):
                b = min(n, a + step)
                pairs = part.pairs[a:b] if isinstance(part.pairs, Tensor) else part.pairs
                yield part.start + a, part.start + b, part.theta[a:b], pairs, part.frozen

    def theta_flat(self) -> Tensor:
        return torch.cat([part.theta.to(self.dtype) for part in self.parts])

    def _scale_piece(
        self, theta: Tensor, pairs: bool | Tensor, frozen: bool = True, claimed: float = 0.0
    ) -> Tensor | None:
        """``c`` on a piece (``None``: zero on all of it), ``claimed`` on the entries a
        pair ball claims; ``frozen=False`` says that no entry of the piece's parameter is
        below the threshold."""
        if pairs is True:
            return None
        if self._unit:
            c = torch.ones_like(theta, dtype=self.dtype)
        else:
            c = theta.to(self.dtype).abs()
            if frozen:  # c <= tiny -> 0
                torch.threshold_(c, self._tiny, 0.0)
        if isinstance(pairs, Tensor):
            c.masked_fill_(pairs, claimed)
        return c

    def _frozen_mask(self, theta: Tensor, pairs: bool | Tensor) -> Tensor:
        frozen = theta.to(self.dtype).abs() <= self._tiny
        return frozen & ~pairs if isinstance(pairs, Tensor) else frozen

    def scale_(self, x: Tensor, power: int = 1) -> Tensor:
        """``x <- c^power x`` in place (zero where ``c = 0``)."""
        if self.trivial:
            return x
        if self._cached_scale is not None:
            x.mul_(self._cached_scale)
            return x.mul_(self._cached_scale) if power == 2 else x
        return self._scale_pieces_(x, power)

    def _scale_pieces_(self, x: Tensor, power: int = 1) -> Tensor:
        """:meth:`scale_` computing ``c`` piece by piece."""
        for s, e, theta, pairs, frozen in self.pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                x[s:e].zero_()
            else:
                x[s:e].mul_(c)
                if power == 2:
                    x[s:e].mul_(c)
        return x

    def direction_(
        self, x: Tensor, others: Sequence[Tensor] = (), claimed: bool = True
    ) -> tuple[Tensor, list[Tensor]]:
        """``x <- c x`` on the entries a pair ball does not claim (zero where ``c = 0``
        there), the claimed ones kept. Returns ``sum x^2`` over the former after it, and
        ``<y, x>`` before it for each ``y`` of ``others``, over every entry (over the
        unclaimed ones only with ``claimed=False``): one pass, run by run (0-d float64
        sums of this process's entries)."""
        partial = torch.zeros((len(self.runs), 1 + len(others)), dtype=x.dtype, device=x.device)
        for i, run in enumerate(self.runs):
            piece, row = x[run.start : run.end], partial[i]
            if run.kind == "claimed" and not claimed:
                continue
            seen = piece
            if run.kind == "mixed" and not claimed:
                seen = piece.masked_fill(run.pieces[0][1], 0)
            for j, y in enumerate(others, 1):
                torch.dot(y[run.start : run.end], seen, out=row[j])
            if run.kind == "claimed":
                continue
            c = self._c(run, claimed=1.0)
            if c is not None:
                piece.mul_(c)
            pairs = run.pieces[0][1]
            outside = piece.masked_fill(pairs, 0) if isinstance(pairs, Tensor) else piece
            torch.dot(outside, outside, out=row[0])
        self._pass_done()
        sums = partial.double().sum(0)
        return sums[0], list(sums[1:])

    def combine_(
        self,
        out: Tensor,
        kd: Tensor,
        x: Tensor,
        kx: Tensor,
        xp: Tensor | None,
        kxp: Tensor | None,
        point: Tensor | None = None,
    ) -> Tensor:
        """``out <- kd c out + kx x + kxp xp`` (``c`` = 1 on the claimed entries), run by
        run; the scalars are 0-d tensors of ``out``'s dtype. With ``point`` (the straight
        step only), also ``point <- theta + out`` on every entry, in the same pass;
        ``point`` may be ``xp``'s buffer (each run is read before it is written)."""
        if point is not None and self.exp:
            raise ValueError("the exponential step cannot be written in the same pass")
        for run in self.runs:
            s, e = run.start, run.end
            piece = out[s:e]
            c = self._c(run, claimed=1.0)
            piece.mul_(kd if c is None else c.mul_(kd)).addcmul_(x[s:e], kx)
            if xp is not None:
                piece.addcmul_(xp[s:e], kxp)
            if point is not None:
                thetas = [theta for theta, _, _ in run.pieces]
                if len(thetas) == 1:
                    torch.add(thetas[0], piece, out=point[s:e])
                else:
                    torch.cat(thetas, out=point[s:e]).add_(piece)
        self._pass_done()
        return out

    # -- the straight step with the iterate held as its point (a narrower gradient) ------
    #
    # For a half-precision model the gradient is kept in a half-width dtype and the
    # iterate ``x`` in the buffer of its point ``theta + x``: the forward reads it there,
    # and the next step reads it back as ``x``, run by run, exactly where
    # ``|x| <= |theta|`` (Sterbenz), else to the point's round-off.

    def _theta_run(self, run: _Run) -> Tensor:
        thetas = [theta for theta, _, _ in run.pieces]
        return thetas[0] if len(thetas) == 1 else torch.cat(thetas)

    def held_direction_(
        self, grad: Tensor, x: Tensor, others: Sequence[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """``x <- x - theta`` first (``x`` held its point); then ``sum (c grad)^2`` and
        ``<y, grad>`` for each ``y`` of ``(x, *others)``, in one pass, run by run, in the
        tangents' dtype (0-d float64 sums of this process's entries). ``grad`` (in a
        narrower dtype) is read, not written: :meth:`held_combine_` applies ``c^2``.
        Without a pair factor only."""
        ys = (x, *others)
        partial = torch.zeros((len(self.runs), 1 + len(ys)), dtype=self.dtype, device=x.device)
        for i, run in enumerate(self.runs):
            s, e, row = run.start, run.end, partial[i]
            x[s:e].sub_(self._theta_run(run))
            g = grad[s:e].to(self.dtype)
            for j, y in enumerate(ys, 1):
                torch.dot(y[s:e], g, out=row[j])
            c = self._c(run)
            if c is not None:
                g.mul_(c)
            torch.dot(g, g, out=row[0])
        self._pass_done()
        sums = partial.double().sum(0)
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
        """``out <- theta + kd c^2 grad + kx x + kxp xp``, run by run: the next iterate,
        held as its point (``out`` may be ``xp``'s buffer, not ``x``'s)."""
        for run in self.runs:
            s, e = run.start, run.end
            piece = out[s:e]
            if xp is None:
                torch.mul(x[s:e], kx, out=piece)
            else:
                torch.mul(xp[s:e], kxp, out=piece).addcmul_(x[s:e], kx)
            g = grad[s:e].to(self.dtype)
            c = self._c(run)
            if c is not None:
                g.mul_(c).mul_(c)
            piece.addcmul_(g, kd).add_(self._theta_run(run))
        self._pass_done()
        return out

    def held_box_(
        self,
        grad: Tensor,
        x: Tensor,
        xp: Tensor | None,
        out: Tensor,
        eta: float,
        a: float,
        rho: float,
    ) -> Tensor:
        """The L-infinity step of Auto-PGD with the iterate held as its point, run by
        run: ``x <- x - theta`` first (``x`` held its point); ``z = clip(x + eta c sign(grad))``
        into ``|z_j| <= rho c_j``, with momentum (``a != 1``) ``z <- clip(a z + 2(1 - a) x
        - (1 - a) xp)``; ``out <- theta + z`` (``out`` may be ``xp``'s buffer)."""
        for run in self.runs:
            s, e = run.start, run.end
            theta = self._theta_run(run)
            x[s:e].sub_(theta)
            c = self._c(run)
            z = grad[s:e].to(self.dtype).sign_()
            if c is not None:
                z.mul_(c)
            upper = rho if c is None else c.mul_(rho)
            z.mul_(eta).add_(x[s:e]).clamp_(-upper, upper)
            if a != 1.0:
                z.mul_(a).add_(x[s:e], alpha=2.0 * (1.0 - a)).sub_(xp[s:e], alpha=1.0 - a)
                z.clamp_(-upper, upper)
            torch.add(z, theta, out=out[s:e])
        self._pass_done()
        return out

    def hold_(self, x: Tensor, point: bool) -> Tensor:
        """``x <- theta + x`` (``point=True``) or ``x <- x - theta``, in place."""
        for part in self.parts:
            sl = slice(part.start, part.end)
            (x[sl].add_ if point else x[sl].sub_)(part.theta)
        return x

    @property
    def scale(self) -> Tensor:
        ones = torch.ones(self.numel, dtype=self.dtype, device=self.device)
        return ones if self.trivial else self._scale_pieces_(ones)

    @property
    def active(self) -> Tensor | None:
        if not any(part.frozen for part in self.parts):
            return None
        out = torch.ones(self.numel, dtype=torch.bool, device=self.device)
        for part in self.parts:
            if part.frozen:
                out[part.start : part.end] = ~self._frozen_mask(part.theta, part.pairs)
        return out

    # -- metric ---------------------------------------------------------------------------

    def inner(self, x: Tensor, y: Tensor) -> Tensor:
        """``sum_j x_j y_j / c_j^2`` over the entries that may move (0-d, float64)."""
        if self.trivial:
            return dot(x, y, self.chunk)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for s, e, theta, pairs, frozen in self.pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                continue
            inv = torch.where(c > 0, c.reciprocal(), torch.zeros_like(c))
            a = x[s:e] * inv
            b = a if y is x else y[s:e] * inv
            total += torch.dot(a, b).double()
        return total

    def linf_norm(self, xi: Tensor) -> Tensor:
        best = torch.zeros((), dtype=torch.float64, device=xi.device)
        for s, e, theta, pairs, frozen in self.pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                continue
            part = (xi[s:e] / torch.where(c > 0, c, torch.ones_like(c))).abs_()
            part.masked_fill_(c == 0, 0)
            best = torch.maximum(best, part.max().double())
        return best

    def clamp_box_(self, xi: Tensor, rho: float) -> Tensor:
        for s, e, theta, pairs, frozen in self.pieces():
            c = self._scale_piece(theta, pairs, frozen)
            if c is None:
                xi[s:e].zero_()
            else:
                upper = rho * c
                xi[s:e].clamp_(-upper, upper)
        return xi

    def freeze_(self, xi: Tensor) -> Tensor:
        """Zero the frozen entries of ``xi`` in place."""
        for part in self.parts:
            if part.frozen:
                xi[part.start : part.end].masked_fill_(self._frozen_mask(part.theta, part.pairs), 0)
        return xi

    # -- the step -------------------------------------------------------------------------

    def step_(self, xi: Tensor, out: Tensor) -> None:
        """``out <- theta + xi``, or ``theta exp(xi / theta)`` where ``theta != 0`` with
        the exponential step, on every entry (the pair factor then writes its own)."""
        if self.exp:
            for s, e, theta, *_ in self.pieces():
                out[s:e] = exp_step(theta.to(self.dtype), xi[s:e])
            return
        for part in self.parts:
            sl = slice(part.start, part.end)
            torch.add(part.theta, xi[sl], out=out[sl])

    def exp_pullback_(self, xi: Tensor, grad: Tensor) -> None:
        """``grad *= exp(xi / theta)`` where ``theta != 0``, on every entry."""
        for s, e, theta, *_ in self.pieces():
            theta = theta.to(self.dtype)
            nonzero = theta != 0
            ratio = xi[s:e] / torch.where(nonzero, theta, torch.ones_like(theta))
            grad[s:e].mul_(torch.where(nonzero, ratio.exp_(), torch.ones_like(theta)))

    def exp_acceleration_(self, xi: Tensor, out: Tensor) -> None:
        """``out <- xi^2 / theta`` where ``theta != 0``, else 0: the second-order term of
        the exponential step, on every entry."""
        for s, e, theta, *_ in self.pieces():
            theta = theta.to(self.dtype)
            nonzero = theta != 0
            out[s:e] = torch.where(nonzero, xi[s:e].square() / torch.where(nonzero, theta, 1), 0)


def exp_step(theta: Tensor, xi: Tensor) -> Tensor:
    """``theta exp(xi / theta)`` where ``theta != 0``, ``theta + xi`` elsewhere."""
    nonzero = theta != 0
    ratio = torch.where(nonzero, xi / torch.where(nonzero, theta, 1), 0)
    return torch.where(nonzero, theta * torch.exp(ratio), theta + xi)


def dot(x: Tensor, y: Tensor, chunk: int) -> Tensor:
    """Euclidean ``<x, y>`` (0-d, float64), accumulated chunk by chunk in float64."""
    n = x.numel()
    if n <= chunk:
        return torch.dot(x, y).double()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, n, chunk):
        total += torch.dot(x[s : s + chunk], y[s : s + chunk]).double()
    return total
