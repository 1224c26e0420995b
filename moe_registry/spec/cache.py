"""The spec cache: a validated registry kept as data, so a run whose spec files were validated before
builds its registry without pydantic or YAML (so ``explain`` answers in well under a second).

The key is a digest of every spec file's path and bytes, in load order, and of the spec language's own
code (``moe_registry/core`` and ``moe_registry/spec``): a changed file, a file added or removed, or an
upgraded package is another key, never a stale answer. The file carries a digest of its body, and a
file that does not read back exactly (truncated, corrupt, another key, another format) is a miss: the
specs are validated again and the file rewritten. A registry whose kernels or converters name code in a
user's spec dir is not cached (whether that code is acceptable depends on the import path, not on the
files). ``MOE_REGISTRY_CACHE_DIR`` moves the cache; ``MOE_REGISTRY_NO_CACHE=1`` turns it off."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from moe_registry.core import guards
from moe_registry.spec.record import from_json, to_data
from moe_registry.spec.registry import Loaded, Registry
from moe_registry.spec.view import RECORDS, FormatSpec, KernelSpec, ModelFamilySpec, SchemeSpec

CACHE_DIR_ENV = "MOE_REGISTRY_CACHE_DIR"
NO_CACHE_ENV = "MOE_REGISTRY_NO_CACHE"
FORMAT = 1
KEEP = 16
_TABLES: dict[str, type] = {"schemes": SchemeSpec, "kernels": KernelSpec, "families": ModelFamilySpec,
                            "formats": FormatSpec}
_CODE_DIRS = ("core", "spec")


def cache_dir() -> Path | None:
    """Where cached registries live, or None when caching is off."""
    if os.environ.get(NO_CACHE_ENV, "") not in ("", "0"):
        return None
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-registry"


def cache_key(sources: list[tuple[Path, Path]], builtin_root: Path) -> str | None:
    """The digest of the spec language's code and of every source file (path, root, bytes), in order;
    None when a file cannot be read (the validation then reports it)."""
    digest = hashlib.sha256(f"moe-registry spec cache {FORMAT}\n".encode())
    package = Path(__file__).resolve().parent.parent
    for sub in _CODE_DIRS:
        for path in sorted((package / sub).glob("*.py")):
            digest.update(f"{sub}/{path.name}\n".encode() + path.read_bytes())
    for path, root in sources:
        try:
            body = path.read_bytes()
        except OSError:
            return None
        digest.update(f"\n{path}\n{root}\n{root == builtin_root}\n{len(body)}\n".encode() + body)
    return digest.hexdigest()


def _file(directory: Path, key: str) -> Path:
    return directory / f"registry-{key[:40]}.json"


def read(key: str) -> Registry | None:
    """The cached registry for ``key``, or None on any miss (absent, unreadable, corrupt, stale)."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        header, _, body = _file(directory, key).read_bytes().partition(b"\n")
        meta = json.loads(header)
        if meta != {"format": FORMAT, "key": key, "sha256": hashlib.sha256(body).hexdigest()}:
            return None
        return _registry(from_json(body, RECORDS))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def write(key: str, registry: Registry) -> None:
    """Keep ``registry`` under ``key`` (atomically; a cache that cannot be written is no error), unless
    it names user code, and prune the oldest files beyond the last few."""
    directory = cache_dir()
    if directory is None or registry.problems or not _cacheable(registry):
        return
    body = json.dumps({table: {name: {"spec": to_data(loaded.spec), "path": loaded.path, "line": loaded.line,
                                      "builtin": loaded.builtin, "overrides": loaded.overrides}
                               for name, loaded in getattr(registry, table).items()}
                       for table in _TABLES}, separators=(",", ":")).encode()
    header = json.dumps({"format": FORMAT, "key": key, "sha256": hashlib.sha256(body).hexdigest()}).encode()
    import tempfile  # only when writing: a cached start never needs it

    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".registry-", suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(header + b"\n" + body)
        os.replace(tmp, _file(directory, key))
        tmp = None
        for old in sorted(directory.glob("registry-*.json"), key=lambda p: p.stat().st_mtime)[:-KEEP]:
            old.unlink(missing_ok=True)
    except OSError:
        return
    finally:
        if tmp is not None:  # a write that failed half-way leaves no temporary file behind
            Path(tmp).unlink(missing_ok=True)


def _cacheable(registry: Registry) -> bool:
    """Only registries whose code all lives in this package: a user's impl is checked against the import
    path every run."""
    impls = [(k.spec.impl, guards.KERNEL_PACKAGE) for k in registry.kernels.values()]
    impls += [(c.impl, guards.CONVERTER_PACKAGE) for f in registry.formats.values() for c in f.spec.converters]
    return all(impl.partition(":")[0] == pkg or impl.startswith(pkg + ".") for impl, pkg in impls)


def _registry(data: dict[str, Any]) -> Registry:
    tables: dict[str, dict[str, Loaded[Any]]] = {}
    for table, cls in _TABLES.items():
        tables[table] = {}
        for name, entry in data[table].items():
            spec = entry["spec"]
            fields = (entry["path"], entry["line"], entry["builtin"], entry["overrides"])
            if not isinstance(spec, cls) or not (isinstance(fields[0], str) and type(fields[1]) is int
                                                  and type(fields[2]) is bool
                                                  and (fields[3] is None or isinstance(fields[3], str))):
                raise ValueError(f"cache entry {table}.{name} is malformed")
            tables[table][name] = Loaded(spec, *fields)
    return Registry(tables["schemes"], tables["kernels"], tables["families"], tables["formats"])
