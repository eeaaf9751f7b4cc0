"""The table of named measures: one row per measure, the single source of the names,
their :func:`geosharp.sharpness` settings, default radii and the paper's numbers.

The CLI, the studies, the demo, the benchmark and the tests all read this table;
``MEASURES``, ``DEFAULT_RHO`` and ``PAPER_TABLE`` are views of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_RHO",
    "HESSIAN_TRACES",
    "MEASURES",
    "PAPER_SETTINGS",
    "PAPER_TABLE",
    "TABLE",
    "Measure",
    "measure_kwargs",
]


@dataclass(frozen=True)
class Measure:
    """One named measure.

    ``rho`` is its default radius: relative (scale-free) for ``adaptive`` and ``inv``,
    absolute for ``mix`` and Euclidean (MATH.md section 2), so compare measures over a
    grid of radii, not at one shared ``rho``. ``paper_tau``: Kendall tau with the
    generalization gap in the paper's Table, by setting (:data:`PAPER_SETTINGS`).
    """

    name: str
    geometry: str
    metric: str | None = None
    p: float = 2.0
    parameters: str | None = None  # "pairs": the attention pairs' parameters only
    rho: float = 0.05
    paper_tau: dict[str, float] = field(default_factory=dict)

    def kwargs(self) -> dict:
        """Keyword arguments of :func:`geosharp.sharpness` that select this measure."""
        out: dict = {"geometry": self.geometry}
        if self.metric is not None:
            out["metric"] = self.metric
        if self.p != 2.0:
            out["p"] = self.p
        if self.parameters is not None:
            out["parameters"] = self.parameters
        return out


# The paper's Table (MATH.md section 8): its three settings.
PAPER_SETTINGS = {
    "diagonal": "diagonal networks",
    "clip": "ImageNet, CLIP ViT-B/32 fine-tunes (72 models)",
    "bert": "MNLI, BERT fine-tunes (35 models)",
}

_INF = float("inf")
TABLE: dict[str, Measure] = {
    m.name: m
    for m in (
        Measure("euclidean", "euclidean"),
        Measure("adaptive", "adaptive", paper_tau={"diagonal": -0.68, "clip": -0.41, "bert": 0.06}),
        Measure("adaptive-linf", "adaptive", p=_INF, rho=0.005),
        Measure(
            "geodesic-inv",
            "geodesic",
            "inv",
            paper_tau={"diagonal": -0.83, "clip": -0.71, "bert": 0.28},
        ),
        Measure(
            "geodesic-mix",
            "geodesic",
            "mix",
            rho=0.005,
            paper_tau={"diagonal": -0.86, "clip": -0.70, "bert": 0.38},
        ),
        Measure("geodesic-norm-only-inv", "geodesic-norm-only", "inv"),
        Measure("geodesic-norm-only-mix", "geodesic-norm-only", "mix", rho=0.005),
        Measure("geodesic-curvature-only-inv", "geodesic-curvature-only", "inv"),
        Measure("geodesic-curvature-only-mix", "geodesic-curvature-only", "mix"),
        # attention only: the pairs' parameters (query/key/value/output), where they differ
        Measure("adaptive-attn", "adaptive", parameters="pairs"),
        Measure("geodesic-inv-attn", "geodesic", "inv", parameters="pairs"),
        Measure("geodesic-mix-attn", "geodesic", "mix", parameters="pairs", rho=0.005),
    )
}

MEASURES: dict[str, dict] = {name: m.kwargs() for name, m in TABLE.items()}
"""Name -> keyword arguments of :func:`geosharp.sharpness`."""

DEFAULT_RHO: dict[str, float] = {name: m.rho for name, m in TABLE.items()}
"""Name -> default radius."""

HESSIAN_TRACES: dict[str, str] = {
    "hessian-trace-euclidean": "euclidean",
    "hessian-trace-adaptive": "adaptive",
    "hessian-trace-inv": "geodesic-inv",
    "hessian-trace-mix": "geodesic-mix",
}
"""Name -> the measure whose geometry :func:`geosharp.measures.hessian_trace` uses."""

PAPER_TABLE: list[tuple[str, float, float, float]] = [
    (label, *(TABLE[n].paper_tau[key] for n in ("adaptive", "geodesic-inv", "geodesic-mix")))
    for key, label in PAPER_SETTINGS.items()
]
"""The paper's Table: ``(setting, tau adaptive, tau geodesic-inv, tau geodesic-mix)``."""


def measure_kwargs(name: str) -> dict:
    """The keywords of :meth:`Geometry.named <geosharp.geometry.Geometry.named>` for a named
    measure, and ``parameters="pairs"`` for a ``*-attn`` one.

    >>> measure_kwargs("geodesic-mix")
    {'geometry': 'geodesic', 'metric': 'mix'}
    """
    try:
        return TABLE[name].kwargs()
    except KeyError:
        raise ValueError(f"unknown measure {name!r}; choose from: {', '.join(TABLE)}") from None
