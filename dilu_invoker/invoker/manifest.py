"""OpenWhisk runtimes manifest (``runtimes.json``, ``RUNTIMES_MANIFEST``): which kinds exist, their images.

Format: OpenWhisk's ``ExecManifest`` (``{"runtimes": {family: [runtime, …]}, "blackboxes": [image, …]}``).
A runtime is a GPU kind when it says ``"gpu": true`` or its kind ends in ``-gpu`` (the controller ignores
fields it does not know, so the same file serves both). A runtime's optional ``"preload"`` list names the
modules the invoker's pre-loaded containers of that kind import ahead of any request (docs/invoker.md,
"Pre-loaded containers"); a kind without the key gets no pre-loaded containers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any


class ManifestError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ImageName:
    name: str
    prefix: str | None = None
    tag: str | None = None
    registry: str | None = None

    def __str__(self) -> str:
        parts = [p for p in (self.registry, self.prefix) if p]
        base = "/".join([*parts, self.name])
        return f"{base}:{self.tag}" if self.tag else base

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ImageName:
        return cls(name=str(obj["name"]), prefix=obj.get("prefix"), tag=obj.get("tag"),
                   registry=obj.get("registry"))


@dataclass(frozen=True, slots=True)
class RuntimeKind:
    kind: str
    family: str
    image: ImageName
    default: bool = False
    deprecated: bool = False
    attached: bool = False
    require_main: bool = False
    sentinelled_logs: bool = True
    gpu: bool = False
    #: modules pre-loaded containers of this kind import ahead (None: the kind is not pre-loaded)
    preload: tuple[str, ...] | None = None
    #: memory limit of a pre-loaded container of this kind until an action takes it (None: the invoker's
    #: ``--invoker-preload-memory-mb``); heavy libraries need more than the default
    preload_memory_mb: int | None = None


def _preload_list(m: Mapping[str, Any]) -> tuple[str, ...] | None:
    raw = m.get("preload")
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(x, str) and x for x in raw):
        raise ManifestError(f"runtime '{m.get('kind')}': 'preload' must be a list of module names")
    bad = [x for x in raw if not all(part.isidentifier() for part in x.split("."))]
    if bad:
        raise ManifestError(f"runtime '{m.get('kind')}': 'preload' has names that are not modules: {bad}")
    return tuple(raw)


def _preload_memory(m: Mapping[str, Any]) -> int | None:
    raw = m.get("preloadMemoryMB")
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
        raise ManifestError(f"runtime '{m.get('kind')}': 'preloadMemoryMB' must be a positive integer")
    return raw


@dataclass(frozen=True, slots=True)
class Manifest:
    runtimes: Mapping[str, RuntimeKind]
    blackboxes: tuple[ImageName, ...] = ()

    @property
    def kinds(self) -> list[str]:
        return sorted(k for k, r in self.runtimes.items() if not r.deprecated)

    def resolve(self, kind: str) -> RuntimeKind | None:
        """The runtime of ``kind`` (``family:default`` resolves to the family's default), or None."""
        kind = kind.lower()
        if kind.endswith(":default"):
            family = kind.rsplit(":", 1)[0]
            members = [r for r in self.runtimes.values() if r.family == family]
            defaults = [r for r in members if r.default]
            if len(members) == 1:
                return members[0]
            return defaults[0] if len(defaults) == 1 else None
        return self.runtimes.get(kind)

    def unsupported_message(self, kind: str) -> str:
        valid = ", ".join(f"'{k}'" for k in self.kinds)
        return f"The specified runtime '{kind}' is not supported by this platform. Valid values are: {valid}."

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Manifest:
        try:
            families = obj["runtimes"]
            runtimes: dict[str, RuntimeKind] = {}
            for family, members in families.items():
                defaults = [m for m in members if m.get("default")]
                if len(defaults) > 1:
                    raise ManifestError(f"family '{family}' has more than one default runtime")
                for m in members:
                    kind = str(m["kind"]).lower()
                    runtimes[kind] = RuntimeKind(
                        kind=kind,
                        family=family,
                        image=ImageName.from_json(m["image"]),
                        default=bool(m.get("default", False)),
                        deprecated=bool(m.get("deprecated", False)),
                        attached="attached" in m,
                        require_main=bool(m.get("requireMain", False)),
                        sentinelled_logs=bool(m.get("sentinelledLogs", True)),
                        gpu=bool(m.get("gpu", kind.endswith("-gpu"))),
                        preload=_preload_list(m),
                        preload_memory_mb=_preload_memory(m),
                    )
            blackboxes = tuple(ImageName.from_json(b) for b in obj.get("blackboxes", ()))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"malformed runtimes manifest: {exc!r}") from exc
        return cls(runtimes=runtimes, blackboxes=blackboxes)

    @classmethod
    def load(cls, source: str | None = None) -> Manifest:
        """From a file path, a JSON string (``RUNTIMES_MANIFEST``), or the bundled ``runtimes.json``."""
        if source is None:
            text = resources.files("dilu_invoker.actions").joinpath("runtimes.json").read_text()
        elif source.lstrip().startswith("{"):
            text = source
        else:
            text = Path(source).read_text()
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ManifestError(f"runtimes manifest is not JSON: {exc}") from exc
