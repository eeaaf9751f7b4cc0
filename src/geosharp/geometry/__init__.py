"""Geometry: invariant metrics on GL(h) pairs and the full-network perturbation space."""

from .pairs import InvMetric, MixMetric, PairMetric, PairState, get_metric
from .space import GEOMETRIES, Geometry, PerturbationSpace, StackedPairs, stack_pairs

__all__ = [
    "GEOMETRIES",
    "Geometry",
    "InvMetric",
    "MixMetric",
    "PairMetric",
    "PairState",
    "PerturbationSpace",
    "StackedPairs",
    "get_metric",
    "stack_pairs",
]
