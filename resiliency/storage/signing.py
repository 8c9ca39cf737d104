"""Optional authenticity of checkpoints: an HMAC-SHA256 of a step's manifest bytes.

The checksums (crc32c per file, the manifest's own in COMMITTED) catch accidents: torn writes,
bit rot, truncation. They do not stop someone who can write the shared claim, bucket or hostPath
from replacing a step and re-sealing it. A signature binds the files only through checksums an
editor cannot match: crc32c is linear (four edited bytes restore any crc32c at the same size),
so a signed step lists **sha256** of every file (the writer re-hashes its share at commit, ~2
GiB/s per rank) and a signed manifest or sidecar listing anything weaker is refused.

With ``checkpoint.signing_key_env=NAME`` every published step carries ``hmac-sha256:<hex>`` of
its manifest bytes as the second line of COMMITTED (written with the marker, so marker and
signature appear atomically), and a restore from any tier rejects a step whose signature is
missing or does not match the key in ``$NAME``. The node-local tier signs each file's sidecar
the same way.

COMMITTED::

    sha256:<manifest checksum>
    hmac-sha256:<hex>            only when the writer held a key
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from recipes.inputs import signing_key
from resiliency.storage.manifest import manifest_checksum

SIGNATURE_PREFIX = "hmac-sha256:"
SIGNED_ALGORITHM = "sha256"  # the file checksum a signature binds bytes through
CONFIG_KEY = "checkpoint.signing_key_env"


@dataclass(frozen=True)
class SigningKey:
    env: str  # the variable it was read from: named in every refusal
    secret: bytes = field(repr=False)

    def sign(self, raw: bytes) -> str:
        return hmac.new(self.secret, raw, hashlib.sha256).hexdigest()


def key_from_env(name: str | None, environ: Mapping[str, str] | None = None) -> SigningKey | None:
    """The key ``$name`` holds; None when no variable is named. A variable named but unset or
    empty is a ConfigError (recipes.inputs.signing_key: the same check every rank makes at
    start)."""
    secret = signing_key(name, environ)
    return None if name is None or secret is None else SigningKey(name, secret)


def marker_text(raw: bytes, key: SigningKey | None) -> str:
    """COMMITTED for manifest bytes ``raw``: the checksum, then the signature when keyed."""
    lines = [manifest_checksum(raw)]
    if key is not None:
        lines.append(SIGNATURE_PREFIX + key.sign(raw))
    return "".join(line + "\n" for line in lines)


def parse_marker(text: str) -> tuple[str, str | None]:
    """(manifest checksum, signature hex or None) from COMMITTED's text."""
    lines = [line.strip() for line in text.strip().splitlines()]
    checksum = lines[0] if lines else ""
    signature = next(
        (line[len(SIGNATURE_PREFIX) :] for line in lines[1:] if line.startswith(SIGNATURE_PREFIX)),
        None,
    )
    return checksum, signature


def signature_problem(raw: bytes, signature: str | None, key: SigningKey | None) -> str | None:
    """Why manifest bytes ``raw`` with ``signature`` are not trusted under ``key``, or None.
    Without a key nothing is required and an existing signature is not looked at."""
    if key is None:
        return None
    if signature is None:
        return f"manifest is not signed ({CONFIG_KEY}={key.env} is set)"
    if not hmac.compare_digest(key.sign(raw), signature):
        return f"manifest signature does not match the key in ${key.env}"
    return None


def _canonical(record: Mapping[str, Any]) -> bytes:
    return json.dumps(
        {k: v for k, v in record.items() if k != "hmac"}, sort_keys=True, separators=(",", ":")
    ).encode()


def binding_problem(algorithms: Iterable[str], key: SigningKey | None) -> str | None:
    """Under ``key``, why checksums of these algorithms would not bind a signed step's bytes."""
    weak = sorted(set(algorithms) - {SIGNED_ALGORITHM}) if key is not None else []
    if not weak:
        return None
    return (
        f"signed files are checksummed with {', '.join(weak)}, which an edit can match: "
        f"a signed step lists {SIGNED_ALGORITHM}"
    )


def sign_record(record: dict[str, Any], key: SigningKey | None) -> dict[str, Any]:
    """``record`` (a local file's sidecar) with ``hmac`` over its other fields, when keyed."""
    if key is None:
        return record
    return {**record, "hmac": SIGNATURE_PREFIX + key.sign(_canonical(record))}


def record_problem(record: Mapping[str, Any], key: SigningKey | None) -> str | None:
    """As :func:`signature_problem`, for a record signed by :func:`sign_record`."""
    if key is None:
        return None
    value = record.get("hmac")
    if not isinstance(value, str) or not value.startswith(SIGNATURE_PREFIX):
        return f"sidecar is not signed ({CONFIG_KEY}={key.env} is set)"
    if not hmac.compare_digest(key.sign(_canonical(record)), value[len(SIGNATURE_PREFIX) :]):
        return f"sidecar signature does not match the key in ${key.env}"
    return None
