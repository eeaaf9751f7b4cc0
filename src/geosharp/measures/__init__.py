"""Sharpness measures (Auto-PGD worst case, random-direction average case) and the
Hessian trace in each geometry."""

from .apgd import APGDTrace, Iterate, auto_pgd, checkpoints
from .blocks import BlockSharpness
from .catalog import DEFAULT_RHO, HESSIAN_TRACES, MEASURES, TABLE, Measure, measure_kwargs
from .estimators import AverageCase, WorstCase
from .hessian import HessianTraceResult, hessian_trace
from .sharpness import SharpnessResult, block_sharpness, sharpness

__all__ = [
    "DEFAULT_RHO",
    "HESSIAN_TRACES",
    "MEASURES",
    "TABLE",
    "APGDTrace",
    "AverageCase",
    "BlockSharpness",
    "HessianTraceResult",
    "Iterate",
    "Measure",
    "SharpnessResult",
    "WorstCase",
    "auto_pgd",
    "block_sharpness",
    "checkpoints",
    "hessian_trace",
    "measure_kwargs",
    "sharpness",
]
