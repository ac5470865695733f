"""Checkpoint storage, local directory and S3 alike: a file set round-trips, is seen whole or
not at all, is removed and copied; S3's big files go up in parts and its URLs serve the bytes."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from object_store import S3Server

from queue_tinker.errors import (
    CheckpointPathError,
    CheckpointReplacedError,
    StorageUnavailableError,
)
from queue_tinker.settings import Settings
from queue_tinker.storage.base import CheckpointStore, Removal
from queue_tinker.storage.cache import (
    GENERATION_MARKER,
    RESCAN_S,
    CacheIndex,
    cached_copies,
    trim,
)
from queue_tinker.storage.configured import open_store
from queue_tinker.storage.local import LocalStore
from queue_tinker.storage.s3 import S3Store
from queue_tinker.types.service.checkpoints import META_FILE

KEY = "run-1/weights/step-2"
MiB = 2**20


def write_set(store: CheckpointStore, key: str, seq: int, weights: bytes = b"w" * 100) -> None:
    staged = store.staging(key)
    (staged / "adapter_model.safetensors").write_bytes(weights)
    (staged / "adapter_config.json").write_text('{"r": 4}')
    (staged / META_FILE).write_text(json.dumps({"id": key, "seq": seq}))
    store.commit(key, staged)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "local":
        return LocalStore(tmp_path / "storage")
    server: S3Server = request.getfixturevalue("s3_server")
    return server.store(server.bucket(), tmp_path / "cache")


def test_a_file_set_round_trips(store: CheckpointStore, tmp_path: Path) -> None:
    """What is committed is fetched, listed and read back byte for byte; the location records
    hold leads back to the key."""
    assert store.fetch(KEY) is None and store.read_meta_text(KEY) is None
    write_set(store, KEY, seq=2, weights=os.urandom(4096))
    fetched = store.fetch(KEY)
    assert fetched is not None
    assert json.loads((fetched / META_FILE).read_text())["seq"] == 2
    assert set(store.files(KEY)) == {"adapter_model.safetensors", "adapter_config.json", META_FILE}
    assert store.files(KEY)["adapter_model.safetensors"] == 4096
    assert store.key_of(store.location(KEY)) == KEY
    with pytest.raises(CheckpointPathError):
        store.key_of("/elsewhere/run-1/weights/x" if isinstance(store, LocalStore) else "s3://x/y")


def test_a_replaced_set_reads_as_the_new_one_and_a_meta_change_keeps_the_files(
    store: CheckpointStore,
) -> None:
    """A snapshot written over: the files of the old set that the new one lacks are gone; a
    meta rewritten in place (a TTL, published) is what the next fetch holds."""
    key = "m-1/_snapshot"
    write_set(store, key, seq=1)
    staged = store.staging(key)
    (staged / "grads.safetensors").write_bytes(b"g")
    (staged / META_FILE).write_text(json.dumps({"id": key, "seq": 5}))
    store.commit(key, staged)
    assert set(store.files(key)) == {"grads.safetensors", META_FILE}
    assert store.write_text(key, META_FILE, json.dumps({"id": key, "seq": 5, "public": True}))
    fetched = store.fetch(key)
    assert fetched is not None and json.loads((fetched / META_FILE).read_text())["public"]
    assert (fetched / "grads.safetensors").read_bytes() == b"g"
    assert not store.write_text("m-1/absent", META_FILE, "{}")


def test_remove_takes_the_set_away_unless_it_is_no_longer_due(store: CheckpointStore) -> None:
    write_set(store, KEY, seq=2)
    assert store.remove(KEY, lambda meta: False) is Removal.KEPT
    assert store.fetch(KEY) is not None
    assert store.remove(KEY, lambda meta: meta is not None) is Removal.REMOVED
    assert store.fetch(KEY) is None and store.files(KEY) == {}
    assert store.remove(KEY) is Removal.ABSENT


def test_copy_makes_a_set_with_its_own_meta(store: CheckpointStore) -> None:
    write_set(store, KEY, seq=2)
    size = store.copy(KEY, "copy-1/weights/step-2", json.dumps({"id": "copy", "seq": 2}))
    fetched = store.fetch("copy-1/weights/step-2")
    assert fetched is not None and size == sum(store.files("copy-1/weights/step-2").values())
    assert json.loads((fetched / META_FILE).read_text())["id"] == "copy"
    assert (fetched / "adapter_model.safetensors").read_bytes() == b"w" * 100


def test_an_s3_set_is_invisible_until_its_meta_lands(s3_server: S3Server, tmp_path: Path) -> None:
    """Data files uploaded, meta not yet (a writer stopped midway): no set is there; a reader
    of a set being replaced gets the old one whole, never the new files under the old meta."""
    bucket = s3_server.bucket()
    store = s3_server.store(bucket, tmp_path / "writer")
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key=f"ckpt/{KEY}/adapter_model.safetensors", Body=b"half")
    assert store.fetch(KEY) is None and store.read_meta_text(KEY) is None
    assert store.files(KEY) == {}

    write_set(store, KEY, seq=1, weights=b"old")
    # A new commit's data file has landed, its meta not yet: the reader reads the meta again,
    # and (nothing else changing) says the set keeps changing instead of mixing the two.
    client.put_object(
        Bucket=bucket,
        Key=f"ckpt/{KEY}/adapter_model.safetensors",
        Body=b"new",
        Metadata={"qt-generation": "a-newer-commit"},
    )
    reader = s3_server.store(bucket, tmp_path / "reader")
    with pytest.raises(StorageUnavailableError, match="changing"):
        reader.fetch(KEY)
    write_set(store, KEY, seq=2, weights=b"new")  # the commit completes
    fetched = reader.fetch(KEY)
    assert fetched is not None and (fetched / "adapter_model.safetensors").read_bytes() == b"new"


def test_a_late_writer_cannot_replace_the_set_it_read_after_another_did(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A worker reads the snapshot's version, is cut off, and its commit arrives after the
    model's next owner replaced the snapshot: the bucket refuses its meta (a conditional
    PUT), its data files went up beside the set, not over it, so the newer set reads whole;
    a first write expecting no set is refused once there is one."""
    bucket = s3_server.bucket()
    late = s3_server.store(bucket, tmp_path / "late-writer")
    owner = s3_server.store(bucket, tmp_path / "next-owner")
    key = "m-1/_snapshot"
    write_set(owner, key, seq=5, weights=b"seq 5")
    text, read_version = late.read_meta_version(key)
    assert text is not None and json.loads(text)["seq"] == 5 and read_version
    write_set(owner, key, seq=9, weights=b"seq 9")  # the next owner's snapshot

    staged = late.staging(key)
    (staged / "adapter_model.safetensors").write_bytes(b"seq 7")
    (staged / META_FILE).write_text(json.dumps({"id": key, "seq": 7}))
    with pytest.raises(CheckpointReplacedError, match="replaced by another writer"):
        late.commit(key, staged, expect=read_version)
    reader = s3_server.store(bucket, tmp_path / "reader")
    fetched = reader.fetch(key)
    assert fetched is not None and json.loads((fetched / META_FILE).read_text())["seq"] == 9
    assert (fetched / "adapter_model.safetensors").read_bytes() == b"seq 9"
    assert set(reader.files(key)) == {"adapter_model.safetensors", "adapter_config.json", META_FILE}

    _, current = reader.read_meta_version(key)
    staged = late.staging(key)
    (staged / META_FILE).write_text(json.dumps({"id": key, "seq": 10}))
    late.commit(key, staged, expect=current)  # over the version it read: it lands
    assert json.loads(reader.read_meta_text(key) or "{}")["seq"] == 10
    staged = late.staging("m-2/_snapshot")
    (staged / META_FILE).write_text("{}")
    late.commit("m-2/_snapshot", staged, expect="")  # none there: it lands
    staged = late.staging("m-2/_snapshot")
    (staged / META_FILE).write_text("{}")
    with pytest.raises(CheckpointReplacedError):
        late.commit("m-2/_snapshot", staged, expect="")


