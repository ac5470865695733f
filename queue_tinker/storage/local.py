"""Checkpoint storage in a local (or mounted) directory: the embedded default.

`<root>/<key>/` holds a file set as plain files. A set appears in one rename of a directory
written beside it; replacing one (a model's snapshot) moves the old one aside first, because
rename() cannot replace a non-empty directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from queue_tinker.errors import CheckpointPathError, StorageUnavailableError
from queue_tinker.storage.base import CheckpointStore, Removal, StillDue, check_key
from queue_tinker.types.service.checkpoints import META_FILE

ABANDONED_AFTER_S = 3600  # far longer than any write takes


class LocalStore(CheckpointStore):
    def __init__(self, root: Path) -> None:
        self.path = root
        self.root = str(root)

    def directory(self, key: str) -> Path:
        return self.path / check_key(key)

    def location(self, key: str) -> str:
        return str(self.directory(key))

    def key_of(self, location: str) -> str:
        """Refuse anything outside the directory, and fail loudly if it is not there: an
        unmounted volume must not read as 'every checkpoint already deleted'."""
        root = self.path.resolve()
        if not root.is_dir():
            raise StorageUnavailableError(
                f"checkpoint storage {root} does not exist here (QT_STORAGE); every gateway, "
                "housekeeper and worker needs the same storage"
            )
        target = Path(location).resolve()
        if target == root or not target.is_relative_to(root):
            raise CheckpointPathError(f"{location} is not inside checkpoint storage {root}")
        return target.relative_to(root).as_posix()

    def check(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StorageUnavailableError(
                f"QT_STORAGE={self.root}: cannot make the checkpoint directory ({err})"
            ) from err
        if not os.access(self.path, os.W_OK):
            raise StorageUnavailableError(f"QT_STORAGE={self.root}: not writable here")

    def staging(self, key: str) -> Path:
        target = self.directory(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        # Beside the target, so commit is a rename on one file system.
        return Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))

    def commit(self, key: str, staged: Path, expect: str | None = None) -> None:
        # No versions here (read_meta_version gives None): a rename has no condition.
        replace_dir(staged, self.directory(key))

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def read_text(self, key: str, name: str) -> str | None:
        try:
            return (current(self.directory(key)) / name).read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_text(self, key: str, name: str, text: str) -> bool:
        directory = self.directory(key)
        # One rename: a reader never sees half a file. If the directory is moved aside
        # meanwhile, the write fails instead of landing in its trash.
        tmp = directory / f".{name}-{uuid.uuid4().hex[:8]}"
        try:
            tmp.write_text(text)
            os.replace(tmp, directory / name)
        except FileNotFoundError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def mark(self, key: str, name: str) -> None:
        directory = self.directory(key)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / name).touch()

    def fetch(self, key: str) -> Path | None:
        directory = current(self.directory(key))
        return directory if (directory / META_FILE).is_file() else None

    def files(self, key: str) -> dict[str, int]:
        directory = current(self.directory(key))
        if not directory.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}

    def remove(self, key: str, still_due: StillDue | None = None) -> Removal:
        directory = self.directory(key)
        if not directory.exists():
            return Removal.ABSENT
        # Aside in one rename, so readers see the set or nothing, never half of it.
        trash = directory.with_name(f".{directory.name}-removed-{uuid.uuid4().hex[:8]}")
        try:
            directory.rename(trash)
        except FileNotFoundError:
            return Removal.ABSENT
        if still_due is not None and not still_due(_text(trash / META_FILE)):
            trash.rename(directory)
            return Removal.KEPT
        shutil.rmtree(trash)
        return Removal.REMOVED

    def copy(self, source: str, destination: str, meta_text: str) -> int:
        """Every file hard-linked where the file system allows (named checkpoints are never
        rewritten in place, so the copy shares the bytes and outlives the source's removal),
        copied where it does not."""
        origin = current(self.directory(source))
        if not (origin / META_FILE).is_file():
            raise FileNotFoundError(origin / META_FILE)
        staged = self.staging(destination)
        try:
            for item in origin.iterdir():
                if item.name != META_FILE and item.is_file():
                    _link_or_copy(item, staged / item.name)
            (staged / META_FILE).write_text(meta_text)
            size = sum(f.stat().st_size for f in staged.iterdir())
            self.commit(destination, staged)
            return size
        finally:
            shutil.rmtree(staged, ignore_errors=True)

    def download_url(self, key: str, name: str, expires_s: int) -> str | None:
        return None


def replace_dir(tmp: Path, directory: Path) -> None:
    """Swap `tmp` in for `directory`. A reader sees the old or the new one, never a mix;
    the old one is moved aside first (a process that dies between the two renames leaves it
    there: see current)."""
    old = None
    if directory.exists():
        old = directory.with_name(f".{directory.name}-old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
    tmp.rename(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _clear_leftovers(directory)


# Only replaced sets (a model's snapshot; named checkpoints are written once) ever have
# versions moved aside; the helpers below look at nothing but a set's own siblings.
def _set_aside(directory: Path) -> list[Path]:
    """Earlier versions that writers killed between replace_dir's two renames left aside."""
    return list(directory.parent.glob(f".{directory.name}-old-*"))


def _clear_leftovers(directory: Path) -> None:
    """Remove what killed writers left beside a set just replaced: versions moved aside, and
    temporary directories (of writes cut short) once they are long abandoned."""
    for aside in _set_aside(directory):
        shutil.rmtree(aside, ignore_errors=True)
    cutoff = time.time() - ABANDONED_AFTER_S
    for leftover in directory.parent.glob(f".{directory.name}-*"):
        with contextlib.suppress(OSError):
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)


def current(directory: Path) -> Path:
    """Where `directory`'s content is: itself, or, for a set whose replacement was cut short
    between replace_dir's two renames (its writer was killed there), the previous version it
    had moved aside, which is whole. The next commit puts one back in place."""
    if directory.exists() or not directory.parent.is_dir():
        return directory
    whole = [(seq, aside) for aside in _set_aside(directory) if (seq := _seq(aside)) is not None]
    return max(whole)[1] if whole else directory


def _seq(directory: Path) -> int | None:
    """The seq in a set's meta (None: no whole set there)."""
    text = _text(directory / META_FILE)
    try:
        seq = json.loads(text).get("seq", 0) if text is not None else None
    except (ValueError, AttributeError):
        return None
    return seq if isinstance(seq, int) else None


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another device, or a file system without hard links
        shutil.copy2(source, target)
