"""Figures: matplotlib, checked before any work, and compact PNGs (the CLI's plots and the
studies' figures)."""

from __future__ import annotations

from pathlib import Path

from ..errors import MissingDependencyError, UsageError

__all__ = ["check_figure_path", "require_matplotlib", "save_figure", "save_png"]


def require_matplotlib(alternative: str = ""):
    """Import matplotlib with the Agg backend, or a one-line error saying how to install
    it (and ``alternative``, a way to run without figures). Called before any work."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(
            "figures need matplotlib: pip install 'geosharp[plots]'"
            + (f" (or {alternative})" if alternative else "")
        ) from None
    matplotlib.use("Agg")
    return matplotlib


def check_figure_path(path: str | Path, option: str = "--plot") -> None:
    """An error, before any work, unless ``path`` ends in a format matplotlib writes
    (``.png``, ``.pdf``, ``.svg``, ...)."""
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        raise UsageError(
            f"{option} {path}: "
            + (f"'.{suffix}' is not a figure format" if suffix else "no file extension")
            + f"; end it in one of {', '.join('.' + f for f in sorted(formats))}"
        )


def save_png(fig, path: Path, dpi: int = 100) -> Path:
    """Save ``fig`` as a palette PNG (256 colours, via Pillow, which matplotlib ships
    with): plots of filled contours stay well under 300 KB."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)
    return Path(path)


def save_figure(fig, path: str | Path, dpi: int = 100) -> Path:
    """Save ``fig`` in the format its suffix names (:func:`check_figure_path`): a
    compact PNG (:func:`save_png`), else matplotlib's own writer (svg, pdf, ...)."""
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if suffix == "png":
        return save_png(fig, path, dpi)
    fig.savefig(path, dpi=dpi, format=suffix)
    return path
