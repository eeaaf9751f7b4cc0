r"""``GeodesicSAM``: sharpness-aware minimisation in a measure's geometry.

SAM (Foret et al. 2021) takes the gradient at an ascent point ``w + e`` and applies it
at ``w``; ASAM (Kwon et al. 2021) scales the ascent by ``|w|``. Both move along
directions that the symmetries of attention make meaningless: two networks that compute
the same function get different ascent points and different updates. Here the ascent
is the worst-case direction of the chosen geometry to first order,

.. math:: \xi = \rho \, \frac{d}{\|d\|_g}, \qquad d = \mathrm{proj}_h(\mathrm{grad}_g L),

the normalised horizontal Riemannian gradient, and the ascent point is the measure's
own step ``gamma_xi(1)`` (second-order geodesic on attention pairs). With
``measure="euclidean"`` this is SAM, with ``"adaptive"`` ASAM (its ``eta = 0``), with
``"geodesic-inv"``/``"geodesic-mix"`` the symmetry-invariant version: networks related
by a symmetry reach related ascent points, hence the same ascent loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..geometry.space import PerturbationSpace
from ..symmetry.pairs import Symmetries

__all__ = ["GeodesicSAM"]


def _local(t: Tensor) -> Tensor:
    """A ``DTensor``'s local slice (FSDP2), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class GeodesicSAM(torch.optim.Optimizer):
    """Wrap ``base_optimizer`` so that each step uses the gradient at the ascent point.

    Args:
        model: the model whose parameters (those that require grad) are trained; its
            symmetries are found once here (or pass ``symmetries``).
        base_optimizer: an optimizer class (built over the model's parameters with
            ``**kwargs``, e.g. ``torch.optim.AdamW, lr=1e-3``) or an instance built over
            them already.
        rho: radius of the ascent in the measure's norm (``0``: the base optimizer).
        measure: ``"geodesic-inv"`` (default), ``"geodesic-mix"``, ``"adaptive"``
            (ASAM) or ``"euclidean"`` (SAM), or any name of
            :data:`geosharp.measures.MEASURES` with a round ball.

    Use it as SAM implementations are used::

        loss_fn(model, batch).backward()
        opt.first_step(zero_grad=True)    # to the ascent point
        loss_fn(model, batch).backward()  # clip gradients here if you clip
        opt.second_step(zero_grad=True)   # back, then the base optimizer's step

    or ``opt.step(closure)`` with a closure that zeroes nothing, computes the loss,
    calls ``backward`` and returns the loss. If the second forward/backward raises
    inside :meth:`step`, the weights go back to ``w`` before the error propagates.
    Under DDP, pass the wrapped module (``ddp.module``) here and run the forwards
    through the wrapper. A synchronised first backward ascends along the global
    gradient: the step equals one process's step on the whole batch. Run the first
    backward inside ``ddp.no_sync()`` to ascend along each process's own gradient
    without an all-reduce (as SAM users do): the second backward then averages the
    processes' ascent gradients. Both are tested against one process to 1e-10
    (``tests/test_optim_distributed.py``).

    On a model sharded with FSDP2 (:mod:`geosharp.fsdp`) the step works on each
    process's slices, with the space's sums all-reduced; the first gradient is FSDP's
    average over processes. With the same batches on every process, three steps leave
    the weights of one process's steps on the unsharded model (``tests/test_fsdp.py``).
    """

    def __init__(
        self,
        model: nn.Module,
        base_optimizer,
        rho: float = 0.05,
        measure: str = "geodesic-inv",
        *,
        symmetries: Symmetries | None = None,
        **kwargs,
    ) -> None:
        from ..errors import real_number
        from ..measures.problem import check_model, find_target, geometry_of

        check_model(model)
        rho = real_number(rho, "rho")
        if not (math.isfinite(rho) and rho >= 0):
            raise ValueError(f"rho must be a finite number >= 0, got {rho!r}")
        self.geometry, parameters = geometry_of(measure)
        if parameters is not None:
            raise ValueError(
                f"{measure!r} perturbs a subset of the parameters; GeodesicSAM trains them "
                "all: use the measure without '-attn'"
            )
        if self.geometry.p != 2:
            raise ValueError(f"GeodesicSAM needs a round ball (p=2), not {measure!r}")
        target = find_target(model, self.geometry, parameters, symmetries, means="step")
        if target.upcast:
            raise ValueError("GeodesicSAM trains float32/float64 weights; use autocast for bf16")
        self._named = target.named
        self._layout, self._pairs = target.layout, target.pairs
        # a sharded model (FSDP2): the weights are this process's slices, and w a flat
        # copy of them (the space's base point, refreshed at each step)
        self._local = target.local if target.shards is not None else None
        # there, a flat copy of the slices, which the space views
        self._theta = target.local_flat() if target.shards is not None else target.theta
        params = [p for _, p in self._named]
        if isinstance(base_optimizer, torch.optim.Optimizer):
            if kwargs:
                raise TypeError("pass the base optimizer's options to its constructor")
            held = {id(p) for g in base_optimizer.param_groups for p in g["params"]}
            left_out = [n for n, p in self._named if id(p) not in held]
            if left_out:
                raise ValueError(
                    f"base_optimizer does not hold {len(left_out)} of the model's "
                    f"{len(self._named)} trainable parameters (first: {left_out[0]}), so they "
                    "would not be trained: build it over this model's parameters"
                )
            self.base_optimizer = base_optimizer
        else:
            self.base_optimizer = base_optimizer(params, **kwargs)
        self._initialising = True  # Optimizer.__init__ writes param_groups of its own
        super().__init__(params, dict(rho=float(rho)))
        self._initialising = False
        self.defaults.update(self.base_optimizer.defaults)
        self.rho = float(rho)
        self._saved: Tensor | None = None  # w while the weights are at the ascent point
        # over views of the weights: refreshed at each step, its pair stacking kept
        theta = self._theta if self._local is not None else {n: p.detach() for n, p in self._named}
        self._space_at_w = PerturbationSpace(
            theta, self._layout, self._pairs, self.geometry, shards=target.shards
        )

    @property
    def param_groups(self) -> list[dict]:
        """The base optimizer's own list, whatever replaced it (``load_state_dict``,
        accelerate's device placement): a scheduler or a Trainer that sets the learning
        rate here sets the rate the base optimizer steps with."""
        if self.__dict__.get("_initialising", True):
            return self.__dict__.setdefault("_groups", [])
        return self.base_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        if self.__dict__.get("_initialising", True):
            self.__dict__["_groups"] = groups
        else:
            self.base_optimizer.param_groups = groups

    def _weights(self) -> list[Tensor]:
        """The tensors the step writes: the parameters, or their local slices."""
        return self._local if self._local is not None else [p for _, p in self._named]

    def _space(self) -> PerturbationSpace:
        if self._local is not None:  # w moved (the base optimizer's step): copy it again
            theta = self._layout.unflatten(self._theta)
            with torch.no_grad():
                for view, local in zip(theta.values(), self._local):
                    view.copy_(local.reshape(view.shape))
        return self._space_at_w.refresh()

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> float:
        """Move the weights to the ascent point ``gamma_xi(1)``; returns ``||d||_g``."""
        if self._saved is not None:
            raise RuntimeError("first_step twice: call second_step before the next first_step")
        space = self._space()
        grad = torch.cat(
            [
                _local(p.grad).reshape(-1)
                if p.grad is not None
                else torch.zeros_like(w).reshape(-1)
                for (_, p), w in zip(self._named, self._weights())
            ]
        ).to(space.dtype)
        direction = space.proju_(space.egrad2rgrad_(grad))
        norm = float(space.norm(direction))
        self._saved = space.elementwise.theta_flat()
        if self.rho > 0 and norm > 0 and math.isfinite(norm):
            xi = direction.mul_(self.rho / norm)
            point = space.empty()
            space.retr_(xi, point)
            self._write(point)
        if zero_grad:
            self.zero_grad()
        return norm

    @torch.no_grad()
    def _write(self, flat: Tensor) -> None:
        for w, view in zip(self._weights(), self._layout.unflatten(flat).values()):
            w.copy_(view.view_as(w))

    @torch.no_grad()
    def restore(self) -> None:
        """Put the weights back to ``w`` (nothing to do if they are there)."""
        if self._saved is not None:
            self._write(self._saved)
            self._saved = None

    def second_step(self, zero_grad: bool = False) -> None:
        """Back to ``w``, then the base optimizer's step with the current gradients."""
        if self._saved is None:
            raise RuntimeError("second_step without first_step")
        self.restore()
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One full step; ``closure`` computes the loss and its gradients (no zeroing).
        Returns the loss at ``w``. Without a closure, after :meth:`first_step` and the
        backward at the ascent point, it is :meth:`second_step` (how a training loop
        that calls ``optimizer.step()`` uses it, e.g.
        :class:`geosharp.training.callbacks.GeodesicSAMTrainer`)."""
        if closure is None:
            if self._saved is None:
                raise ValueError(
                    "GeodesicSAM.step() without a closure needs first_step() and a backward "
                    "at the ascent point before it: pass a closure, or call first_step/"
                    "second_step (in a Hugging Face Trainer: GeodesicSAMTrainer)"
                )
            self.second_step()
            return None
        with torch.enable_grad():
            loss = closure()
        self.first_step(zero_grad=True)
        try:
            with torch.enable_grad():
                closure()
        except BaseException:
            self.restore()
            raise
        self.second_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.base_optimizer.load_state_dict(state_dict)
