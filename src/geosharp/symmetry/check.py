"""Self-check: does a random symmetry transform leave the model's outputs unchanged?"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..params import evaluation_mode, swapped
from .discovery import call_model, check_inputs, find_symmetries
from .groups import random_transforms, transform_parameters
from .pairs import PairSpec, Symmetries

__all__ = ["SymmetryCheck", "check_symmetries"]


@dataclass
class SymmetryCheck:
    """Largest change of the model's outputs under a random symmetry transform.

    ``n_pairs``: the pairs transformed; with none there is nothing to check, and the
    check is not :attr:`ok` (an unchanged output would prove nothing)."""

    max_abs_change: float
    max_rel_change: float
    tolerance: float
    per_pair: dict[str, float]
    n_pairs: int = 1

    @property
    def ok(self) -> bool:
        return self.n_pairs > 0 and self.max_rel_change <= self.tolerance

    @property
    def status(self) -> str:
        """``"ok"``, ``"failed"`` or ``"nothing to check"``."""
        if self.n_pairs == 0:
            return "nothing to check"
        return "ok" if self.ok else "failed"

    def __str__(self) -> str:
        if self.n_pairs == 0:
            return (
                "symmetry self-check: nothing to check, the model has no symmetric pairs "
                "(see find_symmetries(model).summary())"
            )
        verdict = "OK" if self.ok else "FAILED"
        lines = [
            f"symmetry self-check {verdict}: {self.n_pairs} pair blocks transformed, largest "
            f"output change {self.max_abs_change:.3g} (relative {self.max_rel_change:.3g}, "
            f"tolerance {self.tolerance:.3g})"
        ]
        for name, change in self.per_pair.items():
            if change > self.tolerance:
                lines.append(f"  pair {name} changes the output by {change:.3g} (relative)")
        return "\n".join(lines)


@torch.no_grad()
def check_symmetries(
    model: nn.Module,
    batch: object,
    symmetries: Symmetries | None = None,
    cond: float = 10.0,
    seed: int = 0,
    tolerance: float | None = None,
    *,
    loss_fn: Callable[[nn.Module, object], Tensor] | None = None,
) -> SymmetryCheck:
    """Transform every discovered pair by a random well-conditioned ``A`` and report the
    largest change of the model's output on ``batch`` (it must be at round-off); a
    model without pairs gives "nothing to check", never OK.

    ``batch`` is passed as ``model(**batch)`` for a mapping, ``model(*batch)`` for a
    tuple and ``model(batch)`` otherwise; with ``loss_fn``, it is the batch
    ``sharpness()`` takes, ``loss_fn(model, batch)`` runs, and the outputs compared are
    the model's and the loss. If the check fails, each pair is also tried alone so that
    the culprit is named. The model is not modified.
    """
    if loss_fn is None:
        check_inputs(model, batch)
    if symmetries is None:
        symmetries = find_symmetries(model, batch, loss_fn=loss_fn, warn=False)
    if not symmetries.pairs:
        return SymmetryCheck(0.0, 0.0, tolerance or 0.0, {}, n_pairs=0)
    params = {n: p.detach() for n, p in model.named_parameters()}
    dtype = next(iter(params.values())).dtype
    if tolerance is None:
        tolerance = {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)
    transforms = random_transforms(symmetries, cond, seed)

    with evaluation_mode(model):
        reference = _outputs(model, batch, params, loss_fn)
        scale = max(float(r.abs().max()) for r in reference) or 1.0

        def change(pairs: Sequence[PairSpec]) -> float:
            moved = _outputs(model, batch, transform_parameters(params, pairs, transforms), loss_fn)
            return max(float((a - b).abs().max()) for a, b in zip(moved, reference))

        abs_change = change(symmetries.pairs)
        per_pair = {}
        if abs_change / scale > tolerance:
            per_pair = {p.name: change([p]) / scale for p in symmetries.pairs}
    return SymmetryCheck(
        abs_change, abs_change / scale, tolerance, per_pair, n_pairs=len(symmetries.pairs)
    )


def _outputs(
    model: nn.Module, batch: object, params: Mapping[str, Tensor], loss_fn=None
) -> list[Tensor]:
    """The floating tensors the model outputs on ``batch`` with ``params`` swapped in
    (with ``loss_fn``: those of each call of the model in ``loss_fn(model, batch)``, and
    the loss)."""
    with swapped(model, params), torch.no_grad():
        if loss_fn is None:
            out = call_model(model, batch)
        else:
            calls: list = []
            hook = model.register_forward_hook(lambda _m, _a, o: calls.append(o))
            try:
                loss = loss_fn(model, batch)
            finally:
                hook.remove()
            out = [*calls, loss]
    tensors = _floating_tensors(out)
    if not tensors:
        raise TypeError("the model's output holds no floating-point tensor to compare")
    return tensors


def _floating_tensors(out: object) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out.detach()] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        return []
    return [t for v in values for t in _floating_tensors(v)]
