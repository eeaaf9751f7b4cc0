"""Sharpness measures: Auto-PGD worst case and random-direction average case."""

from .apgd import APGDTrace, Iterate, auto_pgd, checkpoints
from .catalog import DEFAULT_RHO, MEASURES, TABLE, Measure, measure_kwargs
from .estimators import AverageCase, WorstCase
from .sharpness import SharpnessResult, sharpness

__all__ = [
    "DEFAULT_RHO",
    "MEASURES",
    "TABLE",
    "APGDTrace",
    "AverageCase",
    "Iterate",
    "Measure",
    "SharpnessResult",
    "WorstCase",
    "auto_pgd",
    "checkpoints",
    "measure_kwargs",
    "sharpness",
]
