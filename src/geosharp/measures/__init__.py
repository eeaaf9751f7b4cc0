"""Sharpness measures: Auto-PGD worst case and random-direction average case."""

from .apgd import APGDTrace, auto_pgd, checkpoints
from .sharpness import SharpnessResult, sharpness

__all__ = ["APGDTrace", "SharpnessResult", "auto_pgd", "checkpoints", "sharpness"]
