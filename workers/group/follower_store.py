"""Checkpoint storage as ranks 1..N-1 of a worker group see it: they read what rank 0 wrote
(snapshots to restore, checkpoints to load) and write nothing, so every file is written once,
by rank 0, whole (the ranks' LoRA shards are gathered to it first)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from queue_tinker.storage.base import CheckpointStore, Removal, StillDue


class FollowerStore(CheckpointStore):
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.root = store.root

    # --- reads: rank 0's files --------------------------------------------------------------
    def location(self, key: str) -> str:
        return self.store.location(key)

    def key_of(self, location: str) -> str:
        return self.store.key_of(location)

    def check(self) -> None:
        self.store.check()

    def read_text(self, key: str, name: str) -> str | None:
        return self.store.read_text(key, name)

    def fetch(self, key: str) -> Path | None:
        return self.store.fetch(key)

    def files(self, key: str) -> dict[str, int]:
        return self.store.files(key)

    def read_meta_version(self, key: str) -> tuple[str | None, str | None]:
        return self.store.read_meta_version(key)

    def download_url(self, key: str, name: str, expires_s: int) -> str | None:
        return self.store.download_url(key, name, expires_s)

    # --- writes: rank 0's alone ---------------------------------------------------------------
    def staging(self, key: str) -> Path:
        return Path(tempfile.mkdtemp(prefix="qt-follower-"))

    def commit(self, key: str, staged: Path, expect: str | None = None) -> None:
        self.discard(staged)

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def write_text(self, key: str, name: str, text: str) -> bool:
        return True

    def mark(self, key: str, name: str) -> None:
        return None

    def remove(self, key: str, still_due: StillDue | None = None) -> Removal:
        return Removal.KEPT

    def copy(self, source: str, destination: str, meta_text: str) -> int:
        return 0
