"""Named measures, as used by the CLI and the studies: ``"geodesic-mix"`` and so on."""

from __future__ import annotations

__all__ = ["DEFAULT_RHO", "MEASURES", "measure_kwargs"]

# name -> keyword arguments of `sharpness`
MEASURES: dict[str, dict] = {
    "euclidean": dict(geometry="euclidean"),
    "adaptive": dict(geometry="adaptive"),
    "adaptive-linf": dict(geometry="adaptive", p=float("inf")),
    "geodesic-inv": dict(geometry="geodesic", metric="inv"),
    "geodesic-mix": dict(geometry="geodesic", metric="mix"),
    "geodesic-norm-only-inv": dict(geometry="geodesic-norm-only", metric="inv"),
    "geodesic-norm-only-mix": dict(geometry="geodesic-norm-only", metric="mix"),
    "geodesic-curvature-only-inv": dict(geometry="geodesic-curvature-only", metric="inv"),
    "geodesic-curvature-only-mix": dict(geometry="geodesic-curvature-only", metric="mix"),
}

# Starting radii. adaptive and inv are relative (scale-free), mix and Euclidean absolute
# (MATH.md section 2): compare measures over a grid of radii, not at one shared rho.
DEFAULT_RHO: dict[str, float] = {
    "euclidean": 0.05,
    "adaptive": 0.05,
    "adaptive-linf": 0.005,
    "geodesic-inv": 0.05,
    "geodesic-mix": 0.005,
    "geodesic-norm-only-inv": 0.05,
    "geodesic-norm-only-mix": 0.005,
    "geodesic-curvature-only-inv": 0.05,
    "geodesic-curvature-only-mix": 0.05,
}


def measure_kwargs(name: str) -> dict:
    """Keyword arguments of :func:`geosharp.sharpness` for a named measure.

    >>> measure_kwargs("geodesic-mix")
    {'geometry': 'geodesic', 'metric': 'mix'}
    """
    try:
        return dict(MEASURES[name])
    except KeyError:
        raise ValueError(f"unknown measure {name!r}; choose from: {', '.join(MEASURES)}") from None
