r"""The tangent space of a whole network at ``theta``, for one geometry.

A full-network tangent ``xi`` is one flat vector shaped like the perturbed parameters
(:class:`~geosharp.params.ParameterLayout`). Entries that belong to a symmetric pair
are read as stacked ``(xiG, xiH)`` blocks (all pairs of the same shape across layers
batched together); every other entry keeps the element-wise geometry

.. math:: \|\xi\|^2 = \sum_j (\xi_j / c_j)^2, \qquad c_j = |\theta_j|
          \text{ (adaptive) or } 1 \text{ (Euclidean)}.

Entries with ``c_j = 0`` cannot move (the ball has no extent along them).

The geometries (MATH.md section 6 and its ablations):

=============================  =================  ================  ===============
name                           ball               horizontal        step
=============================  =================  ================  ===============
``euclidean``                  ``||xi||_2``       --                straight
``adaptive``                   ``||xi / |θ| ||``  --                straight
``geodesic``                   pair metric        projected         2nd-order geodesic
``geodesic-norm-only``         pair metric        projected         straight
``geodesic-curvature-only``    ``||xi / |θ| ||``  --                2nd-order geodesic
=============================  =================  ================  ===============
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..params import ParameterLayout
from ..symmetry.pairs import PairSpec
from .pairs import InvState, MixState, PairMetric, PairState, get_metric
from .subgroup import restrict_state

__all__ = ["GEOMETRIES", "Geometry", "PerturbationSpace", "StackedPairs"]

GEOMETRIES = (
    "euclidean",
    "adaptive",
    "geodesic",
    "geodesic-norm-only",
    "geodesic-curvature-only",
)


@dataclass(frozen=True)
class Geometry:
    """What defines a perturbation: the ball's norm, horizontality, and the step.

    Build with :meth:`named`. ``p`` is 2 (round ball) or ``inf`` (the element-wise box
    of adaptive sharpness in Andriushchenko et al. 2023).
    """

    name: str
    metric: PairMetric | None  # metric of the symmetric pairs (None: no pairs used)
    metric_ball: bool  # ball measured with the pair metric (else element-wise)
    geodesic_step: bool  # second-order geodesic on pairs (else straight line)
    relative: bool  # element-wise scale |theta| (else 1)
    p: float = 2.0
    exp_elementwise: bool = False  # exact GL(1) geodesic theta * exp(xi / theta)

    @classmethod
    def named(
        cls,
        name: str,
        metric: str = "inv",
        eps: float = 0.0,
        p: float = 2.0,
        elementwise_step: str = "straight",
    ) -> Geometry:
        if name not in GEOMETRIES:
            raise ValueError(f"unknown geometry {name!r}: choose one of {', '.join(GEOMETRIES)}")
        if p not in (2, 2.0, float("inf")):
            raise ValueError(f"p must be 2 or float('inf'), got {p!r}")
        if p != 2 and name != "adaptive":
            raise ValueError(
                f"the L-infinity ball is defined for 'adaptive' only, not for {name!r}"
            )
        if elementwise_step not in ("straight", "exp"):
            raise ValueError("elementwise_step must be 'straight' or 'exp'")
        exp = elementwise_step == "exp"
        if exp and name == "euclidean":
            raise ValueError("the exponential element-wise step needs a relative scale")
        if name == "euclidean":
            return cls(name, None, False, False, relative=False)
        if name == "adaptive":
            return cls(name, None, False, False, relative=True, p=float(p), exp_elementwise=exp)
        pair_metric = get_metric(metric, eps)
        full = f"{name}[{pair_metric.name}]"
        if name == "geodesic":
            return cls(full, pair_metric, True, True, True, exp_elementwise=exp)
        if name == "geodesic-norm-only":
            return cls(full, pair_metric, True, False, True, exp_elementwise=exp)
        return cls(full, pair_metric, False, True, True, exp_elementwise=exp)


@dataclass
class StackedPairs:
    """Pairs of one shape ``(n, m, h)`` and one symmetry group, stacked over heads and
    layers.

    ``g_index`` (``(B, n, h)``) and ``h_index`` (``(B, m, h)``) hold positions in the flat
    parameter vector; ``state`` is the pair geometry at the base point; ``group`` the
    symmetry group of the pairs (``"GL"`` or a subgroup, see
    :mod:`geosharp.geometry.subgroup`).

    Reads and writes of contiguous flat vectors go through strided views when the
    indices allow it (:func:`strided_segments`: a head of a linear layer is one strided
    block of its weight plus a row of its bias), which is several times faster than
    indexing; other layouts, and non-contiguous vectors, use the indices.
    """

    specs: list[PairSpec]
    g_index: Tensor
    h_index: Tensor
    state: PairState | None = None
    group: str = "GL"

    def __post_init__(self) -> None:
        self._segments = (strided_segments(self.g_index), strided_segments(self.h_index))

    def gather(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """The ``(G, H)`` entries of ``flat`` as new ``(B, n, h)`` and ``(B, m, h)`` blocks."""
        if self._strided(flat):
            return tuple(  # type: ignore[return-value]
                _gather_strided(flat, segs, index.shape)
                for segs, index in zip(self._segments, (self.g_index, self.h_index))
            )
        return flat[self.g_index], flat[self.h_index]

    def scatter(self, flat: Tensor, blocks: tuple[Tensor, Tensor]) -> Tensor:
        """``flat`` with this pair's entries replaced by ``blocks`` (out of place)."""
        out = flat.index_copy(0, self.g_index.reshape(-1), blocks[0].reshape(-1))
        return out.index_copy(0, self.h_index.reshape(-1), blocks[1].reshape(-1))

    def scatter_(self, flat: Tensor, blocks: tuple[Tensor, Tensor]) -> Tensor:
        """:meth:`scatter` in place."""
        if self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                _write_strided(flat, segs, block.to(flat.dtype), accumulate=False)
            return flat
        flat.index_copy_(0, self.g_index.reshape(-1), blocks[0].reshape(-1).to(flat.dtype))
        return flat.index_copy_(0, self.h_index.reshape(-1), blocks[1].reshape(-1).to(flat.dtype))

    def add_(self, flat: Tensor, blocks: tuple[Tensor, Tensor], alpha: float = 1.0) -> Tensor:
        """Add ``alpha * blocks`` to this pair's entries of ``flat``, in place."""
        if self._strided(flat):
            for segs, block in zip(self._segments, blocks):
                _write_strided(flat, segs, block.to(flat.dtype), accumulate=True, alpha=alpha)
            return flat
        for index, block in zip((self.g_index, self.h_index), blocks):
            flat.index_add_(0, index.reshape(-1), block.reshape(-1).to(flat.dtype), alpha=alpha)
        return flat

    def _strided(self, flat: Tensor) -> bool:
        return (
            self._segments[0] is not None
            and self._segments[1] is not None
            and flat.dim() == 1
            and flat.is_contiguous()
            and not (flat.requires_grad and torch.is_grad_enabled())  # autograd: index
        )


