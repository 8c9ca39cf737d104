"""The few object-store calls the remote tier makes, on S3 (AWS or any S3-compatible server).

boto3 directly rather than multi-storage-client: the protocol needs exactly a conditional PUT
(``If-None-Match: *`` so an object is never overwritten, ``If-Match: <etag>`` so latest.json
never moves backwards), HEAD for size and metadata, GET, paginated LIST and DELETE, each one
boto3 call; multi-storage-client would put its profile layer over the same boto3 client.
Every PUT carries Content-MD5, which the server checks on receipt: the independent checksum of
the transfer, beside the manifest's crc32c that a download re-computes.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import botocore.exceptions
from botocore.config import Config

log = logging.getLogger(__name__)
_CHUNK = 8 << 20
# Error codes as AWS and S3-compatible servers spell them.
_LOST_CONDITION = ("PreconditionFailed", "412", "ConditionalRequestConflict")
_NO_SUCH_KEY = ("404", "NoSuchKey", "NotFound")


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


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
        self, url: str, endpoint_url: str | None = None, workers: int = 8, part_mib: int = 512
    ) -> None:
        self.url = url.rstrip("/")
        self.part_bytes = part_mib << 20
        self.bucket, self.prefix = parse_s3_url(url)
        config = Config(
            max_pool_connections=max(10, workers * 2),
            retries={"max_attempts": 5, "mode": "standard"},
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

    def put_file(self, rel: str, path: Path, metadata: dict[str, str]) -> None:
        """Upload ``path`` as a new object; PreconditionFailed if the key exists. Files above
        ``part_bytes`` go up in parts (one PUT takes at most 5 GiB)."""
        if path.stat().st_size > self.part_bytes:
            self._put_parts(rel, path, metadata)
            return
        with open(path, "rb") as body:
            self._put(rel, body, file_md5(path), metadata, IfNoneMatch="*")

    def _put_parts(self, rel: str, path: Path, metadata: dict[str, str]) -> None:
        key = self.key(rel)
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key, Metadata=metadata)
        parts = []
        try:
            with open(path, "rb") as f:
                while chunk := f.read(self.part_bytes):
                    md5 = base64.b64encode(hashlib.md5(chunk, usedforsecurity=False).digest())
                    reply = self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=upload["UploadId"],
                        PartNumber=len(parts) + 1, Body=chunk, ContentMD5=md5.decode(),
                    )  # fmt: skip
                    parts.append({"ETag": reply["ETag"], "PartNumber": len(parts) + 1})
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload["UploadId"],
                MultipartUpload={"Parts": parts}, IfNoneMatch="*",
            )  # fmt: skip
        except botocore.exceptions.ClientError as exc:
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload["UploadId"]
            )
            if _code(exc) in _LOST_CONDITION:
                raise PreconditionFailed(f"{self.url}/{rel}: {_code(exc)}") from None
            raise

    def put_bytes(
        self, rel: str, data: bytes, if_match: str | None = None, metadata: dict | None = None
    ) -> str:
        """A new object (or, with ``if_match``, a replacement of that version); its ETag."""
        md5 = base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()
        condition = {"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}
        return self._put(rel, data, md5, metadata or {}, **condition)

    def _put(self, rel: str, body: object, md5: str, metadata: dict, **condition: str) -> str:
        try:
            reply = self.client.put_object(
                Bucket=self.bucket,
                Key=self.key(rel),
                Body=body,
                ContentMD5=md5,
                Metadata=metadata,
                **condition,
            )
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _LOST_CONDITION:
                raise PreconditionFailed(f"{self.url}/{rel}: {_code(exc)}") from None
            raise
        return str(reply["ETag"])

    def head(self, rel: str) -> ObjectInfo | None:
        try:
            reply = self.client.head_object(Bucket=self.bucket, Key=self.key(rel))
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _NO_SUCH_KEY:
                return None
            raise
        return ObjectInfo(rel, reply["ContentLength"], reply["ETag"], reply.get("Metadata", {}))

    def get_bytes(self, rel: str) -> tuple[bytes, str] | None:
        """(content, ETag), or None if there is no such object."""
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
        except botocore.exceptions.ClientError as exc:
            if _code(exc) in _NO_SUCH_KEY:
                return None
            raise
        return reply["Body"].read(), str(reply["ETag"])

    def download(self, rel: str, path: Path) -> None:
        reply = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
        with open(path, "wb") as out:
            for chunk in reply["Body"].iter_chunks(_CHUNK):
                out.write(chunk)

    def list(self, rel_prefix: str = "", delimiter: str | None = None) -> Iterator[str]:
        """Keys (relative) under ``rel_prefix``; with a delimiter, the common prefixes."""
        paginator = self.client.get_paginator("list_objects_v2")
        extra = {"Delimiter": delimiter} if delimiter else {}
        strip = len(self.key(""))
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(rel_prefix), **extra):
            if delimiter:
                yield from (p["Prefix"][strip:] for p in page.get("CommonPrefixes", []))
            else:
                yield from (o["Key"][strip:] for o in page.get("Contents", []))

    def delete(self, rel: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key(rel))


def _code(exc: botocore.exceptions.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))
