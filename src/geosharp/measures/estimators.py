"""How sharpness is estimated in the ball: the worst case by Auto-PGD, or the average
over random directions on the sphere (MATH.md section 6).

>>> WorstCase(n_iters=50, starts=3)
WorstCase(n_iters=50, starts=3)
>>> AverageCase().n_samples
10
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AverageCase", "Estimator", "WorstCase", "estimator_from"]


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


Estimator = WorstCase | AverageCase


def estimator_from(
    kind: str = "worst",
    n_iters: int = 20,
    n_samples: int = 10,
    starts: str | int = "zero",
    random_start: bool = False,
) -> Estimator:
    """The estimator that the flat keywords of :func:`geosharp.sharpness` describe.

    >>> estimator_from(kind="average", n_samples=4)
    AverageCase(n_samples=4)
    >>> estimator_from(random_start=True)
    WorstCase(n_iters=20, starts='random')
    """
    if kind not in ("worst", "average"):
        raise ValueError(f"kind must be 'worst' or 'average', got {kind!r}")
    if random_start:
        if not isinstance(starts, str):
            raise ValueError("random_start=True and starts=k: use starts alone")
        starts = "random"
    worst, average = WorstCase(n_iters, starts), AverageCase(n_samples)  # both checked
    return average if kind == "average" else worst
