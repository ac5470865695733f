"""The local cache of a remote store, held under a byte budget by evicting the least recently
used copies.

A cached copy is a directory holding a file set and its generation marker; the marker's mtime
is the copy's last use (touched on every hit), so recency survives a restart. A copy used in
the last `keep_recent_s` is never evicted, however full the cache: a path handed to a caller
may still be being read. Evicting a copy loses nothing: the store holds the set, and the next
fetch downloads it again.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

GENERATION_MARKER = ".qt-generation"  # in a cached copy: the generation it holds


@dataclass(frozen=True)
class CachedCopy:
    path: Path
    bytes: int
    last_used: float


def touch(copy: Path) -> None:
    """Mark a cached copy as used now."""
    os.utime(copy / GENERATION_MARKER)


def cached_copies(root: Path) -> list[CachedCopy]:
    """Every whole copy under `root`; directories starting with a dot (staging, downloads
    under way) are not copies yet."""
    found: list[CachedCopy] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        if GENERATION_MARKER not in files:
            continue
        path = Path(directory)
        size = sum((path / name).stat().st_size for name in files)
        found.append(CachedCopy(path, size, (path / GENERATION_MARKER).stat().st_mtime))
        subdirs[:] = []  # a copy holds files only
    return found


def trim(
    root: Path, budget_bytes: int, keep_recent_s: float, now: float | None = None
) -> list[Path]:
    """Evict the least recently used copies until the cache holds at most `budget_bytes`,
    sparing those used within `keep_recent_s`; the copies evicted."""
    now = time.time() if now is None else now
    copies = sorted(cached_copies(root), key=lambda c: c.last_used)
    held = sum(c.bytes for c in copies)
    evicted: list[Path] = []
    for copy in copies:
        if held <= budget_bytes:
            break
        if now - copy.last_used < keep_recent_s:
            break  # this and every later copy are in use
        shutil.rmtree(copy.path, ignore_errors=True)
        held -= copy.bytes
        evicted.append(copy.path)
    return evicted
