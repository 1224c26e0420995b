"""The situation the oracle decides for, as values: the layer's quantization config and module names, the
runtime, and the model's routing with where each value came from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_registry.core.checks import plain
from moe_registry.situation.runtime import RuntimeConfig


@dataclass(frozen=True)
class RoutingValue:
    """One routing value of the model and where it came from, so a reader can check it against the config:
    ``config`` (the field named), ``class-default`` (the field is absent: transformers' config class default),
    ``spec-default`` (absent or null, and no class default: the family spec's), ``fixed`` (not a config field:
    the family's modeling code fixes it, as the family spec records), ``none`` (the family spec has no such word:
    the modeling code has no such step, and the value is the one that means so)."""

    word: str
    value: Any
    origin: str
    field: str | None = None
    config_class: str | None = None
    family: str | None = None

    @property
    def source(self) -> str:
        """The origin in words, e.g. "absent: transformers' DeepseekV3Config default"."""
        if self.origin == "config":
            return f"config {self.field}"
        if self.origin == "class-default":
            return f"{self.field} absent: transformers' {self.config_class} default"
        if self.origin == "spec-default":
            return f"{self.field} absent or null: family {self.family} spec default"
        if self.origin == "fixed":
            return f"fixed by the modeling code: family {self.family} spec"
        return f"none in the modeling code: family {self.family} spec"

    def to_dict(self) -> dict[str, Any]:
        return {"value": plain(self.value), "origin": self.origin, "field": self.field,
                "config_class": self.config_class, "source": self.source}


@dataclass(frozen=True)
class Situation:
    """What the oracle decides for: the layer's quantization config and module names, and the
    runtime. ``modules`` are the expert projections' full names (for per-layer scoping)."""

    quant_config: Mapping[str, Any] | None
    runtime: RuntimeConfig
    modules: tuple[str, ...] = ("model.layers.0.mlp.experts.0.gate_proj",)
    quant_source: str = "quantization_config"
    model: str | None = None
    family: str | None = None
    layer: int | None = None
    not_runnable: tuple[str, ...] = ()  # the model's experts in a form no kernel here runs (explain shows why)
    routing: tuple[RoutingValue, ...] = ()  # the model's routing with sources (explain shows it)
    moe_layers: tuple[int, ...] = ()  # every MoE layer of the model (explain reports them all, grouped)
    layer_asked: bool = False  # --layer / layer= named the layer: the report is that layer's alone
