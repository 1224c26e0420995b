"""Reading one MoE layer out of a safetensors checkpoint (single file or sharded with an index).

Safetensors only — never pickle. Only the headers are read up front; tensors of the requested
layer are then read one by one, so loading layer N of a large model does not read the rest.
Every tensor is checked against the scheme's declared tensors (name, dtype, symbolic shape)
before anything is converted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from moe_registry.errors import CheckpointError
from moe_registry.expr import ExprError, parse_expr
from moe_registry.runtime import MoEShape
from moe_registry.spec_models import ModelFamilySpec, SchemeSpec, TensorSpec

INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"I32": "int32", "I64": "int64", "I8": "int8", "U8": "uint8", "F16": "float16",
              "BF16": "bfloat16", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu",
              "I16": "int16", "F64": "float64", "BOOL": "bool"}
# A projection may carry a bias (gpt-oss style); it is optional for every scheme.
BIAS_SPEC = TensorSpec(dtype=["bfloat16", "float16", "float32"], shape=["out"], optional=True)
ROLES = ("gate", "up", "down")


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: the file holding it, its dtype name and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor name in the checkpoint with its header entry (nothing loaded)."""

    root: Path
    tensors: Mapping[str, TensorInfo]

    def load(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        with safe_open(str(info.file), framework="pt") as f:
            return f.get_tensor(name)


def open_checkpoint(model_dir: Path) -> CheckpointIndex:
    """Index a model dir's safetensors files by reading their headers only."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a model dir")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index_path}: not a safetensors index ({err})") from None
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: names shard(s) that are not there: {', '.join(missing)}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not read, convert them)" if pickles else ""
        raise CheckpointError(f"{model_dir}: no .safetensors files{hint}")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                    sl = f.get_slice(name)
                    tensors[name] = TensorInfo(path, _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype()),
                                               tuple(sl.get_shape()))
        except (OSError, ValueError, RuntimeError, SafetensorError) as err:
            raise CheckpointError(f"{path}: cannot read safetensors header: {err}") from None
    return CheckpointIndex(model_dir, tensors)


@dataclass(frozen=True)
class LayerNames:
    """Full checkpoint names of one MoE layer's pieces."""

    router: str
    correction_bias: str | None
    expert_prefix: str  # with {expert}

    def projection(self, family: ModelFamilySpec, expert: int, role: str) -> str:
        return f"{self.expert_prefix.format(expert=expert)}.{family.naming.projections[role]}"  # type: ignore[index]


def layer_names(family: ModelFamilySpec, layer: int) -> LayerNames:
    n = family.naming
    prefix = n.layer.format(layer=layer)
    return LayerNames(f"{prefix}.{n.router}.weight",
                      f"{prefix}.{n.correction_bias}" if n.correction_bias else None,
                      f"{prefix}.{n.expert}")


@dataclass(frozen=True)
class LayerTensors:
    """One layer's raw checkpoint tensors: per expert, role → tensor name → tensor."""

    experts: tuple[Mapping[str, Mapping[str, torch.Tensor]], ...]
    router: torch.Tensor | None
    correction_bias: torch.Tensor | None
    names: LayerNames
    has_bias: bool


def _dims(role: str, shape: MoEShape) -> dict[str, int]:
    if role == "down":
        return {"in": shape.intermediate, "out": shape.hidden}
    return {"in": shape.hidden, "out": shape.intermediate}


def _check_tensor(name: str, info: TensorInfo, spec: TensorSpec, values: dict[str, int]) -> None:
    if info.dtype not in spec.dtypes:
        raise CheckpointError(f"{name}: dtype {info.dtype}; expected {' or '.join(spec.dtypes)}")
    try:
        wanted = tuple(parse_expr(d).evaluate(values) for d in spec.shape)
    except ExprError as err:
        raise CheckpointError(f"{name}: cannot compute the expected shape: {err}") from None
    if info.shape != wanted:
        dims = ", ".join(f"{k}={v}" for k, v in values.items())
        raise CheckpointError(f"{name}: shape {list(info.shape)}; expected {list(wanted)} "
                              f"({' x '.join(map(str, spec.shape)) or 'scalar'} with {dims})")


def read_layer(index: CheckpointIndex, family: ModelFamilySpec, layer: int, scheme: SchemeSpec,
               bindings: Mapping[str, Any], shape: MoEShape) -> LayerTensors:
    """Check then load every expert tensor of ``layer`` (and its router)."""
    names = layer_names(family, layer)
    declared = {**scheme.checkpoint.tensors, "bias": BIAS_SPEC}
    expert_re = re.compile(re.escape(names.expert_prefix).replace(r"\{expert\}", r"(\d+)") + r"\.(.+)$")
    by_projection: dict[tuple[int, str], set[str]] = {}
    for tname in index.tensors:
        m = expert_re.match(tname)
        if m:
            proj, _, tensor = m.group(2).partition(".")
            by_projection.setdefault((int(m.group(1)), proj), set()).add(tensor)
    seen_experts = {e for e, _ in by_projection}
    if not seen_experts:
        raise CheckpointError(f"layer {layer}: no expert tensors named {names.expert_prefix.format(expert='N')}.* "
                              f"in {index.root} (is layer {layer} a MoE layer?)")
    extra_experts = sorted(e for e in seen_experts if e >= shape.num_experts)
    if extra_experts:
        raise CheckpointError(f"{names.expert_prefix.format(expert=extra_experts[0])}: expert {extra_experts[0]} "
                              f"exists but config.json says {shape.num_experts} experts")
    values_b = {f"${k}": v for k, v in bindings.items() if isinstance(v, int) and not isinstance(v, bool)}
    plan: list[dict[str, dict[str, str]]] = []
    bias_flags: set[bool] = set()
    for e in range(shape.num_experts):
        roles: dict[str, dict[str, str]] = {}
        for role in ROLES:
            prefix = names.projection(family, e, role)
            present = by_projection.get((e, family.naming.projections[role]), set())  # type: ignore[index]
            unexpected = sorted(present - set(declared))
            if unexpected:
                raise CheckpointError(f"{prefix}.{unexpected[0]}: unexpected tensor for scheme {scheme.scheme} "
                                      f"(expected {', '.join(sorted(scheme.checkpoint.tensors))})")
            values = {**_dims(role, shape), **values_b}
            chosen: dict[str, str] = {}
            for tname, tspec in declared.items():
                full = f"{prefix}.{tname}"
                if tname not in present:
                    if not tspec.optional:
                        raise CheckpointError(f"{full}: missing (scheme {scheme.scheme} needs "
                                              f"{', '.join(sorted(scheme.checkpoint.tensors))})")
                    continue
                _check_tensor(full, index.tensors[full], tspec, values)
                chosen[tname] = full
            bias_flags.add("bias" in chosen)
            roles[role] = chosen
        plan.append(roles)
    if len(bias_flags) > 1:
        raise CheckpointError(f"layer {layer}: some expert projections have a bias and others do not")
    experts = tuple({role: {t: index.load(full) for t, full in tensors.items()} for role, tensors in roles.items()}
                    for roles in plan)
    router = index.load(names.router) if names.router in index.tensors else None
    if router is not None and tuple(router.shape) != (shape.num_experts, shape.hidden):
        raise CheckpointError(f"{names.router}: shape {list(router.shape)}; expected "
                              f"[{shape.num_experts}, {shape.hidden}] (num_experts x hidden_size from config.json)")
    bias = None
    if names.correction_bias and names.correction_bias in index.tensors:
        bias = index.load(names.correction_bias)
    return LayerTensors(experts, router, bias, names, bias_flags == {True})
