"""The few object-store calls the remote tier makes, on S3 (AWS or any S3-compatible server).

boto3 directly rather than multi-storage-client: the protocol needs exactly a conditional PUT
(``If-None-Match: *`` so an object is never overwritten, ``If-Match: <etag>`` so latest.json
never moves backwards), HEAD for size and metadata, GET, paginated LIST and DELETE, each one
boto3 call; multi-storage-client would put its profile layer over the same boto3 client.
Every PUT carries Content-MD5, which the server checks on receipt: the independent checksum of
the transfer, beside the manifest's crc32c that a download re-computes. Every call goes through
object_retry.RetryPolicy (transient errors retried within checkpoint.remote.retry_budget_s).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
from botocore.config import Config

from resiliency.storage.object_retry import (
    ObjectStoreAccessError,
    RetryPolicy,
    access_line,
    error_code,
)

log = logging.getLogger(__name__)
_CHUNK = 8 << 20
# Error codes as AWS and S3-compatible servers spell them.
_LOST_CONDITION = ("PreconditionFailed", "412", "ConditionalRequestConflict")
_NO_SUCH_KEY = ("404", "NoSuchKey", "NotFound")
_NO_SUCH_UPLOAD = ("NoSuchUpload",)


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


class ObjectMissing(Exception):
    """An object that was to be read is not there (a step's object deleted or never written)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    metadata: dict[str, str] = field(default_factory=dict)


def parse_s3_url(url: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix") (no trailing slash)."""
    if not url.startswith("s3://") or len(url) <= 5:
        raise ValueError(f"{url!r} is not an s3://bucket[/prefix] URL")
    bucket, _, prefix = url[5:].partition("/")
    return bucket, prefix.strip("/")


def file_md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode()


class ObjectStore:
    """One bucket; keys are relative to the URL's prefix. Credentials come from the usual
    places (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile, an instance role)."""

    def __init__(
        self,
        url: str,
        endpoint_url: str | None = None,
        workers: int = 8,
        part_mib: int = 512,
        retry_budget_s: float = 120.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.part_bytes = part_mib << 20
        self.bucket, self.prefix = parse_s3_url(url)
        self.policy = RetryPolicy(budget_s=retry_budget_s)
        config = Config(
            max_pool_connections=max(10, workers * 2),
            retries={"total_max_attempts": 1},  # object_retry.RetryPolicy is the one policy
            connect_timeout=10,
            read_timeout=60,  # a stalled server is a transient error, not a hang
            # Content-MD5 is the transfer checksum here; trailing CRC checksums are not
            # implemented by every S3-compatible server.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"),
            region_name=os.environ.get("AWS_REGION", "us-east-1"),
            config=config,
        )

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _call(self, what: str, rel: str, fn: Any, /, **kwargs: Any) -> Any:
        """One client call under the retry policy; ``rel`` names it in errors."""
        return self.policy.call(f"{self.url}/{rel}", what, lambda: fn(**kwargs))

    def put_file(self, rel: str, path: Path, metadata: dict[str, str]) -> None:
        """Upload ``path`` as a new object; PreconditionFailed if the key exists. Files above
        ``part_bytes`` go up in parts (one PUT takes at most 5 GiB)."""
        if path.stat().st_size > self.part_bytes:
            self._put_parts(rel, path, metadata)
            return
        md5 = file_md5(path)

        def put() -> str:
            with open(path, "rb") as body:  # reopened for each try: a retry resends it all
                return self._put_once(rel, body, md5, metadata, IfNoneMatch="*")

        self._conditional(rel, "PUT", put)

    def _put_parts(self, rel: str, path: Path, metadata: dict[str, str]) -> None:
        key, c = self.key(rel), self.client
        upload = self._call("create multipart upload", rel, c.create_multipart_upload,
                            Bucket=self.bucket, Key=key, Metadata=metadata)  # fmt: skip
        ids = {"Bucket": self.bucket, "Key": key, "UploadId": upload["UploadId"]}
        parts = []
        try:
            with open(path, "rb") as f:
                while chunk := f.read(self.part_bytes):
                    md5 = base64.b64encode(hashlib.md5(chunk, usedforsecurity=False).digest())
                    reply = self._call(f"upload part {len(parts) + 1}", rel, c.upload_part,
                                       PartNumber=len(parts) + 1, Body=chunk,
                                       ContentMD5=md5.decode(), **ids)  # fmt: skip
                    parts.append({"ETag": reply["ETag"], "PartNumber": len(parts) + 1})
            self._call("complete multipart upload", rel, c.complete_multipart_upload,
                       MultipartUpload={"Parts": parts}, IfNoneMatch="*", **ids)  # fmt: skip
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _NO_SUCH_UPLOAD:
                return  # completed by a try whose answer was lost: the caller's HEAD checks it
            self._abort(rel, ids)
            if error_code(exc) in _LOST_CONDITION:
                raise PreconditionFailed(f"{self.url}/{rel}: {error_code(exc)}") from None
            raise
        except BaseException:
            self._abort(rel, ids)
            raise

    def _abort(self, rel: str, ids: dict[str, str]) -> None:
        try:  # best effort: an upload left behind costs storage, not correctness
            self.client.abort_multipart_upload(**ids)
        except Exception as exc:  # noqa: BLE001 - the original error is the one to report
            log.warning("object store: abort of the multipart upload of %s failed: %s", rel, exc)

    def put_bytes(
        self, rel: str, data: bytes, if_match: str | None = None, metadata: dict | None = None
    ) -> str:
        """A new object (or, with ``if_match``, a replacement of that version); its ETag."""
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        condition = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
        return self._conditional(
            rel, "PUT", lambda: self._put_once(rel, data, md5, metadata or {}, **condition)
        )

    def _put_once(self, rel: str, body: object, md5: str, metadata: dict, **condition: str) -> str:
        reply = self.client.put_object(
            Bucket=self.bucket, Key=self.key(rel), Body=body, ContentMD5=md5, Metadata=metadata,
            **condition,
        )  # fmt: skip
        return str(reply["ETag"])

    def _conditional(self, rel: str, what: str, put: Any) -> str:
        """A conditional write under the retry policy. A retry of a write whose answer was
        lost can find its own object: PreconditionFailed then, and callers check the content
        (remote.py never trusts a lost condition without reading what is there)."""
        try:
            return str(self.policy.call(f"{self.url}/{rel}", what, put))
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _LOST_CONDITION:
                raise PreconditionFailed(f"{self.url}/{rel}: {error_code(exc)}") from None
            raise

    def head(self, rel: str) -> ObjectInfo | None:
        try:
            reply = self._call("HEAD", rel, self.client.head_object, Bucket=self.bucket,
                               Key=self.key(rel))  # fmt: skip
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _NO_SUCH_KEY:
                return None
            raise
        return ObjectInfo(rel, reply["ContentLength"], reply["ETag"], reply.get("Metadata", {}))

    def get_bytes(self, rel: str) -> tuple[bytes, str] | None:
        """(content, ETag), or None if there is no such object."""

        def get() -> tuple[bytes, str]:  # the body is read inside the try: a cut one retries
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
            return reply["Body"].read(), str(reply["ETag"])

        try:
            result: tuple[bytes, str] = self.policy.call(f"{self.url}/{rel}", "GET", get)
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _NO_SUCH_KEY:
                return None
            raise
        return result

    def download(self, rel: str, path: Path) -> None:
        """``rel`` into ``path``, the whole object again on every try; ObjectMissing if absent."""

        def get() -> None:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
            with open(path, "wb") as out:
                for chunk in reply["Body"].iter_chunks(_CHUNK):
                    out.write(chunk)

        try:
            self.policy.call(f"{self.url}/{rel}", "GET", get)
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _NO_SUCH_KEY:
                raise ObjectMissing(f"{self.url}/{rel} does not exist") from None
            raise

    def list(self, rel_prefix: str = "", delimiter: str | None = None) -> Iterator[str]:
        """Keys (relative) under ``rel_prefix``; with a delimiter, the common prefixes. Each
        page is one call under the retry policy."""
        extra = {"Delimiter": delimiter} if delimiter else {}
        strip, token = len(self.key("")), None
        while True:
            more = {"ContinuationToken": token} if token else {}
            page = self._call("LIST", rel_prefix, self.client.list_objects_v2, Bucket=self.bucket,
                              Prefix=self.key(rel_prefix), **extra, **more)  # fmt: skip
            if delimiter:
                yield from (p["Prefix"][strip:] for p in page.get("CommonPrefixes", []))
            else:
                yield from (o["Key"][strip:] for o in page.get("Contents", []))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def delete(self, rel: str) -> None:
        self._call("DELETE", rel, self.client.delete_object, Bucket=self.bucket, Key=self.key(rel))

    def head_bucket(self) -> None:
        """The bucket exists and these credentials reach it (ObjectStoreAccessError if not)."""
        try:
            self._call("HEAD bucket", "", self.client.head_bucket, Bucket=self.bucket)
        except botocore.exceptions.ClientError as exc:
            if error_code(exc) in _NO_SUCH_KEY:  # a HEAD has no body: only "404" says it
                raise ObjectStoreAccessError(access_line(self.url, exc, bucket=True)) from None
            raise
