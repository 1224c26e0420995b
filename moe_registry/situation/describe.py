"""From what the user points at (config.json, a model dir, or a runtime file) and flags to the
oracle's Situation. Flags override what files say."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moe_registry.core import guards
from moe_registry.core.errors import ConfigError
from moe_registry.core.names import unknown_text
from moe_registry.core.vocab import ALL2ALL_BACKENDS, EXPERT_PLACEMENTS
from moe_registry.situation.config import ModelConfig, config_path, read_json, read_model_config
from moe_registry.situation.machine import probe_commands, probe_environment, probe_platform
from moe_registry.situation.runtime import (
    Environment,
    MoEShape,
    ParallelConfig,
    Platform,
    RuntimeConfig,
    check_dtype,
    parse_platform,
)
from moe_registry.situation.values import Situation
from moe_registry.spec.loader import Registry
from moe_registry.spec.view import ModelFamilySpec


def expert_modules(family: ModelFamilySpec, layer: int, num_experts: int) -> tuple[str, ...]:
    """Full names of the first and last experts' projections of ``layer``, per the family naming."""
    return family.naming.modules(layer, sorted({0, max(num_experts - 1, 0)}))


@dataclass(frozen=True)
class Flags:
    """Command-line overrides; None means "not given"."""

    platform: str | None = None
    dtype: str | None = None
    tp: int | None = None
    ep: int | None = None
    dp: int | None = None
    all2all: str | None = None
    layer: int | None = None
    max_tokens: int | None = None
    expert_placement: str | None = None



def unknown_name(flag: str, kind: str, name: str, known: Iterable[str]) -> ConfigError:
    """The one-line error for a name nobody defined: the known names and the closest one."""
    return ConfigError(f"{flag}: {unknown_text(kind, name, known)}")


def check_kernel_names(registry: Registry, **names: str | None) -> None:
    """``--kernel``/``--prefer`` must name a kernel the registry knows (a typo is bad input, not a
    kernel that is rejected for every situation)."""
    for flag, name in names.items():
        if name is not None and name not in registry.kernels:
            raise unknown_name(f"--{flag}", "kernel", name, registry.kernels)


def _is_runtime_file(path: Path) -> bool:
    """A YAML file, or a JSON file with a ``runtime`` mapping or without ``model_type`` and
    ``architectures`` (those two mark a transformers config.json)."""
    if path.is_dir():
        return False
    if path.suffix in (".yaml", ".yml"):
        return True
    data = read_json(path, "config")
    return "runtime" in data or not ({"model_type", "architectures"} & set(data))


def target_platform(text: str, registry: Registry) -> tuple[Platform, Environment | None]:
    """The platform named (``auto``: this machine, probed here once) and, when it is this machine,
    the environment the kernels' package and command requirements are read from."""
    if text.strip().lower() != "auto":
        return parse_platform(text), None
    packages = {p for loaded in registry.kernels.values() for p in loaded.spec.requires_packages}
    commands = {c for loaded in registry.kernels.values() for c in loaded.spec.requires_commands}
    return probe_platform(), replace(probe_environment(packages), commands=probe_commands(commands))


def _pick(flag: Any, file_value: Any) -> Any:
    return file_value if flag is None else flag


def pick_layer(model: ModelConfig, layer: int | None) -> int:
    """The requested layer (it must be MoE) or the first MoE layer."""
    if not model.moe_layers:
        raise ConfigError(f"{model.path}: no decoder layer is a MoE layer")
    if layer is None:
        return model.moe_layers[0]
    if layer not in model.moe_layers:
        shown = ", ".join(map(str, model.moe_layers[:12])) + (" …" if len(model.moe_layers) > 12 else "")
        raise ConfigError(f"--layer: layer {layer} has no MoE (MoE layers: {shown})")
    return layer


def situation_for(target: Path, registry: Registry, flags: Flags) -> Situation:
    """Build the Situation the user described."""
    guards.check_flag_sizes(max_tokens=flags.max_tokens, tp=flags.tp, ep=flags.ep, dp=flags.dp)
    if not target.exists():
        raise ConfigError(f"{target}: no such file or directory")
    if target.is_dir() and not (target / "config.json").is_file():
        raise ConfigError(f"{target}: a model dir needs a config.json")
    if _is_runtime_file(config_path(target)):
        return _from_runtime_file(target, registry, flags)
    return _from_model(read_model_config(target, registry), registry, flags, None)  # flags checked above


def situation_for_model(model: ModelConfig, registry: Registry, flags: Flags) -> Situation:
    """The Situation for an already-read model config (no runtime file)."""
    guards.check_flag_sizes(max_tokens=flags.max_tokens, tp=flags.tp, ep=flags.ep, dp=flags.dp)
    return _from_model(model, registry, flags, None)


