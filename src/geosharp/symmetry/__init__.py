"""Symmetry discovery: which parameters form GL(h) pairs, and acting with the group."""

from .check import (
    SymmetryCheck,
    check_symmetries,
    random_transforms,
    reparameterize,
    transform_parameters,
)
from .discovery import find_symmetries
from .handlers import Projection, attention_pairs, register_handler
from .pairs import Block, PairSpec, Symmetries, positions

__all__ = [
    "Block",
    "PairSpec",
    "Projection",
    "SymmetryCheck",
    "Symmetries",
    "attention_pairs",
    "check_symmetries",
    "find_symmetries",
    "positions",
    "random_transforms",
    "register_handler",
    "reparameterize",
    "transform_parameters",
]
