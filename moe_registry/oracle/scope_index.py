"""Scope patterns of a quantization_config (``ignore``, ``exclude_modules``, ``dynamic`` ...) matched against
module names, fast for the lists producers write.

llm-compressor writes every ignored module by name: an ``ignore`` list of a large model holds 100,000 names.
Testing each entry against each expert projection of each scheme is quadratic in practice, and a list longer
than Python's regex and fnmatch caches recompiles every entry on every test. So a list is indexed once:
entries that are plain names go into a dict keyed the way the matcher compares them (a module's name, its
dotted prefixes, its component runs, its substrings, its class names), looked up per module; only true
patterns (``re:``, globs with ``*?[``, regexes) are compiled, once each, and tried in turn.

:func:`pattern_matches` is the one-entry definition the index must agree with.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_registry.core.guards import bounded_match, bounded_search, capped_subject, compile_bounded

__all__ = ["pattern_matches", "gptq_dynamic_sign", "PatternIndex", "pattern_index"]

_GLOB_CHARS = frozenset("*?[")


def _components_match(pattern: str, name: str) -> bool:
    pat, parts = pattern.strip(".").split("."), name.split(".")
    return any(parts[i:i + len(pat)] == pat for i in range(len(parts) - len(pat) + 1))


def gptq_dynamic_sign(key: str, name: str) -> str | None:
    """GPTQ ``dynamic``: ``-:regex`` excludes, ``+:regex`` (or a bare regex) overrides."""
    sign, body = ("-", key[2:]) if key.startswith("-:") else ("+", key[2:] if key.startswith("+:") else key)
    return sign if bounded_match(body, name, "quantization_config gptq-dynamic pattern") else None


def pattern_matches(kind: str, pattern: str, name: str, types: Sequence[str]) -> bool:
    """Whether a module ``name`` matches ``pattern`` under a scope rule's matcher."""
    if kind == "substring":
        return pattern in name
    if kind == "component":
        return _components_match(pattern, name)
    if kind == "glob":
        return fnmatch.fnmatchcase(name, pattern)
    if kind == "regex":
        return bounded_search(pattern, name, "quantization_config regex pattern")
    if kind == "exact":
        return name == pattern or name.startswith(pattern + ".")
    if kind == "type":
        return pattern in types
    if kind == "ct-target":  # compressed-tensors: the module's name or class name, or re: over the name
        if pattern.startswith("re:"):
            return bounded_match(pattern[3:], name, "quantization_config ct-target pattern")
        return name == pattern or pattern in types
    if kind == "gptq-dynamic":
        return gptq_dynamic_sign(pattern, name) is not None
    raise ValueError(f"unknown matcher {kind!r}")


# ---------------------------------------------------------------- the index


def _literal_key(kind: str, pattern: str) -> str | None:
    """The dict key under which a plain entry is found, or None when the entry is a true pattern."""
    if kind in ("substring", "exact", "type"):
        return pattern
    if kind == "component":
        return pattern.strip(".")
    if kind == "glob":
        return None if _GLOB_CHARS & set(pattern) else pattern
    if kind == "ct-target":
        return None if pattern.startswith("re:") else pattern
    if kind in ("regex", "gptq-dynamic"):
        return None
    raise ValueError(f"unknown matcher {kind!r}")


def _lookup_keys(kind: str, name: str, types: Sequence[str]) -> Iterator[str]:
    """Every key a plain entry matching ``name`` can have under ``kind`` (the inverse of ``_literal_key``)."""
    if kind == "substring":
        yield from (name[i:j] for i in range(len(name) + 1) for j in range(i, len(name) + 1))
    elif kind == "component":
        parts = name.split(".")
        yield from (".".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1))
    elif kind == "exact":  # the name itself or a dotted prefix of it
        yield name
        yield from (name[:i] for i, ch in enumerate(name) if ch == ".")
    elif kind == "type":
        yield from types
    elif kind == "ct-target":
        yield name
        yield from types
    elif kind == "glob":
        yield name


def _compiled(kind: str, pattern: str) -> Callable[[str], bool]:
    """A true pattern compiled once: a function of the module name."""
    if kind == "glob":
        return re.compile(fnmatch.translate(pattern)).match  # type: ignore[return-value]
    if kind == "ct-target":
        regex = compile_bounded(pattern[3:], "quantization_config ct-target pattern")
        return lambda name: regex.match(capped_subject(name)) is not None
    if kind == "regex":
        regex = compile_bounded(pattern, "quantization_config regex pattern")
        return lambda name: regex.search(capped_subject(name)) is not None
    body = pattern[2:] if pattern.startswith(("-:", "+:")) else pattern  # gptq-dynamic
    regex = compile_bounded(body, "quantization_config gptq-dynamic pattern")
    return lambda name: regex.match(capped_subject(name)) is not None


@dataclass(frozen=True)
class PatternIndex:
    """One list (or mapping's keys) of scope entries under one matcher, indexed once."""

    kind: str
    types: tuple[str, ...]
    entries: tuple[str, ...]  # in the config's order; non-string list entries are left out
    literal: Mapping[str, int]  # lookup key -> position of the first plain entry with that key
    patterns: tuple[tuple[int, Callable[[str], bool]], ...]  # true patterns, compiled, in order

    def matching(self, name: str) -> list[int]:
        """Positions of the entries that match ``name``, in the config's order."""
        found = {self.literal[k] for k in _lookup_keys(self.kind, name, self.types) if k in self.literal}
        found.update(i for i, test in self.patterns if test(name))
        return sorted(found)

    def first(self, name: str) -> str | None:
        """The first entry (in the config's order) that matches ``name``."""
        best = min((self.literal[k] for k in _lookup_keys(self.kind, name, self.types) if k in self.literal),
                   default=len(self.entries))
        for i, test in self.patterns:
            if i >= best:
                break
            if test(name):
                best = i
                break
        return self.entries[best] if best < len(self.entries) else None


def _build(kind: str, entries: tuple[str, ...], types: tuple[str, ...]) -> PatternIndex:
    literal: dict[str, int] = {}
    patterns: list[tuple[int, Callable[[str], bool]]] = []
    for i, entry in enumerate(entries):
        key = _literal_key(kind, entry)
        if key is None:
            patterns.append((i, _compiled(kind, entry)))
        else:
            literal.setdefault(key, i)
    return PatternIndex(kind, types, entries, literal, tuple(patterns))


_INDEXES: dict[tuple[int, str, tuple[str, ...]], tuple[Any, PatternIndex]] = {}
_MAX_INDEXES = 64


def pattern_index(source: Any, kind: str, types: Sequence[str]) -> PatternIndex:
    """The index of ``source`` (a list of entries, a mapping's keys, or one entry) under ``kind``; built once
    per source object (every scheme and every projection of a config asks for the same lists)."""
    key = (id(source), kind, tuple(types))
    held = _INDEXES.get(key)
    if held is not None and held[0] is source:  # the object itself is kept, so its id cannot be reused
        return held[1]
    if isinstance(source, Mapping):
        entries = tuple(str(p) for p in source)
    elif isinstance(source, list):
        entries = tuple(p for p in source if isinstance(p, str))
    else:
        entries = (source,) if isinstance(source, str) else ()
    index = _build(kind, entries, tuple(types))
    if len(_INDEXES) >= _MAX_INDEXES:
        _INDEXES.clear()
    _INDEXES[key] = (source, index)
    return index