Segment = tuple[int, int, int, int, int, int, int, int]


def strided_segments(index: Tensor, max_segments: int | None = None) -> list[Segment] | None:
    """Cover a ``(B, n, h)`` block of flat positions by few strided views.

    Each segment ``(b0, nb, r0, nr, offset, sb, sr, sc)`` says that
    ``index[b0:b0+nb, r0:r0+nr, :]`` equals ``offset + b sb + r sr + c sc`` (``b, r, c``
    counted from the segment's start): a view ``flat.as_strided((nb, nr, h), (sb, sr,
    sc), offset)``. Returns ``None`` when the block is not made of such pieces (or needs
    more than ``max_segments``, default ``4 B + 16``): callers then index.

    >>> base = torch.arange(24).view(4, 6)  # a (4 x 6) weight; 2 heads of 2 rows each
    >>> index = torch.stack([base[0:2].T, base[2:4].T])  # (2, 6, 2): G = W_head^T
    >>> strided_segments(index)
    [(0, 2, 0, 6, 0, 12, 1, 6)]
    """
    if index.dim() != 3 or index.numel() == 0:
        return None
    B, n, h = index.shape
    limit = 4 * B + 16 if max_segments is None else max_segments
    idx = index.detach().to("cpu", torch.int64)
    start = idx[:, :, 0]
    col = idx[:, :, 1] - idx[:, :, 0] if h > 1 else torch.ones_like(start)
    if h > 1 and not torch.equal(idx, start[..., None] + torch.arange(h) * col[..., None]):
        return None
    # Runs of rows with one column stride and one row stride, per head. Rows where the
    # column stride or the row step changes are found at once; the runs are then cut
    # greedily at those rows only.
    step = torch.zeros_like(start)
    step[:, 1:] = start[:, 1:] - start[:, :-1]
    change = torch.zeros_like(start, dtype=torch.bool)
    change[:, 1:] = col[:, 1:] != col[:, :-1]
    change[:, 2:] |= step[:, 2:] != step[:, 1:-1]
    heads_at, rows_at = change.nonzero(as_tuple=True)
    changes: list[list[int]] = [[] for _ in range(B)]
    for b, r in zip(heads_at.tolist(), rows_at.tolist()):
        changes[b].append(r)
    col_l, start_l, step_l = col.tolist(), start.tolist(), step.tolist()
    runs_per_head: list[list[tuple[int, int, int, int]]] = []  # (r0, nr, sr, sc)
    for b in range(B):
        runs, r0, cuts = [], 0, changes[b]
        while r0 < n:
            if r0 + 1 < n and col_l[b][r0 + 1] == col_l[b][r0]:
                k = bisect.bisect_right(cuts, r0 + 1)
                r1 = cuts[k] if k < len(cuts) else n
                sr = step_l[b][r0 + 1]
            else:
                r1, sr = r0 + 1, 0
            runs.append((r0, r1 - r0, sr, col_l[b][r0]))
            r0 = r1
        if len(runs) > limit:
            return None
        runs_per_head.append(runs)
    # Merge consecutive heads with the same runs; each run then steps through memory by
    # its own constant offset from head to head (a weight block and a bias row do not).
    segments: list[Segment] = []
    b0 = 0
    while b0 < B:
        runs = runs_per_head[b0]
        b1 = b0 + 1
        while b1 < B and runs_per_head[b1] == runs:
            b1 += 1
        for r0, nr, sr, sc in runs:
            offsets = [start_l[b][r0] for b in range(b0, b1)]
            i = 0
            while i < len(offsets):
                j, step = i + 1, 0
                if j < len(offsets):
                    step = offsets[j] - offsets[i]
                    while j < len(offsets) and offsets[j] - offsets[j - 1] == step:
                        j += 1
                segments.append((b0 + i, j - i, r0, nr, offsets[i], step, sr, sc))
                i = j
        b0 = b1
        if len(segments) > limit:
            return None
    # Negative strides cannot be viewed; a zero stride over several heads or rows would
    # repeat positions (writes through such a view are ill-defined): index instead.
    for _, nb, _, nr, _, sb, sr, sc in segments:
        if min(sb, sr, sc) < 0 or (sb == 0 and nb > 1) or (sr == 0 and nr > 1) or sc == 0:
            return None
    return segments


