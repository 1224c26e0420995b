"""Loading specs: built-ins shipped in the wheel, then user dirs that add or override them.

A registry is validated once per set of spec files: the result is kept in the spec cache (``cache.py``,
keyed by every file's bytes and the spec language's code), so later runs build it without pydantic or
YAML. Nothing here imports kernel code or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from moe_registry.core.errors import SpecError
from moe_registry.spec import cache
from moe_registry.spec.registry import (
    SPEC_PATH_ENV,
    Loaded,
    Registry,
    binding_samples,
    builtin_spec_dir,
    files_to_validate,
    fill_template,
    spec_files,
    user_spec_dirs,
)

__all__ = ["SPEC_PATH_ENV", "Loaded", "Registry", "binding_samples", "builtin_spec_dir", "files_to_validate",
           "fill_template", "load_registry", "spec_files", "user_spec_dirs"]


def load_registry(extra_dirs: Iterable[str | Path] = (), *, builtin: bool = True,
                  strict: bool = True) -> Registry:
    """Load built-in and user specs. With ``strict`` any problem raises (all of them, listed);
    otherwise problems are kept in ``Registry.problems`` and the bad specs are left out."""
    sources: list[tuple[Path, Path]] = []
    builtin_root = builtin_spec_dir()
    if builtin:
        sources += [(p, builtin_root) for p in spec_files(builtin_root)]
    for d in user_spec_dirs(extra_dirs):
        if not d.is_dir():
            err = SpecError(str(d), None, "spec dir is not a directory" if d.exists() else "spec dir does not exist")
            if strict:
                raise err
            continue
        sources += [(p, d) for p in spec_files(d)]
    key = cache.cache_key(sources, builtin_root) if strict else None
    cached = cache.read(key) if key else None
    if cached is not None:
        return cached
    from moe_registry.spec.validation import build_registry  # pydantic and YAML: only on a miss

    registry = build_registry(sources, strict=strict)
    if key:
        cache.write(key, registry)
    return registry


