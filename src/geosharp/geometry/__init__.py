"""Geometry: invariant metrics on GL(h) pairs and the full-network perturbation space."""

from .elementwise import Elementwise
from .pairs import InvMetric, MixMetric, PairMetric, PairState, get_metric
from .space import GEOMETRIES, Geometry, PerturbationSpace
from .stacked import Pairs, StackedPairs, stack_pairs

__all__ = [
    "GEOMETRIES",
    "Elementwise",
    "Geometry",
    "InvMetric",
    "MixMetric",
    "PairMetric",
    "PairState",
    "Pairs",
    "PerturbationSpace",
    "StackedPairs",
    "get_metric",
    "stack_pairs",
]