def _view(flat: Tensor, seg: Segment, h: int) -> Tensor:
    _, nb, _, nr, offset, sb, sr, sc = seg
    return flat.as_strided((nb, nr, h), (sb, sr, sc), flat.storage_offset() + offset)


def _gather_strided(flat: Tensor, segments: list[Segment], shape: torch.Size) -> Tensor:
    out = torch.empty(shape, dtype=flat.dtype, device=flat.device)
    for seg in segments:
        b0, nb, r0, nr = seg[:4]
        out[b0 : b0 + nb, r0 : r0 + nr].copy_(_view(flat, seg, shape[-1]))
    return out


def _write_strided(
    flat: Tensor, segments: list[Segment], block: Tensor, accumulate: bool, alpha: float = 1.0
) -> None:
    h = block.shape[-1]
    for seg in segments:
        b0, nb, r0, nr = seg[:4]
        view, part = _view(flat, seg, h), block[b0 : b0 + nb, r0 : r0 + nr]
        if not accumulate:
            view.copy_(part)
        elif alpha == 1.0:
            view.add_(part)
        else:
            view.add_(part, alpha=alpha)


def stack_pairs(
    pairs: Sequence[PairSpec], layout: ParameterLayout, device: torch.device
) -> list[StackedPairs]:
    """Group pairs by shape and symmetry group and translate their indices into flat
    positions."""
    groups: dict[tuple[int, int, int, str], list[PairSpec]] = defaultdict(list)
    for pair in pairs:
        _, n, m, h = pair.shape
        groups[(n, m, h, pair.group)].append(pair)

    def flat_index(blocks) -> Tensor:
        return torch.cat([layout.offset(b.param) + b.index for b in blocks], dim=1)

    out = []
    for (*_, group), specs in groups.items():
        g = torch.cat([flat_index(s.g_blocks) for s in specs]).to(device)
        h = torch.cat([flat_index(s.h_blocks) for s in specs]).to(device)
        out.append(StackedPairs(specs, g, h, group=group))
    return out


