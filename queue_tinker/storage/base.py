"""The interface every checkpoint store offers.

A checkpoint (or snapshot) is a *file set* under a key, `<run id>/<kind>/<name>` or
`<model id>/_snapshot`: the PEFT files plus `qt_meta.json`. A file set becomes visible whole
(its meta last) or not at all, so whoever reads the meta may read the rest. Records (Postgres
rows, expiry jobs) hold a file set's *location*: a local path or an s3:// URL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from pathlib import Path

from queue_tinker.errors import CheckpointPathError
from queue_tinker.types.service.checkpoints import META_FILE

# Read back after a file set is made invisible, before its bytes go: False puts it back (it
# was saved again, or its TTL moved, between the caller's check and the removal).
StillDue = Callable[[str | None], bool]


class Removal(Enum):
    REMOVED = "removed"  # this call removed the file set
    ABSENT = "absent"  # nothing there (removed earlier)
    KEPT = "kept"  # still_due said no: left in place


class CheckpointStore(ABC):
    """File sets under keys; every method blocks (callers on an event loop use a thread)."""

    root: str  # as configured (a directory, s3://bucket/prefix): for messages

    @abstractmethod
    def location(self, key: str) -> str:
        """What records hold for the file set at `key`."""

    @abstractmethod
    def key_of(self, location: str) -> str:
        """The key behind a location; CheckpointPathError for one outside this store (locations
        come from Redis and Postgres, and nothing outside may be touched)."""

    @abstractmethod
    def check(self) -> None:
        """StorageUnavailableError, naming QT_STORAGE, when the store cannot be used."""

    @abstractmethod
    def staging(self, key: str) -> Path:
        """A fresh, empty local directory to write the file set for `key` into, then commit."""

    @abstractmethod
    def commit(self, key: str, staged: Path, expect: str | None = None) -> None:
        """Make the files of `staged` the file set at `key`, replacing any there; readers see
        the old set or the new one, never a mix. `staged` is consumed. `expect`, a version
        read_meta_version gave: only if the set is still that one ("" : still none), else
        CheckpointReplacedError; None: whatever is there."""

    @abstractmethod
    def discard(self, staged: Path) -> None:
        """Throw away a staged directory that will not be committed."""

    @abstractmethod
    def read_text(self, key: str, name: str) -> str | None:
        """One small file of the set (the meta, a marker); None if absent."""

    @abstractmethod
    def write_text(self, key: str, name: str, text: str) -> bool:
        """Replace one small file of an existing set in one step (a meta's change); False if
        the set is gone (a removal going on must not be undone by it)."""

    @abstractmethod
    def mark(self, key: str, name: str) -> None:
        """Leave an empty marker file under `key` (a model unloaded), whether or not a file set
        is there."""

    @abstractmethod
    def fetch(self, key: str) -> Path | None:
        """A local directory holding the whole current file set (a cached copy where storage
        is remote, reused while it is current); None when there is none."""

    @abstractmethod
    def files(self, key: str) -> dict[str, int]:
        """The set's files (the meta too) and their sizes in bytes; empty when absent."""

    @abstractmethod
    def remove(self, key: str, still_due: StillDue | None = None) -> Removal:
        """Remove the file set, meta first (it reads as gone from then on). `still_due` gets
        the meta read once the set is invisible: False keeps it."""

    @abstractmethod
    def copy(self, source: str, destination: str, meta_text: str) -> int:
        """The files of `source` as the set at `destination`, with `meta_text` as its meta;
        bytes copied. Visible once complete; a repeat replaces it."""

    @abstractmethod
    def download_url(self, key: str, name: str, expires_s: int) -> str | None:
        """A URL anyone may GET the file with until `expires_s` from now; None where the store
        has no such URLs (the gateway then signs its own)."""

    def read_meta_text(self, key: str) -> str | None:
        return self.read_text(key, META_FILE)

    def read_meta_version(self, key: str) -> tuple[str | None, str | None]:
        """The meta's text and the version commit(expect=...) checks ("" when there is no
        set); a store that cannot check one gives None."""
        return self.read_meta_text(key), None


def check_key(key: str) -> str:
    """Keys are relative, '/'-separated, without empty, '.' or '..' parts."""
    parts = key.split("/")
    if not key or any(part in ("", ".", "..") for part in parts):
        raise CheckpointPathError(f"{key!r} is not a checkpoint storage key")
    return key
