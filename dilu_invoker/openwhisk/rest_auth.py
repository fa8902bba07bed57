"""HTTP basic authentication of the standalone REST API, with OpenWhisk's ``uuid:key`` API keys.

The guest key (``GUEST_IDENTITY``) is accepted unless ``--api-guest-key`` is off; more keys come from
``--api-auth-file``: one key per line, ``<uuid>:<key> <namespace>``; blank lines and ``#`` comments are
ignored.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType

from dilu_invoker.config import ApiConfig
from dilu_invoker.model import ENTITY_NAME_MAX, ENTITY_NAME_RE, GUEST_IDENTITY, Identity

_UUID_RE = re.compile(r"\A[A-Za-z0-9-]{1,64}\Z")


class AuthFileError(ValueError):
    """The auth file is unreadable or has a malformed line; the message names the line."""


def parse_auth_lines(lines: Iterable[str], *, source: str = "auth file") -> list[Identity]:
    out: list[Identity] = []
    for lineno, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise AuthFileError(f"{source}:{lineno}: expected '<uuid>:<key> <namespace>'")
        api_key, namespace = parts
        uuid, sep, key = api_key.partition(":")
        if not sep or not key or not _UUID_RE.match(uuid):
            raise AuthFileError(f"{source}:{lineno}: the API key must look like '<uuid>:<key>'")
        if len(namespace) > ENTITY_NAME_MAX or not ENTITY_NAME_RE.match(namespace) or namespace == "_":
            raise AuthFileError(f"{source}:{lineno}: namespace {namespace!r} is not a valid entity name")
        out.append(Identity(subject=namespace, namespace=namespace, uuid=uuid, key=key))
    return out


class Authenticator:
    """Maps ``Authorization: Basic …`` headers to identities; keys are compared in constant time."""

    def __init__(self, identities: Iterable[Identity]) -> None:
        by_uuid: dict[str, Identity] = {}
        for ident in identities:
            if ident.uuid in by_uuid and by_uuid[ident.uuid] != ident:
                raise AuthFileError(f"API key uuid {ident.uuid} is listed twice with different keys")
            by_uuid[ident.uuid] = ident
        self._by_uuid: Mapping[str, Identity] = MappingProxyType(by_uuid)

    @property
    def identities(self) -> list[Identity]:
        return list(self._by_uuid.values())

    @classmethod
    def from_config(cls, cfg: ApiConfig) -> Authenticator:
        """Reads ``cfg.auth_file`` (a small file, once at start-up)."""
        identities: list[Identity] = [GUEST_IDENTITY] if cfg.guest_key else []
        if cfg.auth_file:
            path = Path(cfg.auth_file).expanduser()
            try:
                text = path.read_text()
            except OSError as exc:
                raise AuthFileError(f"--api-auth-file {path}: {exc.strerror or exc}") from exc
            identities += parse_auth_lines(text.splitlines(), source=str(path))
        if not identities:
            raise AuthFileError("no API key is accepted: enable the guest key or give --api-auth-file")
        return cls(identities)

    def authenticate_key(self, api_key: str) -> Identity | None:
        uuid, sep, key = api_key.partition(":")
        ident = self._by_uuid.get(uuid) if sep else None
        if ident is None:
            # Same work on unknown uuids, so timing does not tell which uuids exist.
            hmac.compare_digest(key.encode(), GUEST_IDENTITY.key.encode())
            return None
        return ident if hmac.compare_digest(key.encode(), ident.key.encode()) else None

    def authenticate_header(self, header: str | None) -> Identity | None:
        """None for a missing header is the caller's business; this returns None for a bad one."""
        if not header:
            return None
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() != "basic" or not value:
            return None
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        return self.authenticate_key(decoded)
