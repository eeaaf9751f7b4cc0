"""Symmetry discovery: which parameters form GL(h) pairs, found from what the model
computes and verified on it, and acting with the group."""

from .check import SymmetryCheck, check_symmetries
from .declare import declare_pair
from .discovery import find_symmetries, verify_symmetries
from .groups import random_transforms, transform_parameters
from .handlers import Projection, attention_pairs
from .inputs import example_inputs
from .pairs import Block, Dropped, PairSpec, Symmetries, Verification, positions
from .registry import nested_pairs, register_handler, register_matcher
from .reparameterize import reparameterize

__all__ = [
    "Block",
    "Dropped",
    "PairSpec",
    "Projection",
    "Symmetries",
    "SymmetryCheck",
    "Verification",
    "attention_pairs",
    "check_symmetries",
    "declare_pair",
    "example_inputs",
    "find_symmetries",
    "nested_pairs",
    "positions",
    "random_transforms",
    "register_handler",
    "register_matcher",
    "reparameterize",
    "transform_parameters",
    "verify_symmetries",
]
