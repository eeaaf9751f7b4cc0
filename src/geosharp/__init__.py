"""geosharp: sharpness of neural networks that respects their parameter symmetries.

Implements geodesic sharpness on the quotient manifold of the GL(h) symmetries of
attention ("Hide & Seek", da Silva, Dangel & Oore, ICML 2025), next to Euclidean and
adaptive sharpness.
"""

from . import aliases
from .errors import PrecisionWarning, SymmetryWarning, UsageError
from .geometry import GEOMETRIES, Geometry, InvMetric, MixMetric, PerturbationSpace
from .measures import (
    DEFAULT_RHO,
    MEASURES,
    AverageCase,
    BlockSharpness,
    HessianTraceResult,
    SharpnessResult,
    WorstCase,
    block_sharpness,
    hessian_trace,
    measure_kwargs,
    sharpness,
)
from .symmetry import (
    PairSpec,
    Symmetries,
    check_symmetries,
    declare_pair,
    find_symmetries,
    random_transforms,
    register_handler,
    reparameterize,
)

__version__ = "0.1.0"

aliases.install()  # geosharp.hf, geosharp.optim, ...: the public paths of docs/api.md

__all__ = [
    "DEFAULT_RHO",
    "GEOMETRIES",
    "MEASURES",
    "AverageCase",
    "BlockSharpness",
    "Geometry",
    "HessianTraceResult",
    "InvMetric",
    "MixMetric",
    "PairSpec",
    "PerturbationSpace",
    "PrecisionWarning",
    "SharpnessResult",
    "Symmetries",
    "SymmetryWarning",
    "UsageError",
    "WorstCase",
    "block_sharpness",
    "check_symmetries",
    "declare_pair",
    "find_symmetries",
    "hessian_trace",
    "measure_kwargs",
    "random_transforms",
    "register_handler",
    "reparameterize",
    "sharpness",
]
