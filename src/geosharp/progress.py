"""Progress reports: a bar on a terminal, a plain periodic line otherwise.

On a terminal (``stream.isatty()``) a ``tqdm`` bar is shown and cleared when done. When
the output goes to a file or a pipe (a log, a batch job), no control characters are
written: a line ``desc: 3/10 batches, 41 s, ~96 s left`` at most every ``every``
seconds (the time left, when the total is known, assumes the pace so far).

>>> import io
>>> out = io.StringIO()
>>> ticks = iter([0.0, 1.0, 40.0, 41.0, 90.0])
>>> for _ in Progress(range(3), desc="measure", unit="batch", stream=out,
...                   clock=lambda: next(ticks)):
...     pass
>>> print(out.getvalue(), end="")
measure: 2/3 batch, 40 s, ~20 s left
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

__all__ = ["Progress"]


class Progress:
    """Wrap ``iterable`` (or count :meth:`update` calls) and report progress on ``stream``
    (default ``sys.stderr``); ``enabled=False`` reports nothing."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        enabled: bool = True,
        stream: IO[str] | None = None,
        every: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.stream = sys.stderr if stream is None else stream
        self.every, self.clock, self.count = every, clock, 0
        self.bar: Any = None
        self.enabled = enabled
        if enabled and _isatty(self.stream):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=self.stream)
        self.start = clock() if enabled else 0.0
        self.last = self.start

    def __iter__(self) -> Iterator:
        assert self.iterable is not None, "Progress() without an iterable: call update()"
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def update(self, n: int = 1) -> None:
        self.count += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(n)
            return
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            of = f"/{self.total}" if self.total is not None else ""
            prefix = f"{self.desc}: " if self.desc else ""
            spent = now - self.start
            left = ""
            if self.total is not None and 0 < self.count <= self.total:
                left = f", ~{spent * (self.total - self.count) / self.count:.0f} s left"
            print(
                f"{prefix}{self.count}{of} {self.unit}, {spent:.0f} s{left}",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
