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
from collections.abc import Callable
from dataclasses import dataclass, replace
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
        found.append(_copy_at(Path(directory), files))
        subdirs[:] = []  # a copy holds files only
    return found


def _copy_at(path: Path, files: list[str] | None = None) -> CachedCopy:
    names = os.listdir(path) if files is None else files
    size = sum((path / name).stat().st_size for name in names)
    return CachedCopy(path, size, (path / GENERATION_MARKER).stat().st_mtime)


def trim(
    root: Path, budget_bytes: int, keep_recent_s: float, now: float | None = None
) -> list[Path]:
    """Evict the least recently used copies until the cache holds at most `budget_bytes`,
    sparing those used within `keep_recent_s`; the copies evicted."""
    return _evict(cached_copies(root), budget_bytes, keep_recent_s, now)


def _evict(
    copies: list[CachedCopy], budget_bytes: int, keep_recent_s: float, now: float | None
) -> list[Path]:
    now = time.time() if now is None else now
    held = sum(c.bytes for c in copies)
    evicted: list[Path] = []
    for copy in sorted(copies, key=lambda c: c.last_used):
        if held <= budget_bytes:
            break
        if now - copy.last_used < keep_recent_s:
            break  # this and every later copy are in use
        shutil.rmtree(copy.path, ignore_errors=True)
        held -= copy.bytes
        evicted.append(copy.path)
    return evicted


# How old the index may grow before it walks the directory again: another process sharing the
# cache (a gateway beside a worker, on one data directory) adds copies this one does not see.
RESCAN_S = 60.0


class CacheIndex:
    """The copies under a cache's root, held in memory: walked from disk at first and again
    once the last walk is RESCAN_S old, and in between kept up to date with what this process
    adds, uses and removes. So holding the cache to its budget after every upload or download
    costs a dictionary's update, not a walk of every copy (3,000 copies took 160 ms a walk);
    it sorts only when the cache is over its budget. Not thread-safe: the store calls it under
    its cache lock."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.clock = clock
        self.walks = 0
        self._copies: dict[Path, CachedCopy] = {}
        self._walked_at: float | None = None

    def added(self, copy: Path) -> None:
        """A whole copy now at `copy` (written or downloaded; replacing any there before)."""
        self._copies[copy] = _copy_at(copy)

    def used(self, copy: Path) -> None:
        """A copy read now: touched, so its recency survives a restart."""
        touch(copy)
        if copy in self._copies:
            self._copies[copy] = replace(self._copies[copy], last_used=time.time())

    def removed(self, copy: Path) -> None:
        self._copies.pop(copy, None)

    def trim(self, budget_bytes: int, keep_recent_s: float, now: float | None = None) -> list[Path]:
        """cache.trim on the copies known here; the copies evicted."""
        if self._walked_at is None or self.clock() - self._walked_at >= RESCAN_S:
            self._copies = {c.path: c for c in cached_copies(self.root)}
            self._walked_at = self.clock()
            self.walks += 1
        if sum(c.bytes for c in self._copies.values()) <= budget_bytes:
            return []
        evicted = _evict(list(self._copies.values()), budget_bytes, keep_recent_s, now)
        for path in evicted:
            del self._copies[path]
        return evicted
