"""Results files: written atomically, readable by others.

Readers never see a partial file: the text goes to a temporary file in the same
directory, is flushed to disk and renamed over the target. The file gets the mode a
plain ``open(path, "w")`` would give (``0o666`` less the umask), not the private
``0o600`` of temporary files, so that results can be shared.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["dumps", "fingerprint", "read_json_file", "write_json_atomic", "write_text_atomic"]


_EDGE = 1 << 20  # bytes read from each end of a large file


def fingerprint(
    path: str | os.PathLike, limit: int = 100_000, exclude: str | os.PathLike | None = None
) -> str | None:
    """A digest of a file or a folder's files as they are now: per file (in sorted
    order, by path relative to ``path``) its size and the SHA-256 of its content, or
    of its first and last MiB when it is larger than 2 MiB (a safetensors file's
    header is at its start). A rewritten data file, a retrained checkpoint, a file
    added or removed change it; the cost is bounded. ``None`` when ``path`` does not
    exist (a built-in name); at most ``limit`` files of a folder are read. ``exclude``:
    a file left out (the results file itself, written inside the folder), with its
    temporary files.

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.txt").write_text("one")
    >>> before = fingerprint(folder)
    >>> _ = (folder / "a.txt").write_text("two")
    >>> fingerprint(folder) != before
    True
    """
    import hashlib

    root = Path(path)
    if not root.exists():
        return None
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    if exclude is not None:
        skip = Path(exclude).resolve()
        files = [
            f
            for f in files
            if f.resolve() != skip
            and not (f.parent.resolve() == skip.parent and f.name.startswith(f".{skip.name}."))
        ]
    digest = hashlib.sha256()
    for file in files[:limit]:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root) if file != root else file.name}|{size}|".encode())
        with open(file, "rb") as f:
            if size <= 2 * _EDGE:
                digest.update(f.read())
            else:
                digest.update(f.read(_EDGE))
                f.seek(size - _EDGE)
                digest.update(f.read(_EDGE))
    digest.update(f"|{len(files)}".encode())
    return digest.hexdigest()[:16]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, fsync and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any, strict: bool = False) -> None:
    """Write ``obj`` as indented JSON (NumPy scalars and arrays as numbers and lists)
    to ``path``, atomically (:func:`write_text_atomic`). ``strict``: non-finite floats
    as ``null`` (:func:`dumps`), for files read by other programs; otherwise Python's
    ``NaN``/``Infinity``, which the study stores read back."""
    text = dumps(obj) if strict else json.dumps(obj, indent=2, default=_jsonable)
    write_text_atomic(path, text + "\n")


def dumps(obj: Any, **kwargs) -> str:
    """``obj`` as strict JSON (indented unless ``indent`` says otherwise; other
    keywords go to ``json.dumps``): a non-finite float, which JSON has no word for
    (Python would write ``NaN``, which other readers reject), becomes ``null``; the
    record says why elsewhere.

    >>> print(dumps({"value": float("inf"), "per_batch": [1.5, float("nan")]}))
    {
      "value": null,
      "per_batch": [
        1.5,
        null
      ]
    }
    """
    kwargs.setdefault("indent", 2)
    return json.dumps(_finite(obj), default=_jsonable, allow_nan=False, **kwargs)


def read_json_file(path: str | os.PathLike, option: str) -> Any:
    """The JSON in ``path`` (``null`` read as ``None``); a one-line error naming
    ``option`` when it is not JSON."""
    from .errors import UsageError

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"{option} {path}: not readable as JSON ({err})") from None


def _finite(x: Any) -> Any:
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, np.ndarray):
        return _finite(x.tolist())
    return x


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")
