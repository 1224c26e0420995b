"""Spec records as plain data: the base of the runtime view classes, and the one encoding that turns a
validated spec (a pydantic model or a view) into JSON text and back into views.

Every mapping of the encoding is tagged (``$record``, ``$dict`` as [key, value] pairs, ``$tuple``), so
no key a spec wrote can be mistaken for structure, and a record keeps the fields its file wrote
(``fields_set``: ``equals: null`` differs from no ``equals``). The loader builds views from this JSON
text both after validating and when reading the cache, so a cached registry and a freshly validated
one are built by the same code."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import FrozenInstanceError
from typing import Any, ClassVar

try:
    from typing import dataclass_transform
except ImportError:  # Python 3.10
    from typing_extensions import dataclass_transform

RECORD, DICT, TUPLE = "$record", "$dict", "$tuple"
_RECORD_KEYS = {RECORD, "set", "fields"}


@dataclass_transform(kw_only_default=True, frozen_default=True)
class SpecRecord:
    """Base of the view classes (``view.py``): immutable, keyword-built, compared by value, with the fields
    its class annotates (in order). ``fields_set`` names the fields the spec file wrote (pydantic's
    ``model_fields_set``). Not a dataclass: building 24 dataclasses costs more than the rest of a cached
    ``explain`` start."""

    FIELDS: ClassVar[tuple[str, ...]] = ()
    fields_set: frozenset[str]

    def __init_subclass__(cls) -> None:
        own = tuple(n for n in cls.__dict__.get("__annotations__", {}) if n not in cls.FIELDS)
        cls.FIELDS = cls.FIELDS + own

    def __init__(self, *, fields_set: frozenset[str] = frozenset(), **values: Any) -> None:
        if set(values) != set(self.FIELDS):
            missing, extra = sorted(set(self.FIELDS) - set(values)), sorted(set(values) - set(self.FIELDS))
            raise TypeError(f"{type(self).__name__}: missing fields {missing}, unknown fields {extra}")
        self.__dict__.update(values, fields_set=fields_set)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def _values(self) -> tuple[Any, ...]:
        return tuple(self.__dict__[n] for n in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={self.__dict__[n]!r}' for n in self.FIELDS)})"

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (``dataclasses.replace`` for records)."""
        return type(self)(**{**{n: self.__dict__[n] for n in self.FIELDS}, **changes}, fields_set=self.fields_set)


def _field_names(value: Any) -> tuple[str, ...] | list[str] | None:
    """The field names of a spec record (a view or a pydantic model), or None for anything else."""
    if isinstance(value, SpecRecord):
        return value.FIELDS
    model_fields = getattr(type(value), "model_fields", None)  # a pydantic model, without importing pydantic
    return list(model_fields) if isinstance(model_fields, Mapping) and hasattr(value, "model_fields_set") else None


def _fields_set(value: Any) -> frozenset[str]:
    return value.fields_set if isinstance(value, SpecRecord) else frozenset(value.model_fields_set)


def to_data(value: Any) -> Any:
    """The JSON-able encoding of a spec value."""
    names = _field_names(value)
    if names is not None:
        return {RECORD: type(value).__name__, "set": sorted(_fields_set(value)),
                "fields": {n: to_data(getattr(value, n)) for n in names}}
    if isinstance(value, Mapping):  # as pairs: a key the spec wrote never becomes a key of the encoding
        return {DICT: [[str(k), to_data(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {TUPLE: [to_data(v) for v in value]}
    if isinstance(value, list):
        return [to_data(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a spec value of type {type(value).__name__} cannot be encoded")


def decoder(records: Mapping[str, type[SpecRecord]]) -> Callable[[dict[str, Any]], Any]:
    """A ``json.loads`` object hook turning ``to_data``'s encoding back into views in the parser's one
    pass; a ValueError on a mapping it did not write."""

    def hook(obj: dict[str, Any]) -> Any:
        if RECORD in obj:
            cls = records.get(obj[RECORD]) if obj.keys() == _RECORD_KEYS else None
            fields, wrote = obj.get("fields"), obj.get("set")
            if cls is None or not isinstance(fields, dict) or not isinstance(wrote, list):
                raise ValueError(f"not a spec record: {str(obj)[:80]}")
            if fields.keys() != set(cls.FIELDS):
                raise ValueError(f"record {obj[RECORD]} has fields {sorted(fields)}, wanted {sorted(cls.FIELDS)}")
            return cls(**fields, fields_set=frozenset(map(str, wrote)))
        if DICT in obj and len(obj) == 1 and isinstance(obj[DICT], list):
            pairs = obj[DICT]
            if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
                raise ValueError("not a spec encoding: a $dict entry is not a [key, value] pair")
            return dict(pairs)
        if TUPLE in obj and len(obj) == 1 and isinstance(obj[TUPLE], list):
            return tuple(obj[TUPLE])
        if any(k.startswith("$") for k in obj):
            raise ValueError(f"not a spec encoding: a mapping with keys {sorted(obj)[:4]}")
        return obj  # a record's fields, or the cache's own tables

    return hook


def from_json(text: str | bytes, records: Mapping[str, type[SpecRecord]]) -> Any:
    """The views in a JSON text of ``to_data``'s encoding (the cache file's body, or a spec just validated)."""
    return json.loads(text, object_hook=decoder(records))


def to_json(value: Any) -> str:
    """``to_data``'s encoding as compact JSON text."""
    return json.dumps(to_data(value), separators=(",", ":"))
