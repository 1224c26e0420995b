"""The registry: every validated spec by name, where each came from, and the spec files of a spec dir.

Pure data and file listing: no pydantic, no YAML (the validation that builds a Registry lives in
``validation.py``; ``loader.py`` picks the cache or the validation)."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from moe_registry.core.errors import SpecError
from moe_registry.core.keys import KeyError_
from moe_registry.spec.record import SpecRecord
from moe_registry.spec.view import ConverterSpec, FormatSpec, KernelSpec, ModelFamilySpec, SchemeSpec

T = TypeVar("T", bound=SpecRecord)
SPEC_PATH_ENV = "MOE_REGISTRY_SPEC_PATH"
_TEMPLATE_RE = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Loaded(Generic[T]):
    """A validated spec and where it came from; ``overrides`` names the file it replaced."""

    spec: T
    path: str
    line: int
    builtin: bool
    overrides: str | None = None


@dataclass(frozen=True)
class Registry:
    """Every known scheme, kernel, model family and checkpoint format, by name."""

    schemes: Mapping[str, Loaded[SchemeSpec]]
    kernels: Mapping[str, Loaded[KernelSpec]]
    families: Mapping[str, Loaded[ModelFamilySpec]]
    formats: Mapping[str, Loaded[FormatSpec]] = field(default_factory=dict)
    problems: tuple[SpecError, ...] = field(default=())

    @property
    def converters(self) -> frozenset[tuple[str, str]]:
        """Every declared (format, layout) pair."""
        return frozenset((name, c.layout) for name, loaded in self.formats.items() for c in loaded.spec.converters)

    def converter(self, format: str, layout: str) -> tuple[ConverterSpec, Loaded[FormatSpec]] | None:
        """The converter declared for (format, layout) and the spec declaring it, or None."""
        loaded = self.formats.get(format)
        found = next((c for c in loaded.spec.converters if c.layout == layout), None) if loaded else None
        return (found, loaded) if found is not None and loaded is not None else None

    def scheme(self, name: str) -> SchemeSpec:
        return self.schemes[name].spec

    def kernel(self, name: str) -> KernelSpec:
        return self.kernels[name].spec


def builtin_spec_dir() -> Path:
    """The specs shipped with the package (the repo's specs/ in a checkout). Found through the import
    system's spec, which is what importlib.resources reads, without importing it (zipfile, tempfile:
    a tenth of a cached explain's start)."""
    found = importlib.util.find_spec("moe_registry.specs_data")
    locations = list(found.submodule_search_locations or []) if found else []
    if len(locations) == 1:
        return Path(locations[0])
    from importlib import resources

    return Path(str(resources.files("moe_registry.specs_data")))


def fill_template(text: str, bindings: Mapping[str, Any]) -> str:
    """Replace each ``$name`` with the binding's value (booleans as true/false)."""

    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in bindings:
            raise KeyError_(f"${name} is not bound (bindings: {', '.join(sorted(bindings)) or 'none'})")
        v = bindings[name]
        return str(v).lower() if isinstance(v, bool) else str(v)

    return _TEMPLATE_RE.sub(value, text)


def binding_samples(scheme: SchemeSpec) -> list[dict[str, Any]]:
    """Binding values to validate templates with: each listed value, else the default."""
    samples: list[dict[str, Any]] = [{}]
    for name, rule in scheme.bind.items():
        if rule.value is not None:
            values = [rule.value]
        elif rule.map:
            values = list(rule.map.values())
        elif rule.one_of:
            values = list(rule.one_of)
        elif rule.default is not None:
            values = [rule.default]
        else:
            values = [128]
        samples = [{**s, name: v} for s in samples for v in values]
    return samples[:64]


def spec_files(directory: Path) -> list[Path]:
    """The spec files of a spec dir: *.yaml and *.yml, in its schemes/, kernels/, models/, formats/ and
    keysets/ or directly in it."""
    files: list[Path] = []
    for sub in ("", "schemes", "kernels", "models", "formats", "keysets"):
        d = directory / sub if sub else directory
        if d.is_dir():
            files += sorted(p for p in d.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    return files


def user_spec_dirs(extra: Iterable[str | Path] = ()) -> list[Path]:
    """User dirs from the environment (``MOE_REGISTRY_SPEC_PATH``, os.pathsep-separated) and flags."""
    dirs = [Path(p) for p in os.environ.get(SPEC_PATH_ENV, "").split(os.pathsep) if p]
    return dirs + [Path(p) for p in extra]


def files_to_validate(paths: Iterable[str | Path]) -> tuple[list[Path], list[Path]]:
    """The spec files ``validate`` reads for ``paths`` (the built-ins when there are none), and the
    given dirs that hold no spec file (an empty dir is a mistake, not a success)."""
    given = [Path(p) for p in paths]
    if not given:
        return spec_files(builtin_spec_dir()), []
    files: list[Path] = []
    empty: list[Path] = []
    for p in given:
        if p.is_dir():
            found = spec_files(p)
            files += found
            if not found:
                empty.append(p)
        elif p.exists():
            files.append(p)
    return list(dict.fromkeys(files)), empty
