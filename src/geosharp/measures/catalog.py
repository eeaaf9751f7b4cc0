"""Named measures, as used by the CLI and the studies: ``"geodesic-mix"`` and so on."""

from __future__ import annotations

__all__ = ["DEFAULT_RHO", "MEASURES", "default_rho", "measure_kwargs", "measure_name"]

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
    # attention only: the pairs' parameters (query/key/value/output), where they differ
    "adaptive-attn": dict(geometry="adaptive", parameters="pairs"),
    "geodesic-inv-attn": dict(geometry="geodesic", metric="inv", parameters="pairs"),
    "geodesic-mix-attn": dict(geometry="geodesic", metric="mix", parameters="pairs"),
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
    "adaptive-attn": 0.05,
    "geodesic-inv-attn": 0.05,
    "geodesic-mix-attn": 0.005,
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


def measure_name(
    geometry: str, metric: str = "inv", p: float = 2.0, parameters: str | None = None
) -> str:
    """The table's name of a :func:`geosharp.sharpness` configuration.

    >>> measure_name("geodesic", "mix"), measure_name("adaptive", p=float("inf"))
    ('geodesic-mix', 'adaptive-linf')
    >>> measure_name("geodesic", "inv", parameters="pairs")
    'geodesic-inv-attn'
    """
    for name, kwargs in MEASURES.items():
        if (
            kwargs.get("parameters") == parameters
            and kwargs["geometry"] == geometry
            and kwargs.get("metric", metric) == metric
            and kwargs.get("p", 2.0) == p
        ):
            return name
    raise ValueError(
        f"no named measure has geometry={geometry!r}, metric={metric!r}, p={p}; "
        f"choose from: {', '.join(MEASURES)}"
    )


def default_rho(
    geometry: str, metric: str = "inv", p: float = 2.0, parameters: str | None = None
) -> float:
    """The default radius of a configuration (``DEFAULT_RHO`` of its name).

    >>> default_rho("geodesic", "mix"), default_rho("adaptive")
    (0.005, 0.05)
    """
    return DEFAULT_RHO[measure_name(geometry, metric, p, parameters)]
