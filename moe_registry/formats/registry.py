"""Converter registry: a checkpoint format is turned into a kernel layout by the function registered
for that (format, layout) pair, so no code ever chooses a converter with an ``if`` (DESIGN rule 3).

A converter receives one :data:`ExpertTensors` per expert, in expert order, whose shapes and
dtypes the loader has already checked against the scheme spec; it checks the VALUES (scales,
zero points, act-order indices), raising :class:`CheckpointError` with the full tensor name, and
returns new :class:`ExpertWeights` without touching its inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from moe_registry.core.errors import MoERegistryError
from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ExpertWeights

__all__ = [
    "ExpertTensors",
    "TensorNamer",
    "ConvertContext",
    "Converter",
    "default_tensor_name",
    "register_converter",
    "get_converter",
    "known_converters",
]

ROLES = ("gate", "up", "down")

ExpertTensors = Mapping[str, Mapping[str, torch.Tensor]]
"""One expert's checkpoint tensors: role ('gate' | 'up' | 'down') -> tensor name as the scheme
spec declares it ('qweight', 'scales', 'weight_scale', 'bias', ...) -> tensor."""

TensorNamer = Callable[[int, str, str], str]
"""(expert index, role, tensor) -> the full checkpoint tensor name, for error messages."""


def default_tensor_name(expert: int, role: str, tensor: str) -> str:
    """Generic name used when the caller does not know the model family's naming."""
    return f"experts.{expert}.{role}.{tensor}"


@dataclass(frozen=True)
class ConvertContext:
    """What a converter needs besides the tensors: the bound keys, the activation dtype the layer
    runs in, the scheme's bindings (e.g. group size) and the model's tensor naming."""

    weight_key: QuantKey
    activation_key: QuantKey
    activation_dtype: torch.dtype
    bindings: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    tensor_name: TensorNamer = default_tensor_name


Converter = Callable[[Sequence[ExpertTensors], ConvertContext], ExpertWeights]

_CONVERTERS: dict[tuple[str, str], Converter] = {}


def _same_function(a: Converter, b: Converter) -> bool:
    """True for the same function defined again (module reloaded), so re-import is harmless."""
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
        getattr(b, "__module__", None),
        getattr(b, "__qualname__", None),
    )


def register_converter(format: str, layout: str) -> Callable[[Converter], Converter]:
    """Decorator registering a converter for (checkpoint format, kernel layout).

    Two different functions for one pair would make the choice depend on import order, so that
    is an error.
    """

    def decorate(fn: Converter) -> Converter:
        pair = (format, layout)
        existing = _CONVERTERS.get(pair)
        if existing is not None and not _same_function(existing, fn):
            raise MoERegistryError(
                f"converter for format {format!r} -> layout {layout!r} is already registered "
                f"({existing.__module__}.{existing.__qualname__}); refusing "
                f"{fn.__module__}.{fn.__qualname__}"
            )
        _CONVERTERS[pair] = fn
        return fn

    return decorate


def known_converters() -> list[tuple[str, str]]:
    """Every registered (format, layout) pair, sorted."""
    return sorted(_CONVERTERS)


def get_converter(format: str, layout: str) -> Converter:
    """The converter for (format, layout); the error lists every known pair."""
    try:
        return _CONVERTERS[(format, layout)]
    except KeyError:
        known = ", ".join(f"{f} -> {lay}" for f, lay in known_converters()) or "none"
        raise MoERegistryError(
            f"no converter from checkpoint format {format!r} to kernel layout {layout!r}; "
            f"known: {known}"
        ) from None
