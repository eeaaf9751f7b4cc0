"""Symmetry discovery: which parameters form GL(h) pairs, and acting with the group."""

from .check import SymmetryCheck, check_symmetries
from .declare import declare_pair
from .discovery import find_symmetries
from .groups import random_transforms, reparameterize, transform_parameters
from .handlers import Projection, attention_pairs
from .pairs import Block, PairSpec, Symmetries, positions
from .registry import nested_pairs, register_handler, register_matcher

__all__ = [
    "Block",
    "PairSpec",
    "Projection",
    "Symmetries",
    "SymmetryCheck",
    "attention_pairs",
    "check_symmetries",
    "declare_pair",
    "find_symmetries",
    "nested_pairs",
    "positions",
    "random_transforms",
    "register_handler",
    "register_matcher",
    "reparameterize",
    "transform_parameters",
]