def _from_model(model: ModelConfig, registry: Registry, flags: Flags, base: RuntimeConfig | None) -> Situation:
    layer = pick_layer(model, flags.layer)
    platform, environment = (target_platform(flags.platform, registry) if flags.platform else
                             (base.platform, base.environment) if base else target_platform("auto", registry))
    # A runtime file's own dtype arrives in flags; otherwise the model's dtype wins, as for its config.json.
    dtype = check_dtype(flags.dtype or model.dtype or (base.dtype if base else None) or "bfloat16")
    parallel = ParallelConfig(
        tp=_pick(flags.tp, base.parallel.tp if base else 1), ep=_pick(flags.ep, base.parallel.ep if base else 1),
        dp=_pick(flags.dp, base.parallel.dp if base else 1),
        all2all=_pick(flags.all2all, base.parallel.all2all if base else "none"),
        expert_placement=_pick(flags.expert_placement, base.parallel.expert_placement if base else "contiguous"))
    shape = model.shape_at(layer)  # a per-layer top-k or expert count: this layer's own
    _check_parallel(parallel, shape)
    runtime = RuntimeConfig(platform, dtype, shape, parallel,
                            _pick(flags.max_tokens, base.max_tokens if base else 8192),
                            (base.router_weight_on_input if base else False)
                            or bool(model.routing.get("router_weight_on_input", False)), environment)
    family = registry.families[model.family].spec
    return Situation(model.quant_config, runtime, expert_modules(family, layer, shape.num_experts),
                     model.quant_source, model.path, model.family, layer, model.not_runnable, model.routing_values,
                     model.moe_layers, flags.layer is not None)


def _check_parallel(p: ParallelConfig, shape: MoEShape | None) -> None:
    for name in ("tp", "ep", "dp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"--{name}: got {getattr(p, name)}; wanted a positive integer")
    if p.all2all not in ALL2ALL_BACKENDS:
        raise unknown_name("--all2all", "all2all backend", p.all2all, ALL2ALL_BACKENDS)
    if p.expert_placement not in EXPERT_PLACEMENTS:
        raise unknown_name("--expert-placement", "expert placement", p.expert_placement, EXPERT_PLACEMENTS)
    if shape is None:
        return
    if p.ep > 1 and shape.num_experts % p.ep:
        raise ConfigError(f"--ep: {shape.num_experts} experts do not split evenly over ep={p.ep}")
    if p.ep == 1 and shape.intermediate % p.tp:
        raise ConfigError(f"--tp: intermediate size {shape.intermediate} does not split evenly over tp={p.tp}")


def _from_runtime_file(target: Path, registry: Registry, flags: Flags) -> Situation:
    path = config_path(target)
    from moe_registry.situation.runtime_file import parse_runtime_file  # pydantic: only with a runtime file
    from moe_registry.spec.yamlio import load_yaml_file

    data = load_yaml_file(path) if path.suffix in (".yaml", ".yml") else read_json(path, "runtime file")
    bare = _is_quantization_config(data)
    rf = parse_runtime_file(json.loads(json.dumps({"quantization_config": data} if bare else data)), str(path))
    platform, environment = target_platform(flags.platform or rf.platform, registry)
    base = RuntimeConfig(platform, rf.dtype or "bfloat16", None, ParallelConfig(rf.tp, rf.ep, rf.dp, rf.all2all,
                                                                                  rf.expert_placement),
                         rf.max_tokens, rf.router_weight_on_input, environment)
    if rf.model is not None:
        model_path = (path.parent / rf.model).resolve()
        model = read_model_config(model_path, registry)
        if rf.dtype and not flags.dtype:
            flags = Flags(**{**flags.__dict__, "dtype": rf.dtype})
        return _from_model(model, registry, flags, base)
    dims = [rf.num_experts, rf.top_k, rf.hidden, rf.intermediate]
    shape = None
    if any(d is not None for d in dims):
        if any(d is None for d in dims):
            raise ConfigError(f"{path}: give all of num_experts, top_k, hidden, intermediate (or a model)")
        shape = MoEShape(rf.num_experts, rf.top_k, rf.hidden, rf.intermediate,  # type: ignore[arg-type]
                         rf.activation, rf.has_bias)
    parallel = ParallelConfig(_pick(flags.tp, rf.tp), _pick(flags.ep, rf.ep), _pick(flags.dp, rf.dp),
                              _pick(flags.all2all, rf.all2all), _pick(flags.expert_placement, rf.expert_placement))
    _check_parallel(parallel, shape)
    runtime = RuntimeConfig(platform, check_dtype(flags.dtype or rf.dtype or "bfloat16"), shape, parallel,
                            _pick(flags.max_tokens, rf.max_tokens), rf.router_weight_on_input, environment)
    return Situation(rf.quantization_config, runtime, model=str(path),
                     quant_source=path.name if bare else f"{path.name}:quantization_config")


def _is_quantization_config(data: Any) -> bool:
    """A quantization config on its own (``quantization_config.json``, ``hf_quant_config.json``): explained
    as a runtime file holding only it (its scheme and kernels; no shape)."""
    return isinstance(data, dict) and ("quant_method" in data or {"producer", "quantization"} <= set(data))
