"""Models shipped with geosharp (importing this registers their symmetry handlers)."""

from . import diagonal as diagonal
from .diagonal import DiagonalNet

__all__ = ["DiagonalNet"]
