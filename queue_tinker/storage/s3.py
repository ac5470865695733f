"""Checkpoint storage in an S3 bucket (AWS, MinIO, R2, ...), through boto3.

`s3://bucket/prefix/<key>/<file>` holds a file set as plain objects, so a checkpoint stays an
ordinary PEFT file set there too. S3 has no rename, so a commit uploads the data files first
and the meta last, each object tagged with the commit's generation; the meta's own metadata
names the generation and the files' objects. A reader takes the meta, then each file only if
it carries the meta's generation, so it sees one whole set, never a mix. A commit that replaces
a set (a snapshot) puts its data files under names of its own (`<generation>.<file>`), so the
set it replaces stays whole until its meta moves, and the objects of a writer that never got
its meta in (killed, or fenced) harm no reader. With `expect`, the meta goes up only over the
version the writer read (a conditional PUT: If-Match, or If-None-Match when there was none):
the store itself refuses a late writer, however late its request arrives.

Reads land in a local cache directory (one copy per key, reused while its generation is the
stored one); writes are staged in it and kept as the cached copy once uploaded. The cache is
held under a byte budget (storage/cache.py).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from queue_tinker.errors import (
    CheckpointPathError,
    CheckpointReplacedError,
    StorageUnavailableError,
)
from queue_tinker.storage import cache
from queue_tinker.storage.base import CheckpointStore, Removal, StillDue, check_key
from queue_tinker.storage.cache import GENERATION_MARKER
from queue_tinker.storage.local import replace_dir
from queue_tinker.types.service.checkpoints import META_FILE

log = logging.getLogger(__name__)

GENERATION = "qt-generation"  # object metadata: the commit a file belongs to
FILES = "qt-files"  # the meta's metadata: the set's other files, comma-separated
READ_TRIES = 3  # a set replaced while read is read again, this many times at most
NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
REPLACED = {"PreconditionFailed", "412", "ConditionalRequestConflict"}


def parse_s3_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of s3://bucket[/prefix]; the prefix without slashes at its ends."""
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r} is not an s3:// URL")
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"{url!r} names no bucket; expected s3://bucket/prefix")
    return bucket, prefix.strip("/")


