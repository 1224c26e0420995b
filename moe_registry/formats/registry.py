"""Converters: a checkpoint format is turned into a kernel layout by the function a format spec
(``specs/formats/*.yaml``) declares for that (format, layout) pair, so no code ever chooses a
converter with an ``if`` (docs/design.md, "No selection code outside the oracle") and a user spec
dir can add one.

A converter receives one :data:`ExpertTensors` per expert, in expert order, whose shapes and
dtypes the loader has already checked against the scheme spec, and whose weight key the format spec
``holds`` (checked by :func:`get_converter`'s wrapper); it checks the VALUES (scales,
zero points, act-order indices), raising :class:`CheckpointError` with the full tensor name, and
returns new :class:`ExpertWeights` without touching its inputs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from moe_registry.core import guards
from moe_registry.core.errors import ConfigError, MoERegistryError
from moe_registry.core.keys import QuantKey, key_matches
from moe_registry.core.vocab import ROLES
from moe_registry.formats.weights import ExpertWeights
from moe_registry.spec.loader import Registry, load_registry

__all__ = [
    "ExpertTensors",
    "TensorNamer",
    "ConvertContext",
    "Converter",
    "default_tensor_name",
    "get_converter",
    "known_converters",
]


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
    runs in, the scheme's bindings (e.g. group size), the model's tensor naming, and the roles to convert:
    every one for an experts layer, ``ONE_PROJECTION`` for a model's dense linear (its tensors given as the down
    projection; the result holds it as w2, and w13 is the same projection, for no gate and up were fused)."""

    weight_key: QuantKey
    activation_key: QuantKey
    activation_dtype: torch.dtype
    bindings: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    tensor_name: TensorNamer = default_tensor_name
    roles: tuple[str, ...] = ROLES


ONE_PROJECTION: tuple[str, ...] = ("down",)


Converter = Callable[[Sequence[ExpertTensors], ConvertContext], ExpertWeights]

def _registry(registry: Registry | None) -> Registry:
    return registry if registry is not None else load_registry()


def known_converters(registry: Registry | None = None) -> list[tuple[str, str]]:
    """Every (format, layout) pair the format specs declare, sorted (the built-in and user specs
    when no registry is given)."""
    return sorted(_registry(registry).converters)


def get_converter(format: str, layout: str, registry: Registry | None = None) -> Converter:
    """The converter a format spec declares for (format, layout), imported now (specs never import
    code while loading); the error lists every declared pair."""
    reg = _registry(registry)
    found = reg.converter(format, layout)
    if found is None:
        known = ", ".join(f"{f} -> {lay}" for f, lay in sorted(reg.converters)) or "none"
        raise MoERegistryError(
            f"no converter from checkpoint format {format!r} to kernel layout {layout!r}; known: {known}")
    conv, loaded = found
    owner = f"format {format} converter {layout}"
    guards.check_impl(conv.impl, owner, loaded.path, loaded.builtin, guards.CONVERTER_PACKAGE)  # before importing
    module_name, _, fn_name = conv.impl.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{loaded.path}: {owner}: impl {conv.impl} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"{loaded.path}: {owner}: impl {conv.impl} is not a function")
    return functools.partial(_holding, fn, format, tuple(loaded.spec.holds))


def _holding(convert: Converter, format: str, holds: tuple[str, ...], experts: Sequence[ExpertTensors],
             ctx: ConvertContext) -> ExpertWeights:
    """``convert``, once the scheme's weight key is one the format holds (its spec's ``holds``): a scheme
    that pairs a format with a key it cannot hold is a spec bug, refused before weights the kernel would
    misread are written."""
    if not key_matches(ctx.weight_key, holds):
        raise MoERegistryError(f"checkpoint format {format!r} holds {' or '.join(p.removesuffix(' *') for p in holds)} "
                               f"weights, but the scheme bound weight key {ctx.weight_key!s}")
    return convert(experts, ctx)
