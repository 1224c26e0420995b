"""Every spec field is documented: a description on each pydantic field, and so in ``moe-registry schema``."""

from __future__ import annotations

import inspect
import json
import typing
from typing import Any

from pydantic import BaseModel

from moe_registry.cli.main import main
from moe_registry.spec import models


def _models_in(annotation: Any) -> set[type[BaseModel]]:
    """BaseModel classes named anywhere in a field annotation (through list, dict, unions, ...)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return {annotation}
    return {m for arg in typing.get_args(annotation) for m in _models_in(arg)}


def _spec_models() -> set[type[BaseModel]]:
    """The models defined in moe_registry.spec.models and every model reachable from SPEC_KINDS."""
    found = {cls for _, cls in inspect.getmembers(models, inspect.isclass)
             if issubclass(cls, BaseModel) and cls.__module__ == models.__name__}
    todo = list(models.SPEC_KINDS.values())
    while todo:
        cls = todo.pop()
        found.add(cls)
        for info in cls.model_fields.values():
            todo += [m for m in _models_in(info.annotation) if m not in found]
    return found


def test_every_field_has_a_description() -> None:
    spec_models = _spec_models()
    assert set(models.SPEC_KINDS.values()) <= spec_models
    assert len(spec_models) > 10  # the walk found the nested models, not just the kinds
    missing = [f"{cls.__name__}.{name}" for cls in spec_models for name, info in cls.model_fields.items()
               if not (info.description or "").strip()]
    assert not missing, f"fields without a description: {', '.join(sorted(missing))}"


def _undocumented(schema: dict[str, Any]) -> list[str]:
    return [f"{def_name}.{prop}" for def_name, body in schema.get("$defs", {}).items()
            for prop, sub in body.get("properties", {}).items() if not str(sub.get("description", "")).strip()]


def test_editor_schema_documents_every_property(capsys) -> None:
    assert main(["schema", "--json"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {cls.__name__ for cls in models.SPEC_KINDS.values()} <= set(schema["$defs"])
    assert not _undocumented(schema), f"schema properties without a description: {_undocumented(schema)}"


def test_each_kind_schema_documents_every_property() -> None:
    for kind, cls in models.SPEC_KINDS.items():
        schema = cls.model_json_schema(by_alias=True)
        top = [p for p, sub in schema["properties"].items() if not str(sub.get("description", "")).strip()]
        assert not top, f"{kind}: properties without a description: {top}"
        assert not _undocumented(schema), f"{kind}: {_undocumented(schema)}"
