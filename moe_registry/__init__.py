"""moe-registry: declarative quantized-MoE kernel registry.

``build`` and ``load_layer`` are imported lazily so that the spec/oracle/explain path never
imports torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build", "load_layer", "load_registry", "select"]


def __getattr__(name: str) -> Any:
    if name in ("build", "load_layer"):
        import importlib

        return getattr(importlib.import_module("moe_registry.builder"), name)
    if name == "load_registry":
        from moe_registry.registry import load_registry

        return load_registry
    if name == "select":
        from moe_registry.oracle import select

        return select
    raise AttributeError(f"module 'moe_registry' has no attribute {name!r}")
