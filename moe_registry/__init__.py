"""moe-registry: declarative quantized-MoE kernel registry.

``build``, ``load_layer``, ``load_model`` and ``register_experts_implementation`` are imported lazily so that the
spec/oracle/explain path never imports torch (nor transformers). ``__version__`` is the installed distribution's
version (the checkout's pyproject.toml when the package runs uninstalled).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["MoELayer", "__version__", "build", "load_layer", "load_model", "load_registry",
           "register_experts_implementation", "select"]


def __dir__() -> list[str]:
    """The lazy names too, so ``dir()`` and tab completion find them before first use."""
    return sorted({*globals(), *__all__})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moe-registry")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return m.group(1) if m else "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = _version()
        globals()["__version__"] = value
        return value
    if name == "build":
        from moe_registry.layer.build import build

        return build
    if name in ("load_layer", "MoELayer"):
        import importlib

        return getattr(importlib.import_module("moe_registry.layer.moe_layer"), name)
    if name == "load_model":  # transformers (the optional extra) is imported only when a model is loaded
        from moe_registry.whole.load import load_model

        return load_model
    if name == "register_experts_implementation":
        from moe_registry.whole.interface import register_experts_implementation

        return register_experts_implementation
    if name == "load_registry":
        from moe_registry.spec.loader import load_registry

        return load_registry
    if name == "select":
        from moe_registry.oracle.select import select

        return select
    raise AttributeError(f"module 'moe_registry' has no attribute {name!r}")