class S3Store(CheckpointStore):
    def __init__(
        self,
        url: str,
        cache_dir: Path,
        *,
        endpoint_url: str | None = None,
        public_endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = 64 * 2**20,
        max_attempts: int = 4,
        cache_bytes: int = 20 * 2**30,
        cache_keep_recent_s: float = 600.0,
    ) -> None:
        try:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config
        except ImportError as err:
            raise StorageUnavailableError(
                f"QT_STORAGE={url}: S3 storage needs boto3 "
                "(pip install 'queue-tinker[server]' or '[worker]')"
            ) from err
        self.bucket, self.prefix = parse_s3_url(url)
        self.root = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self.cache_keep_recent_s = cache_keep_recent_s
        # Bounded retries inside botocore absorb a blip; past them an op fails, retryably.
        config = Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=5,
            read_timeout=60,
        )
        self.client: Any = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        # Download URLs are signed for the address clients reach the store at, which may not
        # be the workers' (compose: http://minio:9000 inside, localhost:9000 outside); signing
        # sends no request.
        self.signer: Any = (
            boto3.client("s3", endpoint_url=public_endpoint_url, region_name=region, config=config)
            if public_endpoint_url
            else self.client
        )
        # Multipart above the threshold, in parts of the same size (S3's least is 5 MiB).
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_threshold
        )
        self._cache_lock = threading.Lock()  # the gateway fetches from several threads
        self._cache = cache.CacheIndex(cache_dir)  # under the lock

    # --- names ---------------------------------------------------------------------------
    def _object(self, key: str, name: str = "") -> str:
        base = f"{self.prefix}/{check_key(key)}" if self.prefix else check_key(key)
        return f"{base}/{name}" if name else base

    def location(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._object(key)}"

    def key_of(self, location: str) -> str:
        key = location.removeprefix(f"{self.root}/")
        if key == location:
            raise CheckpointPathError(f"{location} is not inside checkpoint storage {self.root}")
        return check_key(key)

    # --- errors --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """The store's failures as StorageUnavailableError (a server error: retrying may
        succeed), naming the store and what was being done."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (BotoCoreError, ClientError, Boto3Error) as err:
            raise StorageUnavailableError(
                f"checkpoint storage {self.root} (QT_STORAGE) failed to {what}: {err}; "
                "retry once it is reachable"
            ) from err

    def check(self) -> None:
        with self._reaching("show its bucket (missing bucket, or wrong credentials?)"):
            self.client.head_bucket(Bucket=self.bucket)

    def _get(self, key: str, name: str) -> dict[str, Any] | None:
        """get_object's response, or None if there is no such object."""
        from botocore.exceptions import ClientError

        with self._reaching(f"read {key}/{name}"):
            try:
                return dict(self.client.get_object(Bucket=self.bucket, Key=self._object(key, name)))
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in NOT_FOUND:
                    return None
                raise

    def _head(self, key: str, name: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        with self._reaching(f"read {key}/{name}"):
            try:
                return dict(
                    self.client.head_object(Bucket=self.bucket, Key=self._object(key, name))
                )
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in NOT_FOUND:
                    return None
                raise

    def _listing(self, key: str) -> dict[str, int]:
        """The objects right under `key` (not deeper) and their sizes."""
        prefix = self._object(key, "x")[:-1]
        found: dict[str, int] = {}
        with self._reaching(f"list {key}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                for item in page.get("Contents", []):
                    name = item["Key"][len(prefix) :]
                    if "/" not in name:
                        found[name] = int(item["Size"])
        return found

    def _delete(self, key: str, names: list[str]) -> None:
        with self._reaching(f"delete {key}"):
            for start in range(0, len(names), 1000):  # delete_objects takes 1,000 at most
                batch = [{"Key": self._object(key, n)} for n in names[start : start + 1000]]
                self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )

    # --- writing -------------------------------------------------------------------------
    def staging(self, key: str) -> Path:
        check_key(key)
        root = self.cache_dir / ".staging"
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="set-", dir=root))

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def commit(self, key: str, staged: Path, expect: str | None = None) -> None:
        generation = uuid.uuid4().hex
        files = sorted(p.name for p in staged.iterdir() if p.is_file() and p.name != META_FILE)
        try:
            before = self._listing(key)
            # Replacing a set: the new files beside the old, never over them.
            prefix = f"{generation}." if META_FILE in before else ""
            names = [prefix + name for name in files]
            with self._reaching(f"upload {key}"):
                for file, name in zip(files, names, strict=True):
                    self.client.upload_file(
                        str(staged / file),
                        self.bucket,
                        self._object(key, name),
                        ExtraArgs={"Metadata": {GENERATION: generation}},
                        Config=self.transfer,
                    )
                # The meta last: until it is there, readers see the previous set or none.
                self._put_meta(key, (staged / META_FILE).read_bytes(), generation, names, expect)
        except BaseException:
            self.discard(staged)
            raise
        stale = [n for n in before if n not in names and n != META_FILE]
        if stale:  # files of the set replaced that the new one lacks (grads, say)
            try:
                self._delete(key, stale)
            except StorageUnavailableError as err:
                # Committed all the same: readers take only the files its meta names.
                log.warning("%s: stale files %s left (%s)", key, stale, err)
        # What was uploaded is the cached copy: the next read of this set downloads nothing.
        (staged / GENERATION_MARKER).write_text(generation)
        with self._cache_lock:
            cached = self.cache_dir / key
            cached.parent.mkdir(parents=True, exist_ok=True)
            replace_dir(staged, cached)
            self._cache.added(cached)
            self._trim_cache()

    def _put_meta(
        self, key: str, body: bytes, generation: str, names: list[str], expect: str | None = None
    ) -> None:
        from botocore.exceptions import ClientError

        # A conditional PUT: only over the meta the writer read, or where there was none.
        condition: dict[str, str] = {}
        if expect is not None:
            condition = {"IfMatch": expect} if expect else {"IfNoneMatch": "*"}
        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._object(key, META_FILE),
                Body=body,
                Metadata={GENERATION: generation, FILES: ",".join(names)},
                ContentType="application/json",
                **condition,
            )
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in REPLACED:
                raise CheckpointReplacedError(
                    f"checkpoint storage {self.root}: {key} was replaced by another writer "
                    "after this one read it; not written over"
                ) from err
            raise

    def write_text(self, key: str, name: str, text: str) -> bool:
        head = self._head(key, name)
        if head is None:
            return False
        with self._reaching(f"write {key}/{name}"):
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._object(key, name),
                Body=text.encode(),
                Metadata=head.get("Metadata", {}),  # the generation and file list stay
            )
        return True

    def mark(self, key: str, name: str) -> None:
        with self._reaching(f"write {key}/{name}"):
            self.client.put_object(Bucket=self.bucket, Key=self._object(key, name), Body=b"")

    # --- reading -------------------------------------------------------------------------
    def read_meta_version(self, key: str) -> tuple[str | None, str | None]:
        response = self._get(key, META_FILE)
        if response is None:
            return None, ""
        with self._reaching(f"read {key}/{META_FILE}"):
            return bytes(response["Body"].read()).decode(), str(response["ETag"])

    def read_text(self, key: str, name: str) -> str | None:
        response = self._get(key, name)
        if response is None:
            return None
        with self._reaching(f"read {key}/{name}"):
            return bytes(response["Body"].read()).decode()

    def fetch(self, key: str) -> Path | None:
        for _ in range(READ_TRIES):
            meta = self._get(key, META_FILE)
            if meta is None:
                return None
            with self._reaching(f"read {key}/{META_FILE}"):
                meta_bytes = bytes(meta["Body"].read())
            metadata = meta.get("Metadata", {})
            generation = metadata.get(GENERATION, "")
            names = [n for n in metadata.get(FILES, "").split(",") if n]
            with self._cache_lock:
                cached = self._cached(key, generation, meta_bytes)
                if cached is None:
                    cached = self._download(key, generation, names, meta_bytes)
                    if cached is not None:
                        self._trim_cache()
            if cached is not None:
                return cached
        raise StorageUnavailableError(
            f"checkpoint storage {self.root}: {key} kept changing while it was read; retry"
        )

    def _cached(self, key: str, generation: str, meta: bytes) -> Path | None:
        cached = self.cache_dir / key
        try:
            held = (cached / GENERATION_MARKER).read_text()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not generation or held != generation:
            return None
        (cached / META_FILE).write_bytes(meta)  # a meta change (TTL, published) keeps the files
        self._cache.used(cached)
        return cached

    def _trim_cache(self) -> None:
        """After a copy was added (under the cache lock): hold the cache to its budget."""
        evicted = self._cache.trim(self.cache_bytes, self.cache_keep_recent_s)
        if evicted:
            log.info(
                "storage cache over %d bytes: evicted %d copies", self.cache_bytes, len(evicted)
            )

    def _download(self, key: str, generation: str, names: list[str], meta: bytes) -> Path | None:
        """The set of `generation` into the cache; None if a file belongs to another commit
        (the set is being replaced: read the meta again)."""
        cached = self.cache_dir / key
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        try:
            for name in names:
                response = self._get(key, name)
                if response is None or response.get("Metadata", {}).get(GENERATION) != generation:
                    return None
                file = tmp / name.removeprefix(f"{generation}.")
                with self._reaching(f"read {key}/{name}"), file.open("wb") as out:
                    shutil.copyfileobj(response["Body"], out, 2**20)
            (tmp / META_FILE).write_bytes(meta)
            (tmp / GENERATION_MARKER).write_text(generation)
            replace_dir(tmp, cached)
            self._cache.added(cached)
            return cached
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def files(self, key: str) -> dict[str, int]:
        head = self._head(key, META_FILE)
        if head is None:
            return {}
        metadata = head.get("Metadata", {})
        names = set(metadata.get(FILES, "").split(",")) | {META_FILE}
        generation = f"{metadata.get(GENERATION, '')}."
        return {
            n.removeprefix(generation): size for n, size in self._listing(key).items() if n in names
        }

    # --- removing, copying, URLs ---------------------------------------------------------
    def remove(self, key: str, still_due: StillDue | None = None) -> Removal:
        meta = self.read_text(key, META_FILE)
        if meta is not None and still_due is not None and not still_due(meta):
            return Removal.KEPT
        names = list(self._listing(key))
        if not names:
            return Removal.ABSENT
        if META_FILE in names:  # first: from here on the set reads as gone
            self._delete(key, [META_FILE])
        self._delete(key, [n for n in names if n != META_FILE])
        with self._cache_lock:
            shutil.rmtree(self.cache_dir / key, ignore_errors=True)
            self._cache.removed(self.cache_dir / key)
        return Removal.REMOVED if meta is not None else Removal.ABSENT

    def copy(self, source: str, destination: str, meta_text: str) -> int:
        head = self._head(source, META_FILE)
        if head is None:
            raise FileNotFoundError(self.location(source))
        names = [n for n in head.get("Metadata", {}).get(FILES, "").split(",") if n]
        source_generation = f"{head.get('Metadata', {}).get(GENERATION, '')}."
        sizes = self._listing(source)
        generation = uuid.uuid4().hex
        with self._reaching(f"copy {source} to {destination}"):
            for name in names:
                # The managed copy goes multipart (server side) for big objects.
                self.client.copy(
                    {"Bucket": self.bucket, "Key": self._object(source, name)},
                    self.bucket,
                    self._object(destination, name.removeprefix(source_generation)),
                    ExtraArgs={
                        "Metadata": {GENERATION: generation},
                        "MetadataDirective": "REPLACE",
                    },
                    Config=self.transfer,
                )
            body = meta_text.encode()
            copied = [name.removeprefix(source_generation) for name in names]
            self._put_meta(destination, body, generation, copied)
        return sum(sizes.get(n, 0) for n in names) + len(body)

    def download_url(self, key: str, name: str, expires_s: int) -> str | None:
        with self._reaching(f"sign a URL for {key}/{name}"):
            url = self.signer.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self._object(key, name)},
                ExpiresIn=expires_s,
            )
        return str(url)