class PerturbationSpace:
    """Tangent space at the flat point ``theta`` for a :class:`Geometry`.

    Operations mirror geoopt's manifold interface: :meth:`inner`, :meth:`proju`
    (horizontal projection), :meth:`egrad2rgrad`, :meth:`retr` (the perturbed point
    ``gamma_xi(1)``), plus :meth:`random` (a Gaussian in the metric).

    Besides ``theta`` the space keeps one parameter-sized vector, the element-wise scale
    ``scale`` (``c_j``, zero on frozen entries and on pair entries of pair-ball
    geometries), and a boolean mask ``active`` of the entries a perturbation may use
    (``None`` when all may). The in-place methods :meth:`retr_`, :meth:`pullback_`,
    :meth:`split_direction_` and :meth:`combine_` serve Auto-PGD's inner loop without
    parameter-sized temporaries.
    """

    def __init__(
        self,
        theta: Tensor,
        layout: ParameterLayout,
        pairs: Sequence[PairSpec],
        geometry: Geometry,
    ):
        if theta.dim() != 1 or theta.numel() != layout.numel:
            raise ValueError("theta must be the flat vector of the layout's parameters")
        self.theta = theta.detach()
        self.layout = layout
        self.geometry = geometry
        use_pairs = geometry.metric is not None
        self.blocks = stack_pairs(pairs, layout, theta.device) if use_pairs else []
        for block in self.blocks:
            state = geometry.metric.state(*block.gather(self.theta))
            block.state = restrict_state(state, block.group)
        self._metric_blocks = self.blocks if geometry.metric_ball else []
        pair_entries = [
            index.reshape(-1)
            for block in self._metric_blocks
            for index in (block.g_index, block.h_index)
        ]

        # Element-wise scale c: |theta| (relative) or 1; entries below sqrt(tiny) are
        # frozen (1/c would overflow and c^2 underflow), and so, for the element-wise
        # metric, are pair entries of pair-ball geometries (their metric is the pair's).
        self._unit = not geometry.relative  # c = 1 everywhere, every entry active
        if self._unit:
            self.scale = torch.ones_like(self.theta)
        else:
            self.scale = self.theta.abs()
            self.scale.masked_fill_(self.scale <= torch.finfo(self.scale.dtype).tiny ** 0.5, 0)
        for index in pair_entries:
            self.scale.index_fill_(0, index, 0)
        # Entries a perturbation may use: movable element-wise ones, and pair entries.
        active = self.scale > 0
        for index in pair_entries:
            active.index_fill_(0, index, True)
        self.active: Tensor | None = None if bool(active.all()) else active
        # Element-wise work on CPU goes chunk by chunk (cache-sized temporaries); a GPU
        # takes the vector in a few large pieces.
        self._chunk = (1 << 18) if theta.device.type == "cpu" else (1 << 26)
        self._retr_saved = None  # h x h matrices of the last retr_, for pullback_
        self._grad_blocks = None  # pair blocks of the last pullback_, for split_direction_

    @property
    def inv_scale(self) -> Tensor:
        """``1 / c`` on element-wise entries that may move, else 0 (computed on demand)."""
        scale = self.scale
        return torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))

    def _chunks(self):
        n, step = self.theta.numel(), self._chunk
        return ((s, min(n, s + step)) for s in range(0, n, step))

    def dot(self, x: Tensor, y: Tensor) -> Tensor:
        """Euclidean ``<x, y>`` (0-d, float64), accumulated chunk by chunk in float64: a
        single float32 dot product of 10^8 entries can be off by 1e-3."""
        return _dot(x, y, self._chunk)

    # -- metric ---------------------------------------------------------------------------

    def inner(self, xi: Tensor, eta: Tensor) -> Tensor:
        """``g(xi, eta)`` (0-d tensor, float64)."""
        total = self._elementwise_inner(xi, eta)
        for block in self._metric_blocks:
            total = total + block.state.inner(block.gather(xi), block.gather(eta)).sum()
        return total

    def _elementwise_inner(self, x: Tensor, y: Tensor) -> Tensor:
        if self._unit:
            return self.dot(x, y)
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for s, e in self._chunks():
            c = self.scale[s:e]
            inv = torch.where(c > 0, c.reciprocal(), torch.zeros_like(c))
            a = x[s:e] * inv
            b = a if y is x else y[s:e] * inv
            total += torch.dot(a, b).double()
        return total

    def norm(self, xi: Tensor) -> Tensor:
        if self.geometry.p == float("inf"):
            return self.linf_norm(xi)
        return self.inner(xi, xi).clamp_min(0).sqrt()

    def linf_norm(self, xi: Tensor) -> Tensor:
        best = torch.zeros((), dtype=torch.float64, device=xi.device)
        for s, e in self._chunks():
            c = self.scale[s:e]
            part = (xi[s:e] / torch.where(c > 0, c, torch.ones_like(c))).abs_()
            part.masked_fill_(c == 0, 0)
            best = torch.maximum(best, part.max().double())
        return best

    # -- projections ----------------------------------------------------------------------

    def proju(self, xi: Tensor) -> Tensor:
        """Zero the frozen entries and project every pair onto its horizontal space."""
        return self.proju_(xi.clone())

    def proju_(self, xi: Tensor) -> Tensor:
        """:meth:`proju` in place (returns ``xi``)."""
        if self.active is not None:
            xi.mul_(self.active)
        for block in self._metric_blocks:
            x = block.gather(xi)
            state = block.state
            block.scatter_(xi, _project(state, x) if _fast(state) else state.project_horizontal(x))
        return xi

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Riemannian gradient: ``c^2 * g`` element-wise, section 4 on pairs."""
        return self.egrad2rgrad_(egrad.clone())

    def egrad2rgrad_(self, egrad: Tensor) -> Tensor:
        """:meth:`egrad2rgrad` in place (returns ``egrad``)."""
        pair_grads = [b.state.egrad2rgrad(b.gather(egrad)) for b in self._metric_blocks]
        if not self._unit:
            egrad.mul_(self.scale).mul_(self.scale)
        for block, grad in zip(self._metric_blocks, pair_grads):
            block.scatter_(egrad, grad)
        return egrad

    def horizontal_residual(self, xi: Tensor) -> Tensor:
        """Largest ``|R|`` over pairs, relative to the size of ``xi``: 0 iff horizontal."""
        worst = torch.zeros((), dtype=torch.float64, device=xi.device)
        for block in self._metric_blocks:
            R = block.state.horizontal_residual(block.gather(xi))
            worst = torch.maximum(worst, R.abs().amax())
        return worst / self.norm(xi).clamp_min(1e-300)

    # -- Auto-PGD's inner loop, in place ---------------------------------------------------

    def split_direction_(self, egrad: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        r"""Start the ascent direction ``d = proju(egrad2rgrad(egrad))`` in place.

        Element-wise entries of ``egrad`` become ``c * egrad`` (``d = c^2 egrad`` there:
        :meth:`combine_` applies the second ``c``); the pair blocks of ``d`` are returned.
        Also returns ``||d||^2`` (float64, 0-d), as ``<d, egrad>`` (Euclidean): the
        Riemannian gradient represents ``egrad`` in the metric and ``d`` is horizontal.
        """
        sq = torch.zeros((), dtype=torch.float64, device=egrad.device)
        pair_dirs = []
        cached = self._grad_blocks
        self._grad_blocks = None
        reuse = cached is not None and cached[0] is egrad and cached[1] == egrad._version
        for i, block in enumerate(self._metric_blocks):
            state = block.state
            g = cached[2][i] if reuse else block.gather(egrad)
            if _fast(state):
                d = _direction(state, g)
            else:
                d = state.project_horizontal(state.egrad2rgrad(g))
            for dx, gx in zip(d, g):
                sq = sq + _block_dot(dx, gx)
            pair_dirs.append(d)
        if not self._unit:
            egrad.mul_(self.scale)  # zero on pair entries of pair balls and frozen entries
        return sq + self.dot(egrad, egrad), pair_dirs

    def combine_(
        self,
        out: Tensor,
        pair_dirs: list[tuple[Tensor, Tensor]],
        kd: Tensor,
        x: Tensor,
        kx: Tensor,
        xp: Tensor | None = None,
        kxp: Tensor | None = None,
    ) -> Tensor:
        """``out <- kd d + kx x + kxp xp`` where ``out`` and ``pair_dirs`` come from
        :meth:`split_direction_` (scalars: 0-d tensors, so nothing waits for the device)."""
        if not self._unit:
            out.mul_(self.scale)
        for block, d in zip(self._metric_blocks, pair_dirs):
            block.scatter_(out, d)  # pair entries of `out` are zero here
        out.mul_(kd).addcmul_(x, kx)
        if xp is not None:
            out.addcmul_(xp, kxp)
        return out

    def retr_(self, xi: Tensor, out: Tensor) -> Tensor:
        """:meth:`retr` written into ``out`` (not differentiable; returns ``out``)."""
        if self.geometry.exp_elementwise:
            with torch.no_grad():
                return out.copy_(self.retr(xi))
        torch.add(self.theta, xi, out=out)
        saved = []
        if self.geometry.geodesic_step:
            with torch.no_grad():
                for block in self.blocks:
                    x = block.gather(xi)
                    if _fast(block.state):
                        accel, matrices = _acceleration(block.state, x)
                        saved.append(matrices)
                    else:
                        accel = block.state.geodesic_acceleration(x)
                    block.add_(out, accel, alpha=0.5)
        self._retr_saved = (xi, xi._version, saved)
        return out

    def pullback_(self, xi: Tensor, grad: Tensor) -> Tensor:
        """Turn ``grad``, the gradient at ``retr(xi)``, into the gradient with respect to
        ``xi``, in place: the step is the identity but for the geodesic correction of
        pairs (for ``elementwise_step="exp"`` differentiate :meth:`retr` instead)."""
        if self.geometry.exp_elementwise:
            raise NotImplementedError("pullback_ needs the straight element-wise step")
        if not self.geometry.geodesic_step:
            return grad
        known = self._retr_saved
        self._retr_saved = None
        saved = known[2] if known is not None and known[0] is xi and known[1] == xi._version else []
        fast_blocks = iter(saved)
        blocks_out = []
        with torch.no_grad():
            for block in self.blocks:
                u = block.gather(grad)
                x = block.gather(xi)
                if _fast(block.state):
                    matrices = next(fast_blocks, None)
                    if matrices is None:
                        matrices = _acceleration(block.state, x)[1]
                    g = _pullback(block.state, x, u, matrices)
                else:
                    x = tuple(t.requires_grad_(True) for t in x)
                    with torch.enable_grad():
                        vjp = torch.autograd.grad(block.state.geodesic_acceleration(x), x, u)
                    g = (u[0].add_(vjp[0], alpha=0.5), u[1].add_(vjp[1], alpha=0.5))
                block.scatter_(grad, g)
                blocks_out.append(g)
        if self.geometry.metric_ball:  # split_direction_ may reuse the blocks
            self._grad_blocks = (grad, grad._version, blocks_out)
        return grad

    # -- sampling and stepping ------------------------------------------------------------

    def random(self, generator: torch.Generator | None = None) -> Tensor:
        """A Gaussian tangent in the metric, projected (not normalised).

        Pair blocks are drawn equivariantly (:func:`equivariant_gaussian`): with the same
        generator state, symmetry-related networks get symmetry-related samples.
        """
        z = torch.randn(
            self.theta.shape,
            generator=generator,
            dtype=self.theta.dtype,
            device=self.theta.device,
        )
        out = z if self._unit else z.mul_(self.scale)
        for block in self._metric_blocks:
            sample = equivariant_gaussian(
                block.state,
                self.geometry.metric.name,
                generator,
                eps=getattr(self.geometry.metric, "eps", 0.0),
            )
            block.scatter_(out, sample)
        return self.proju_(out)

    def retr(self, xi: Tensor) -> Tensor:
        """The perturbed point ``gamma_xi(1)`` as a flat vector (differentiable in ``xi``)."""
        geometry = self.geometry
        if geometry.exp_elementwise:
            theta = self.theta
            ratio = torch.where(theta != 0, xi / torch.where(theta != 0, theta, 1), 0)
            moved = torch.where(theta != 0, theta * torch.exp(ratio), theta + xi)
            # Pair entries keep the straight line (plus the geodesic correction below).
            out = self._straight_on_pairs(moved, xi)
        else:
            out = self.theta + xi
        if geometry.geodesic_step:
            for block in self.blocks:
                aG, aH = block.state.geodesic_acceleration(block.gather(xi))
                out = out.index_add_(0, block.g_index.reshape(-1), aG.reshape(-1), alpha=0.5)
                out = out.index_add_(0, block.h_index.reshape(-1), aH.reshape(-1), alpha=0.5)
        return out

    def _straight_on_pairs(self, moved: Tensor, xi: Tensor) -> Tensor:
        out = moved
        for block in self.blocks:
            g_th, h_th = block.gather(self.theta)
            g_xi, h_xi = block.gather(xi)
            out = block.scatter(out, (g_th + g_xi, h_th + h_xi))
        return out


# -- fast pair kernels for Auto-PGD's inner loop ------------------------------------------
#
# The same maths as :mod:`geosharp.geometry.pairs` for InvState and MixState (tested
# against it), arranged for speed: the large (n x h) products run in the tangent's dtype,
# fused with ``baddbmm``; the h x h algebra of the projection runs in float64 as there;
# the vector-Jacobian product of the geodesic correction is written out (no autograd).
# Other states (subgroups) take the general path.


def _dot(x: Tensor, y: Tensor, chunk: int) -> Tensor:
    n = x.numel()
    if n <= chunk:
        return torch.dot(x, y).double()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for s in range(0, n, chunk):
        total += torch.dot(x[s : s + chunk], y[s : s + chunk]).double()
    return total


def _fast(state: PairState | None) -> bool:
    return type(state) in (InvState, MixState)


def _t(x: Tensor) -> Tensor:
    return x.transpose(-1, -2)


def _sym(x: Tensor) -> Tensor:
    return x + _t(x)


def _block_dot(a: Tensor, b: Tensor) -> Tensor:
    """Euclidean ``<a, b>`` of two blocks (0-d, float64)."""
    return _dot(a.reshape(-1), b.reshape(-1), 1 << 22)


def _acceleration(state: PairState, x: tuple[Tensor, Tensor]):
    """``state.geodesic_acceleration(x)`` and the h x h matrices its VJP reuses."""
    dt = x[0].dtype
    G, H = state._cast("G", dt), state._cast("H", dt)
    P_inv, Q_inv = state._cast("P_inv", dt), state._cast("Q_inv", dt)
    xG, xH = x
    if isinstance(state, InvState):
        out, saved = [], []
        for xx, B, B_inv in ((xG, G, P_inv), (xH, H, Q_inv)):
            M = B_inv @ _sym(_t(xx) @ B)
            N = B_inv @ (_t(xx) @ xx)
            out.append(torch.bmm(xx, M).baddbmm_(B, N, alpha=-1))
            saved.append(M)
        return tuple(out), tuple(saved)
    Bm = _sym(_t(xH) @ H)  # (xH^T H + H^T xH)
    D = _sym(_t(xG) @ G)
    aG = torch.bmm(G, (_t(xH) @ xH) @ Q_inv).baddbmm_(xG, Bm @ Q_inv, alpha=-1)
    aH = torch.bmm(H, (_t(xG) @ xG) @ P_inv).baddbmm_(xH, D @ P_inv, alpha=-1)
    return (aG, aH), (Bm, D)


def _pullback(state: PairState, x, u, saved) -> tuple[Tensor, Tensor]:
    """``u + 0.5 J^T u`` with ``J`` the Jacobian of the acceleration at ``x``."""
    dt = u[0].dtype
    G, H = state._cast("G", dt), state._cast("H", dt)
    P_inv, Q_inv = state._cast("P_inv", dt), state._cast("Q_inv", dt)
    eye = torch.eye(G.shape[-1], dtype=dt, device=G.device)
    xG, xH = x
    uG, uH = u
    if isinstance(state, InvState):
        out = []
        for xx, B, B_inv, uu, M in ((xG, G, P_inv, uG, saved[0]), (xH, H, Q_inv, uH, saved[1])):
            # a = x M - B N: J^T u = u M^T + B (S^T B^-1 + B^-1 S) - x (T^T B^-1 + B^-1 T),
            # S = x^T u, T = B^T u (B^-1 symmetric).
            S, T = _t(xx) @ uu, _t(B) @ uu
            K2 = _t(S) @ B_inv + B_inv @ S
            K1 = _t(T) @ B_inv + B_inv @ T
            g = torch.bmm(uu, eye + 0.5 * _t(M))
            out.append(g.baddbmm_(B, K2, alpha=0.5).baddbmm_(xx, K1, alpha=-0.5))
        return out[0], out[1]
    Bm, D = saved
    # aG = (G A - xG Bm) Q^-1, aH = (H C - xH D) P^-1 (A = xH^T xH, C = xG^T xG): with
    # E = G^T uG Q^-1, F = xG^T uG Q^-1, E' = H^T uH P^-1, F' = xH^T uH P^-1,
    # J^T u = (-uG Q^-1 Bm + xG sym(E') - G sym(F'), -uH P^-1 D + xH sym(E) - H sym(F)).
    E, F = (_t(G) @ uG) @ Q_inv, (_t(xG) @ uG) @ Q_inv
    E2, F2 = (_t(H) @ uH) @ P_inv, (_t(xH) @ uH) @ P_inv
    gG = torch.bmm(uG, eye - 0.5 * (Q_inv @ Bm))
    gG.baddbmm_(xG, _sym(E2), alpha=0.5).baddbmm_(G, _sym(F2), alpha=-0.5)
    gH = torch.bmm(uH, eye - 0.5 * (P_inv @ D))
    gH.baddbmm_(xH, _sym(E), alpha=0.5).baddbmm_(H, _sym(F), alpha=-0.5)
    return gG, gH


def _vertical_coefficient(state: PairState, gram_g: Tensor, gram_h: Tensor) -> Tensor:
    """``L`` of the g-orthogonal projection of a tangent ``x`` (float64), from the two
    h x h reductions ``x_G^T G`` and ``H^T x_H`` (any dtype)."""
    A, B = gram_g.double(), gram_h.double()
    if isinstance(state, InvState):
        # C = x_G^T G Q - P H^T x_H; A X + X B' = C solved in the eigenbases (pairs.py).
        C = A @ state.Q - state.P @ B
        Y = state.S_inv @ C @ state.T
        denom = state.d.unsqueeze(-1) + state.e.unsqueeze(-2)
        tol = denom.shape[-1] * torch.finfo(torch.float64).eps * denom.amax((-1, -2), keepdim=True)
        Y = torch.where(denom > tol, Y / torch.where(denom > tol, denom, 1.0), 0.0)
        return _t(state.S @ Y @ state.T_inv)
    # mix: L = (P^-1 G^T x_G - x_H^T H Q^-1) / 2
    return 0.5 * (state.P_inv @ _t(A) - _t(B) @ state.Q_inv)


def _project(state: PairState, x: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """``state.project_horizontal(x)``: two h x h reductions, the float64 solve, and the
    correction ``(x_G - G L, x_H + H L^T)`` fused into one ``baddbmm`` each, in ``x``'s
    dtype."""
    dt = x[0].dtype
    G, H = state._cast("G", dt), state._cast("H", dt)
    L = _vertical_coefficient(state, _t(x[0]) @ G, _t(H) @ x[1]).to(dt)
    return torch.baddbmm(x[0], G, L, alpha=-1), torch.baddbmm(x[1], H, _t(L))


def _direction(state: PairState, g: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """``state.project_horizontal(state.egrad2rgrad(g))``, the Riemannian gradient never
    formed before the projection: its reductions are those of ``g`` times h x h
    matrices."""
    dt = g[0].dtype
    G, H = state._cast("G", dt), state._cast("H", dt)
    gG, gH = g
    gram_g, gram_h = (_t(gG) @ G).double(), (_t(H) @ gH).double()
    if isinstance(state, InvState):  # rgrad = (gG P, gH Q)
        L = _vertical_coefficient(state, state.P @ gram_g, gram_h @ state.Q)
        A, B = state._cast("P", dt), state._cast("Q", dt)
    else:  # rgrad = (gG Q^-1, gH P^-1)
        L = _vertical_coefficient(state, state.Q_inv @ gram_g, gram_h @ state.P_inv)
        A, B = state._cast("Q_inv", dt), state._cast("P_inv", dt)
    L = L.to(dt)
    return torch.bmm(gG, A).baddbmm_(G, L, alpha=-1), torch.bmm(gH, B).baddbmm_(H, _t(L))


def equivariant_gaussian(
    state: PairState,
    metric: str,
    generator: torch.Generator | None = None,
    chunk: int = 1 << 22,
    eps: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """A Gaussian pair tangent in the metric whose draw commutes with the group action.

    ``inv``: ``xiG = W G``, ``xiH = W' H`` with standard Gaussian ``W`` (``n x n``),
    ``W'`` (``m x m``): the rows of ``xiG`` are ``N(0, P)``, the law of ``Z P^{1/2}``.
    ``mix``: ``xiG = W H Q^{-1}``, ``xiH = W' G P^{-1}`` (rows ``N(0, Q^{-1})`` and
    ``N(0, P^{-1})``). Under ``(G, H) -> (G A, H A^{-T})`` each sample maps to
    ``(xiG A, xiH A^{-T})``, so symmetry-related networks see related directions.
    Heads are drawn in chunks of at most ``chunk`` Gaussian numbers.

    ``inv`` with ``eps > 0`` (metric of ``P + eps I``, ``Q + eps I``) adds independent
    ``sqrt(eps) Z`` so that the rows are ``N(0, P + eps I)``; like the relaxed metric,
    this is equivariant only up to ``O(eps)``.
    """
    G, H = state.G, state.H
    heads, n, _ = G.shape
    m = H.shape[1]
    if metric == "inv":
        g_factor, h_factor = G, H
    else:
        g_factor, h_factor = H @ state.Q_inv, G @ state.P_inv
    step = max(1, chunk // max(n * g_factor.shape[1], m * h_factor.shape[1]))
    parts_g, parts_h = [], []
    for start in range(0, heads, step):
        sl = slice(start, start + step)
        count = g_factor[sl].shape[0]
        W = torch.randn(
            count, n, g_factor.shape[1], generator=generator, dtype=G.dtype, device=G.device
        )
        parts_g.append(W @ g_factor[sl])
        W = torch.randn(
            count, m, h_factor.shape[1], generator=generator, dtype=G.dtype, device=G.device
        )
        parts_h.append(W @ h_factor[sl])
    xiG, xiH = torch.cat(parts_g), torch.cat(parts_h)
    if metric == "inv" and eps:
        root = eps**0.5
        xiG = xiG + root * torch.randn(G.shape, generator=generator, dtype=G.dtype, device=G.device)
        xiH = xiH + root * torch.randn(H.shape, generator=generator, dtype=H.dtype, device=H.device)
    return xiG, xiH
