"""Atomic file writes: a reader sees the old content or the new, never a torn file.

The one helper every writer uses (diagnostics rewinds, reports, summaries, caches): write to a temporary
sibling, flush and fsync it, rename it over the target, fsync the directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` with ``data`` atomically (the parent directory must exist)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))