def test_a_big_file_goes_up_in_parts_and_its_presigned_url_serves_it(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """A file above the multipart threshold is uploaded in parts (its ETag says how many);
    the store's presigned URL downloads the very bytes with no credentials (urllib)."""
    bucket = s3_server.bucket()
    store = s3_server.store(bucket, tmp_path / "cache", multipart_threshold=5 * MiB)
    weights = os.urandom(11 * MiB)
    write_set(store, KEY, seq=1, weights=weights)
    head = s3_server.client().head_object(
        Bucket=bucket, Key=f"ckpt/{KEY}/adapter_model.safetensors"
    )
    assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 1 MiB
    url = store.download_url(KEY, "adapter_model.safetensors", 60)
    assert url is not None and "Signature" in url
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.read() == weights
    # Another host's reader, with an empty cache, gets the same bytes.
    other = s3_server.store(bucket, tmp_path / "other")
    fetched = other.fetch(KEY)
    assert fetched is not None
    assert (fetched / "adapter_model.safetensors").read_bytes() == weights


def test_a_store_away_or_misnamed_is_a_clear_error(s3_server: S3Server, tmp_path: Path) -> None:
    """No such bucket: the start-up check names QT_STORAGE. The server gone: reads and writes
    fail with a retryable StorageUnavailableError, after the bounded retries."""
    missing = s3_server.store("no-such-bucket", tmp_path / "c1")
    with pytest.raises(StorageUnavailableError, match="QT_STORAGE"):
        missing.check()
    store = s3_server.store(s3_server.bucket(), tmp_path / "c2", max_attempts=2)
    store.check()
    s3_server.stop()
    with pytest.raises(StorageUnavailableError, match="retry"):
        write_set(store, KEY, seq=1)
    with pytest.raises(StorageUnavailableError):
        store.read_meta_text(KEY)
    assert not list((tmp_path / "c2" / ".staging").iterdir())  # the staged copy is gone


@pytest.mark.parametrize(
    ("storage", "kind"),
    [(None, LocalStore), ("s3://bucket/some/prefix", S3Store)],
)
def test_qt_storage_names_a_directory_or_a_bucket(
    storage: str | None, kind: Callable[..., CheckpointStore], tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path, storage=storage, s3_endpoint_url="http://127.0.0.1:9")
    store = open_store(settings)
    assert isinstance(store, kind)
    if isinstance(store, S3Store):
        assert store.location("r/weights/a") == "s3://bucket/some/prefix/r/weights/a"
    else:
        assert settings.storage_dir == tmp_path / "checkpoints"
    with pytest.raises(ValueError, match="QT_STORAGE"):
        Settings(storage="s3:/bucket")


def test_download_urls_name_the_address_clients_reach(s3_server: S3Server, tmp_path: Path) -> None:
    """Workers reach the store at one address, clients at another (compose: minio:9000 inside,
    localhost:9000 outside): URLs are signed for the public one."""
    store = S3Store(
        "s3://bucket/ckpt",
        tmp_path,
        endpoint_url=s3_server.url,
        public_endpoint_url="http://storage.example:9000",
    )
    url = store.download_url(KEY, "adapter_model.safetensors", 60)
    assert url is not None and url.startswith("http://storage.example:9000/bucket/ckpt/run-1/")


def test_the_s3_cache_keeps_to_its_budget_by_evicting_the_least_recently_used(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """Each set is ~1 MiB and the cache holds 2.5: after four sets only the two used last
    are cached, an evicted one is downloaded again whole, and a copy used within the keep
    window is never evicted, whatever the budget."""
    bucket = s3_server.bucket()
    store = s3_server.store(bucket, tmp_path / "cache")
    assert isinstance(store, S3Store)
    store.cache_bytes, store.cache_keep_recent_s = int(2.5 * MiB), 0.0
    weights = {f"run-1/weights/step-{i}": os.urandom(MiB) for i in range(4)}
    for i, (key, data) in enumerate(weights.items()):
        write_set(store, key, seq=i, weights=data)
        store.fetch("run-1/weights/step-0")  # step-0 stays the most recently used but one
    cached = {
        c.path.relative_to(store.cache_dir).as_posix() for c in cached_copies(store.cache_dir)
    }
    assert cached == {"run-1/weights/step-0", "run-1/weights/step-3"}
    assert sum(c.bytes for c in cached_copies(store.cache_dir)) <= store.cache_bytes
    fetched = store.fetch("run-1/weights/step-1")  # evicted: read from the store again
    assert fetched is not None
    assert (fetched / "adapter_model.safetensors").read_bytes() == weights["run-1/weights/step-1"]

    held = len(cached_copies(store.cache_dir))
    store.cache_bytes, store.cache_keep_recent_s = 1, 600.0  # everything is in use
    write_set(store, "run-1/weights/step-4", seq=4)
    assert len(cached_copies(store.cache_dir)) == held + 1


def test_trimming_spares_copies_in_use_and_skips_unfinished_ones(tmp_path: Path) -> None:
    """cache.trim on a directory: oldest first, nothing used within the window, and the
    dot-directories (staging, downloads under way) are never counted or removed."""
    root = tmp_path / "cache"
    for age, key in [(300, "a/old"), (200, "b/older-but-one"), (10, "c/recent")]:
        copy = root / key
        copy.mkdir(parents=True)
        (copy / "weights").write_bytes(b"x" * 1000)
        (copy / GENERATION_MARKER).write_text("g")
        os.utime(copy / GENERATION_MARKER, (1_000_000 - age, 1_000_000 - age))
    (root / ".staging" / "set-1").mkdir(parents=True)
    (root / ".staging" / "set-1" / GENERATION_MARKER).write_text("g")
    evicted = trim(root, budget_bytes=1500, keep_recent_s=60, now=1_000_000)
    assert evicted == [root / "a/old", root / "b/older-but-one"]
    assert (root / "c/recent").is_dir() and (root / ".staging" / "set-1").is_dir()
    assert trim(root, budget_bytes=0, keep_recent_s=60, now=1_000_000) == []


def test_the_cache_index_trims_without_walking_the_cache_and_walks_again_in_time(
    tmp_path: Path,
) -> None:
    """CacheIndex: one walk of the directory, then every copy this process adds, uses and
    removes kept in memory, so trimming after each upload walks nothing (the old trim walked
    every copy each time); it evicts as cache.trim does, least recently used first. A copy
    another process adds is seen once the walk is RESCAN_S old."""
    root = tmp_path / "cache"

    def copy(key: str, used_s_ago: float) -> Path:
        path = root / key
        path.mkdir(parents=True)
        (path / "weights").write_bytes(b"x" * 1000)
        (path / GENERATION_MARKER).write_text("g")
        when = time.time() - used_s_ago
        os.utime(path / GENERATION_MARKER, (when, when))
        return path

    clock = [0.0]
    index = CacheIndex(root, clock=lambda: clock[0])
    first = copy("run/a", 300)
    assert index.trim(budget_bytes=10**6, keep_recent_s=60) == []
    for i, key in enumerate(["run/b", "run/c", "run/d"]):
        index.added(copy(key, 200 - 50 * i))
        clock[0] += 1
        assert index.trim(budget_bytes=10**6, keep_recent_s=60) == []
    assert index.walks == 1
    index.used(first)  # now the most recently used
    index.removed(root / "run/d")
    shutil.rmtree(root / "run/d")
    # The three left hold ~3,000 bytes: down to 2,000 evicts b, the oldest not in use.
    assert index.trim(budget_bytes=2100, keep_recent_s=60) == [root / "run/b"]
    assert index.walks == 1
    assert {c.path for c in cached_copies(root)} == {first, root / "run/c"}

    copy("elsewhere/e", 500)  # another process's copy: unseen until the next walk
    assert index.trim(budget_bytes=2100, keep_recent_s=60) == []
    clock[0] += RESCAN_S
    assert index.trim(budget_bytes=2100, keep_recent_s=60) == [root / "elsewhere/e"]
    assert index.walks == 2
