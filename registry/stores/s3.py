"""S3Store: artifacts in S3 (or MinIO, moto) through boto3, for ``s3://bucket/prefix`` URIs.

Uploads carry a SHA-256 checksum (``ChecksumAlgorithm='SHA256'``), large files go multipart via
``TransferConfig``, and the manifest is created with ``IfNoneMatch='*'`` so a published version is
never overwritten. Some S3 implementations (moto) do not validate client-sent checksums, so every
download is hashed and checked against the manifest anyway. Credentials come from boto3's usual
chain (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / profiles / roles) and are never logged.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.errors import StoreConfigError, UploadError
from registry.manifest import FileEntry
from registry.stores._tree import TreeStore, files_prefix
from registry.stores.base import ProgressFn, check_key

log = logging.getLogger(__name__)

MIB = 1024 * 1024
ENV_ENDPOINT_URL = "ENGINEWRIGHT_S3_ENDPOINT_URL"
ENV_MAX_ATTEMPTS = "ENGINEWRIGHT_S3_MAX_ATTEMPTS"
ENV_MULTIPART_THRESHOLD_MIB = "ENGINEWRIGHT_S3_MULTIPART_THRESHOLD_MIB"
ENV_MULTIPART_CHUNKSIZE_MIB = "ENGINEWRIGHT_S3_MULTIPART_CHUNKSIZE_MIB"
ENV_MAX_CONCURRENCY = "ENGINEWRIGHT_S3_MAX_CONCURRENCY"


@dataclass(frozen=True)
class S3Settings:
    """Connection and transfer settings of an S3Store (credentials stay with boto3's own chain)."""

    endpoint_url: str | None = None
    region_name: str | None = None
    max_attempts: int = 5
    multipart_threshold: int = 64 * MIB
    multipart_chunksize: int = 64 * MIB
    max_concurrency: int = 4

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> S3Settings:
        """Read ``ENGINEWRIGHT_S3_*`` variables (and ``AWS_DEFAULT_REGION`` / ``AWS_REGION``)."""
        env = os.environ if environ is None else environ
        return cls(
            endpoint_url=env.get(ENV_ENDPOINT_URL) or None,
            region_name=env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION") or None,
            max_attempts=_int_env(env, ENV_MAX_ATTEMPTS, 5),
            multipart_threshold=_int_env(env, ENV_MULTIPART_THRESHOLD_MIB, 64) * MIB,
            multipart_chunksize=_int_env(env, ENV_MULTIPART_CHUNKSIZE_MIB, 64) * MIB,
            max_concurrency=_int_env(env, ENV_MAX_CONCURRENCY, 4),
        )


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise StoreConfigError(f"Invalid value '{raw}' for environment variable {name}: expected an integer >= 1.")
    return value


def make_s3_client(settings: S3Settings) -> Any:
    """A boto3 S3 client with standard-mode retries; path-style addressing for custom endpoints."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": settings.max_attempts},
        s3={"addressing_style": "path"} if settings.endpoint_url else None,
    )
    return boto3.session.Session().client(
        "s3", endpoint_url=settings.endpoint_url, region_name=settings.region_name, config=config
    )


class S3Store(TreeStore):
    """Artifact store under ``s3://<bucket>/<prefix>``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        settings: S3Settings | None = None,
        client: Any = None,
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        if not bucket:
            raise StoreConfigError("Empty S3 bucket name (from setting artifacts.uri).")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.settings = settings or S3Settings.from_env()
        self.client = client if client is not None else make_s3_client(self.settings)
        self.transfer_config = TransferConfig(
            multipart_threshold=self.settings.multipart_threshold,
            multipart_chunksize=self.settings.multipart_chunksize,
            max_concurrency=self.settings.max_concurrency,
        )

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint_url={self.settings.endpoint_url!r})"

    def uri(self, key: str) -> str:
        """``s3://<bucket>/<prefix>/<key>``."""
        return f"s3://{self.bucket}/{self._object_key(check_key(key))}"

    def _object_key(self, key: str, name: str = "") -> str:
        parts = [p for p in (self.prefix, key, name) if p]
        return "/".join(parts)

    def _file_key(self, key: str, rel: str) -> str:
        return self._object_key(files_prefix(key), rel)

    def _read_bytes(self, key: str, name: str) -> bytes | None:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key, name))
        except self.client.exceptions.NoSuchKey:
            return None
        except self.client.exceptions.NoSuchBucket as e:
            raise self._no_bucket() from e
        return resp["Body"].read()

    def _create_exclusive(self, key: str, name: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        for _attempt in range(5):
            try:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=self._object_key(key, name),
                    Body=data,
                    ContentType="application/json",
                    ChecksumAlgorithm="SHA256",
                    IfNoneMatch="*",
                )
                return True
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code")
                if code in ("PreconditionFailed", "412"):
                    return False
                if code in ("ConditionalRequestConflict", "409"):
                    continue  # a concurrent conditional write is in flight: try again
                raise
        return False

    def _stored_matches(self, key: str, rel: str, entry: FileEntry) -> bool:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._file_key(key, rel))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            if e.response.get("Error", {}).get("Code") == "NoSuchBucket":
                raise self._no_bucket() from e
            raise
        return head.get("ContentLength") == entry.size and head.get("Metadata", {}).get("sha256") == entry.sha256

    def _upload(self, local: Path, key: str, rel: str, entry: FileEntry, progress: ProgressFn | None) -> None:
        """Upload with whole-file retries (exponential backoff) on top of botocore's per-request ones."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError

        attempts = self.settings.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                self._upload_once(local, key, rel, entry, progress)
                return
            except StoreConfigError:
                raise
            except (UploadError, S3UploadFailedError, BotoCoreError, OSError) as e:
                if attempt == attempts:
                    raise
                delay = min(0.5 * 2 ** (attempt - 1), 8.0)
                log.warning("upload of '%s' failed (attempt %d of %d, retrying in %.1f s): %s",
                            rel, attempt, attempts, delay, e)
                time.sleep(delay)

    def _upload_once(self, local: Path, key: str, rel: str, entry: FileEntry, progress: ProgressFn | None) -> None:
        from boto3.exceptions import S3UploadFailedError

        try:
            self.client.upload_file(
                str(local),
                self.bucket,
                self._file_key(key, rel),
                ExtraArgs={"ChecksumAlgorithm": "SHA256", "Metadata": {"sha256": entry.sha256}},
                Config=self.transfer_config,
                Callback=(lambda n: progress(rel, n)) if progress is not None else None,
            )
        except S3UploadFailedError as e:
            if "NoSuchBucket" in str(e):
                raise self._no_bucket() from e
            raise
        # s3transfer swallows a BaseException (e.g. KeyboardInterrupt) raised inside a transfer
        # and returns normally with nothing stored, so check every object before the manifest.
        if not self._stored_matches(key, rel, entry):
            raise UploadError(
                f"Upload of '{local}' to 's3://{self.bucket}/{self._file_key(key, rel)}' did not land intact "
                f"(expected {entry.size} bytes, sha256 {entry.sha256}); the manifest was not written."
            )

    def _list_files(self, key: str) -> list[str]:
        base = self._object_key(files_prefix(key)) + "/"
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            found += [obj["Key"][len(base):] for obj in page.get("Contents", [])]
        return found

    def _delete_file(self, key: str, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._file_key(key, rel))

    def _download(self, key: str, rel: str, dest: Path, progress: ProgressFn | None) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.download_file(
                self.bucket,
                self._file_key(key, rel),
                str(dest),
                Config=self.transfer_config,
                Callback=(lambda n: progress(rel, n)) if progress is not None else None,
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def _no_bucket(self) -> StoreConfigError:
        return StoreConfigError(
            f"S3 bucket '{self.bucket}' does not exist at endpoint "
            f"'{self.settings.endpoint_url or 'AWS default'}' (from setting artifacts.uri and "
            f"{ENV_ENDPOINT_URL})."
        )
