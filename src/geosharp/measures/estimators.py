"""How sharpness is estimated in the ball: the worst case by Auto-PGD, or the average
over random directions on the sphere (MATH.md section 6). Each estimator owns its
estimate on one batch (``estimate``), a :class:`BatchResult`.

>>> WorstCase(n_iters=50, starts=3)
WorstCase(n_iters=50, starts=3)
>>> AverageCase().n_samples
10
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .apgd import APGDTrace, auto_pgd

__all__ = ["AverageCase", "BatchResult", "Estimator", "WorstCase"]


@dataclass
class BatchResult:
    """One batch's estimate: ``value`` (perturbed minus unperturbed loss; ``inf`` where
    a perturbed loss was not finite), the unperturbed ``loss`` and its round-off
    ``floor``, the Auto-PGD ``trace`` of the best start (worst case), each start's value
    (``starts``), and where a perturbed loss was not finite (``nonfinite``)."""

    index: int
    value: float
    loss: float
    floor: float
    trace: APGDTrace | None = None
    starts: list[float] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WorstCase:
    r"""``max_{||xi|| <= rho} L(gamma_xi(1)) - L(theta)`` by Auto-PGD.

    ``n_iters``: steps per start. ``starts``: ``"zero"`` (``xi = 0``), ``"random"`` (a
    random vector of norm ``rho``, Gaussian in the metric), or an integer ``k``: the best
    of ``k`` runs, from ``xi = 0`` and ``k - 1`` random vectors (each start's value is
    kept in ``SharpnessResult.per_batch_starts``); costs ``k`` times one.
    """

    n_iters: int = 20
    starts: str | int = "zero"

    def __post_init__(self) -> None:
        if isinstance(self.n_iters, bool) or not isinstance(self.n_iters, int):
            raise TypeError(f"n_iters must be an integer, got {self.n_iters!r}")
        if self.n_iters < 1:
            raise ValueError(f"n_iters must be at least 1, got {self.n_iters}")
        if isinstance(self.starts, bool) or not isinstance(self.starts, (str, int)):
            raise TypeError(
                f"starts must be 'zero', 'random' or a positive integer, got {self.starts!r}"
            )
        if isinstance(self.starts, str) and self.starts not in ("zero", "random"):
            raise ValueError(
                f"starts must be 'zero', 'random' or a positive integer, got {self.starts!r}"
            )
        if isinstance(self.starts, int) and self.starts < 1:
            raise ValueError(f"starts must be at least 1, got {self.starts}")

    @property
    def kind(self) -> str:
        return "worst"

    @property
    def runs(self) -> tuple[int, bool]:
        """``(number of Auto-PGD runs, whether the first starts at random)``."""
        if isinstance(self.starts, str):
            return 1, self.starts == "random"
        return self.starts, False

    @property
    def evaluations(self) -> int:
        """Forward+backward passes per batch: ``n_iters + 1`` per start."""
        return self.runs[0] * (self.n_iters + 1)

    def estimate(self, m, index: int, batch) -> BatchResult:
        """The best of the Auto-PGD runs on ``batch`` of the
        :class:`~geosharp.measures.problem.Measurement` ``m``."""
        loss, floor = m.unperturbed(batch)
        generator = m.generator(index)
        objective = m.objective(batch)
        n_starts, first_random = self.runs
        best, out = -math.inf, BatchResult(index, math.nan, loss, floor)
        for start in range(n_starts):
            xi0 = m.random(generator) if start > 0 or first_random else None
            value, _, run = auto_pgd(
                objective, m.space, m.rho, self.n_iters, xi0,
                callback=m.callback, grad_dtype=m.grad_dtype,
            )  # fmt: skip
            out.starts.append(float(value) - loss)
            if float(value) > best:
                best, out.trace = float(value), run
            step = next((i for i, v in enumerate(run.losses) if not math.isfinite(v)), None)
            if step is not None:
                where = f"batch {index}" + (f", start {start}" if n_starts > 1 else "")
                out.nonfinite.append(f"{where}, Auto-PGD step {step}: loss {run.losses[step]}")
                out.starts[-1] = math.inf
        out.value = math.inf if out.nonfinite else best - loss
        return out


@dataclass(frozen=True)
class AverageCase:
    r"""``E_{||xi|| = rho} L(gamma_xi(1)) - L(theta)`` over ``n_samples`` directions,
    Gaussian in the metric (drawn equivariantly), projected and scaled to norm ``rho``."""

    n_samples: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int):
            raise TypeError(f"n_samples must be an integer, got {self.n_samples!r}")
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be at least 1, got {self.n_samples}")

    @property
    def kind(self) -> str:
        return "average"

    @property
    def evaluations(self) -> int:
        """Forward passes per batch."""
        return self.n_samples

    def estimate(self, m, index: int, batch) -> BatchResult:
        """The mean loss increase over ``n_samples`` random directions on ``batch``."""
        loss, floor = m.unperturbed(batch)
        generator = m.generator(index)
        out = BatchResult(index, math.nan, loss, floor)
        summed, point = 0.0, m.space.empty()
        for sample in range(self.n_samples):
            with torch.no_grad():
                m.space.retr_(m.random(generator), point)
            value = m.loss_at(point, batch)
            m.evaluated()
            if not math.isfinite(value):
                out.nonfinite.append(f"batch {index}, direction {sample}: loss {value}")
            summed += value
        out.value = summed / self.n_samples - loss
        if not math.isfinite(out.value):
            out.value = math.inf
        return out


Estimator = WorstCase | AverageCase
