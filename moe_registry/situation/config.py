"""Reading a model's ``config.json`` (and ``hf_quant_config.json`` beside it) through the
model-family specs: which family, the MoE shape, which layers are MoE, routing parameters, and
the quantization config with where it came from."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from moe_registry.core import guards
from moe_registry.core.errors import ConfigError
from moe_registry.core.vocab import ACTIVATION_FNS
from moe_registry.situation.runtime import MoEShape
from moe_registry.situation.values import RoutingValue
from moe_registry.spec.fields import MISSING, check_field, get_path
from moe_registry.spec.loader import Registry
from moe_registry.spec.view import ConfigClass, FieldRef, ModelFamilySpec

MAX_CONFIG_BYTES = 4 * 1024 * 1024
_TORCH_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16",
                 "float32": "float32", "float": "float32"}


@dataclass(frozen=True)
class ModelConfig:
    """What config.json says about the MoE layers, resolved through a family spec."""

    path: str
    family: str
    shape: MoEShape
    num_layers: int
    moe_layers: tuple[int, ...]
    routing: Mapping[str, Any]
    quant_config: Mapping[str, Any] | None
    quant_source: str
    dtype: str | None
    raw: Mapping[str, Any]
    not_runnable: tuple[str, ...] = ()  # why no kernel here runs these experts (explain shows it, run refuses)
    mtp_layers: int = 0  # multi-token-prediction layers a checkpoint may hold after the decoder's (not loaded)

    def shape_at(self, layer: int) -> MoEShape:
        """The MoE shape of ``layer``: ``shape`` with the layer's own entry of each per-layer field."""
        return replace(self.shape, **{k: v[layer] for k, v in self.per_layer.items()}) if self.per_layer else self.shape
    routing_values: tuple[RoutingValue, ...] = ()  # every routing value with where it came from (explain)
    per_layer: Mapping[str, tuple[int, ...]] = dataclass_field(default_factory=dict)  # shape fields given one per layer


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``, with errors naming the file."""
    try:
        data = guards.read_json_file(path, what, max_bytes=MAX_CONFIG_BYTES)  # regular file, size, depth
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read {what}: {err}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: {what} is not valid JSON: {err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} must be a JSON object")
    return data


def config_path(target: Path) -> Path:
    """``target`` itself or the config.json inside a model dir."""
    return target / "config.json" if target.is_dir() else target


def _roots(cfg: Mapping[str, Any], family: ModelFamilySpec) -> list[Mapping[str, Any]]:
    roots: list[Mapping[str, Any]] = [cfg]
    for name in family.config_root:
        sub = cfg.get(name)
        if isinstance(sub, Mapping):
            roots.append(sub)
    return roots


def _lookup(root: Mapping[str, Any], name: str) -> Any:
    """``root[name]``, where a dotted name walks into sub-objects (DBRX's ``ffn_config.moe_num_experts``);
    None when absent."""
    value: Any = root
    for part in name.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def resolve_field(roots: list[Mapping[str, Any]], ref: FieldRef, what: str, path: str,
                  config_class: tuple[str, ConfigClass] | None = None) -> Any:
    """The first present name of ``ref`` in any root, else the config class's default, else the entry's
    default; ConfigError if none."""
    return locate_field(roots, ref, what, path, config_class)[0]


def locate_field(roots: list[Mapping[str, Any]], ref: FieldRef, what: str, path: str,
                 config_class: tuple[str, ConfigClass] | None = None,
                 root_names: tuple[str, ...] = ()) -> tuple[Any, str, str | None]:
    """(value, origin, field): as ``resolve_field``, with where the value came from (``RoutingValue`` origins).
    A field written as null takes the entry's default, not the class's (transformers is handed None then,
    which the entry's default stands for: DBRX's moe_normalize_expert_weights null, no normalisation)."""
    written_null = None
    for i, root in enumerate(roots):
        for name in ref.from_:
            value = _lookup(root, name)
            where = f"{root_names[i]}.{name}" if i < len(root_names) and root_names[i] else name
            if isinstance(value, list) and ref.per_layer:  # read per layer by read_model_config
                return tuple(value), "config", where
            if value is not None and ref.length:
                if not isinstance(value, list | str):
                    raise ConfigError(f"{path}: {name}: got {value!r}; wanted a per-layer list or string")
                return len(value), "config", where
            if value is not None:
                return value, "config", where
            if written_null is None and _written(root, name):
                written_null = where
    if config_class is not None and written_null is None:
        cls_name, cls = config_class
        for name in ref.from_:
            if name in cls.defaults and cls.defaults[name] is not None:
                return cls.defaults[name], "class-default", name
    if ref.default is not None:
        return ref.default, ("spec-default" if ref.from_ else "fixed"), written_null or (ref.from_ or [None])[0]
    names = " or ".join(ref.from_) or "(none)"
    raise ConfigError(f"{path}: {what}: field {names} is missing")


def _written(root: Mapping[str, Any], name: str) -> bool:
    """``name`` (dotted) is a key of ``root``, whatever its value."""
    *parents, last = name.split(".")
    value: Any = root
    for part in parents:
        value = value.get(part) if isinstance(value, Mapping) else None
    return isinstance(value, Mapping) and last in value


def config_class_of(cfg: Mapping[str, Any], family: ModelFamilySpec) -> tuple[str, ConfigClass] | None:
    """The transformers config class this config is read with: by its model_type, a sub-config's, then its
    architectures; None when the family names none for it."""
    sub_types = [str(sub["model_type"]) for sub in cfg.values() if isinstance(sub, Mapping) and "model_type" in sub]
    archs = cfg.get("architectures") if isinstance(cfg.get("architectures"), list) else []
    for name in [str(cfg.get("model_type", "")), *sub_types, *map(str, archs)]:
        for cls_name, cls in family.config_classes.items():
            if name in cls.model_types:
                return cls_name, cls
    return None


def match_family(cfg: Mapping[str, Any], registry: Registry, path: str) -> ModelFamilySpec:
    """The family whose model_type or architectures match (the top level first, then sub-configs such
    as text_config); ConfigError naming the closest known families."""
    model_types = {str(cfg.get("model_type", ""))}
    archs = set(guards.check_str_list(cfg.get("architectures"), f"{path}: architectures"))
    sub_types = {str(sub["model_type"]) for sub in cfg.values() if isinstance(sub, Mapping) and "model_type" in sub}
    for types in (model_types, sub_types):
        for loaded in registry.families.values():
            fam = loaded.spec
            if types & set(fam.match.model_type) or archs & set(fam.match.architectures):
                return fam
    seen = f"model_type: {cfg.get('model_type') or '(none)'!r} (architectures {sorted(archs) or 'none'})"
    counts = expert_count_names(registry)
    if not any(_lookup(root, name) for root in (cfg, *(s for s in cfg.values() if isinstance(s, Mapping)))
               for name in counts):
        raise ConfigError(f"{path}: {seen}: this model has no MoE layers (its config gives no expert count: none of "
                          f"{', '.join(counts)}); moe-registry runs the MoE layers of MoE models")
    near = closest_families(model_types | sub_types, archs, registry)
    raise ConfigError(f"{path}: {seen.replace(' (', ' is not a known MoE family (', 1)}; closest known: {near}")


def expert_count_names(registry: Registry) -> list[str]:
    """Every config field a family reads its expert count from (a config with none of them is not a MoE model)."""
    return sorted({n for loaded in registry.families.values() for n in loaded.spec.fields["num_experts"].from_})


def closest_families(model_types: set[str], archs: set[str], registry: Registry) -> str:
    """The known families whose model types or architectures are nearest by spelling (difflib)."""
    by_name: dict[str, str] = {}
    for loaded in registry.families.values():
        for name in [*loaded.spec.match.model_type, *loaded.spec.match.architectures]:
            by_name.setdefault(name, loaded.spec.family)
    near: dict[str, str] = {}  # family -> its nearest name: a family is named once
    for seen in sorted(t for t in model_types | archs if t):
        for name in difflib.get_close_matches(seen, list(by_name), n=3, cutoff=0.5):
            near.setdefault(by_name[name], f"{by_name[name]} ({name})")
    return ", ".join(list(near.values())[:4]) or "none (moe-registry list families shows them all)"


def _int(value: Any, what: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{path}: {what}: got {guards.short_repr(value)}; wanted a positive integer")
    return guards.check_int(value, f"{path}: {what}", hi=guards.size_limit(what))


def _count(value: Any, what: str, path: str) -> int:
    """A count that may be zero (absent: zero)."""
    return 0 if value is None or (value == 0 and not isinstance(value, bool)) else _int(value, what, path)


def _present(roots: list[Mapping[str, Any]], names: list[str]) -> Any:
    for root in roots:
        for name in names:
            if _lookup(root, name) is not None:
                return _lookup(root, name)
    return None


def _moe_layers(roots: list[Mapping[str, Any]], family: ModelFamilySpec, num_layers: int,
                path: str) -> tuple[int, ...]:
    """The MoE layer indices by the family's rule: an explicit list, a per-layer list, or the
    first_dense / last / step / offset / skip arithmetic."""
    spec = family.moe_layers
    if spec.indices is not None:
        given = _present(roots, spec.indices.from_)
        if given is not None:
            if not isinstance(given, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in given):
                raise ConfigError(f"{path}: {spec.indices.from_[0]}: got {given!r}; wanted a list of layer "
                                  f"indices below {num_layers}")
            return tuple(sorted(set(given)))
    if spec.per_layer is not None:
        per = _present(roots, spec.per_layer.from_)
        if per is not None:
            if not isinstance(per, list | str) or len(per) != num_layers:
                raise ConfigError(f"{path}: {spec.per_layer.from_[0]}: got {per!r}; wanted one entry per layer "
                                  f"({num_layers})")
            return tuple(i for i, kind in enumerate(per) if kind in spec.per_layer.moe)
    first = resolve_field(roots, spec.first_dense, "first_dense", path) if spec.first_dense else 0
    last = resolve_field(roots, spec.last, "last", path) if spec.last else -1
    step = resolve_field(roots, spec.step, "step", path) if spec.step else 1
    skip = set(guards.check_layer_list(resolve_field(roots, spec.skip, "skip", path), f"{path}: "
                                       f"{' or '.join(spec.skip.from_)}")) if spec.skip else set()
    first, last, step = (guards.check_int(v, f"{path}: {' or '.join(ref.from_) if ref else k}", lo=-1,
                                          hi=guards.MAX_LAYERS)
                         for k, v, ref in (("first_dense", first, spec.first_dense), ("last", last, spec.last),
                                           ("step", step, spec.step)))
    last = num_layers - 1 if int(last) < 0 else int(last)
    step = max(int(step), 1)
    return tuple(i for i in range(int(first), min(last, num_layers - 1) + 1)
                 if (i + 1 - spec.offset) % step == 0 and i not in skip)


def _shared(roots: list[Mapping[str, Any]], family: ModelFamilySpec, name: str,
            config_class: tuple[str, ConfigClass] | None) -> tuple[int, int]:
    """(count, one shared expert's intermediate size); (0, 0) when the family has none."""
    f = family.fields
    count = resolve_field(roots, f["shared_experts"], "shared_experts", name, config_class) \
        if "shared_experts" in f else 0
    size = resolve_field(roots, f["shared_intermediate"], "shared_intermediate", name, config_class) \
        if "shared_intermediate" in f and count else 0
    if not count or not size:
        return 0, 0
    return _int(count, "shared_experts", name), _int(size, "shared_intermediate", name)


def read_model_config(target: Path, registry: Registry) -> ModelConfig:
    """Read config.json (a file or a model dir) and the quantization config beside it."""
    path = config_path(target)
    cfg = read_json(path, "config.json")
    family = match_family(cfg, registry, str(path))
    guards.check_sub_model_types(cfg, family.config_root, family.match.model_type, family.family, str(path))
    roots = _roots(cfg, family)
    f = family.fields
    name = str(path)
    cls = config_class_of(cfg, family)
    num_layers = _int(resolve_field(roots, f["num_layers"], "num_layers", name), "num_hidden_layers", name)
    per_layer = {what: _per_layer_ints(value, f[what], name, num_layers)
                 for what, value in (("num_experts", resolve_field(roots, f["num_experts"], "num_experts", name)),
                                     ("top_k", resolve_field(roots, f["top_k"], "top_k", name, cls)))
                 if isinstance(value, tuple)}
    for layer in range(num_layers):
        experts = per_layer["num_experts"][layer] if "num_experts" in per_layer else None
        if "top_k" in per_layer and experts is not None and per_layer["top_k"][layer] > experts:
            raise ConfigError(f"{name}: layer {layer}: top-k {per_layer['top_k'][layer]} is more than its "
                              f"{experts} experts")
    shape = MoEShape(
        num_experts=_int(per_layer["num_experts"][0] if "num_experts" in per_layer else
                         resolve_field(roots, f["num_experts"], "num_experts", name), "num_experts", name),
        top_k=_int(per_layer["top_k"][0] if "top_k" in per_layer else
                   resolve_field(roots, f["top_k"], "top_k", name, cls), "top_k", name),
        hidden=_int(resolve_field(roots, f["hidden"], "hidden", name), "hidden_size", name),
        intermediate=_int(resolve_field(roots, f["intermediate"], "intermediate", name),
                          "intermediate_size", name),
        activation=_activation(resolve_field(roots, f["activation"], "activation", name)
                               if "activation" in f else "silu", name),
        has_bias=bool(resolve_field(roots, f["has_bias"], "has_bias", name)) if "has_bias" in f else False,
        **dict(zip(("shared_experts", "shared_intermediate"), _shared(roots, family, name, cls), strict=True)),
    )
    if shape.top_k > shape.num_experts:
        raise ConfigError(f"{name}: num_experts_per_tok: {shape.top_k} is more than the {shape.num_experts} experts")
    values = _routing_values(roots, family, cls, name)
    values["top_k"] = replace(values["top_k"], value=shape.top_k)  # a per-layer list's value as the shape holds it
    _check_routing(values, shape, name)
    routing = {word: v.value for word, v in values.items() if word != "top_k"}
    shown = (*values.values(), *_implied_routing(values, roots, family, cls, shape, name))
    quant, source = _quant_config(cfg, roots, path)
    dtype = _TORCH_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""))
    mtp = _count(resolve_field(roots, f["mtp_layers"], "mtp_layers", name, cls), " or ".join(f["mtp_layers"].from_),
                 name) if "mtp_layers" in f else 0
    return ModelConfig(name, family.family, shape, num_layers,
                       _moe_layers(roots, family, num_layers, name), routing, quant, source, dtype, cfg,
                       _not_runnable(roots, family, shape, routing, name), mtp, tuple(shown), per_layer=per_layer)


def _per_layer_ints(values: tuple[Any, ...], ref: FieldRef, path: str, num_layers: int) -> tuple[int, ...]:
    """A per-layer list (a family field marked ``per_layer``): one positive integer for each layer."""
    names = " or ".join(ref.from_)
    if len(values) != num_layers:
        raise ConfigError(f"{path}: {names}: a list of {len(values)} entries; wanted one per layer "
                          f"({num_layers}) or one integer")
    return tuple(_int(v, f"{names}[{i}]", path) for i, v in enumerate(values))


# What a routing word means when the family's spec does not name it: its modeling code has no such thing.
_ABSENT_WORDS: dict[str, Any] = {"num_expert_group": 1, "topk_group": 1, "correction_bias": False,
                                 "routed_scaling_factor": 1.0, "router_weight_on_input": False,
                                 "shared_expert_gate": False}


def _routing_values(roots: list[Mapping[str, Any]], family: ModelFamilySpec, cls: tuple[str, ConfigClass] | None,
                    name: str) -> dict[str, RoutingValue]:
    """top_k and the family's routing words, each with where it came from."""
    names = ("", *family.config_root)
    out: dict[str, RoutingValue] = {}
    refs = [("top_k", family.fields["top_k"]), *family.routing.items()]
    for word, ref in refs:
        value, origin, field = locate_field(roots, ref, word, name, cls, names)
        out[word] = RoutingValue(word, value, origin, field, cls[0] if origin == "class-default" and cls else None,
                                 family.family)
    return out


def _implied_routing(values: Mapping[str, RoutingValue], roots: list[Mapping[str, Any]], family: ModelFamilySpec,
                     cls: tuple[str, ConfigClass] | None, shape: MoEShape, name: str) -> list[RoutingValue]:
    """The routing words the family's spec leaves out, with the value that means (none of it in the modeling
    code), the group score grouped top-k uses when unnamed, and the shared experts beside the routed ones
    (their values as the shape holds them, their sources as the fields were found)."""
    out = [RoutingValue(w, v, "none", family=family.family) for w, v in _ABSENT_WORDS.items() if w not in values]
    groups = values["num_expert_group"].value if "num_expert_group" in values else 1
    if "group_score" not in values and groups > 1:
        bias = bool(values["correction_bias"].value) if "correction_bias" in values else False
        out.append(RoutingValue("group_score", "top2_sum" if bias else "max", "fixed", family=family.family))
    for word, value in (("shared_experts", shape.shared_experts), ("shared_intermediate", shape.shared_intermediate)):
        ref = family.fields.get(word)
        if ref is None or not value:
            out.append(RoutingValue(word, value, "none" if ref is None else "fixed", family=family.family))
            continue
        _, origin, field = locate_field(roots, ref, word, name, cls, ("", *family.config_root))
        out.append(RoutingValue(word, value, origin, field, cls[0] if origin == "class-default" and cls else None,
                                family.family))
    return out


def _check_routing(values: Mapping[str, RoutingValue], shape: MoEShape, name: str) -> None:
    """Routing values the modeling code would take on trust, checked before anything runs: one line naming
    the config field, the value seen and the value wanted."""
    def bad(word: str, wanted: str) -> ConfigError:
        v = values[word]
        return ConfigError(f"{name}: {v.field or 'routing.' + word}: got {guards.short_repr(v.value)}; wanted {wanted}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for word in ("correction_bias", "router_weight_on_input", "shared_expert_gate"):
        if word in values and not isinstance(values[word].value, bool):
            raise bad(word, "true or false")
    if "scoring" in values and not isinstance(values["scoring"].value, str):
        raise bad("scoring", "a scoring function's name, e.g. softmax or sigmoid")
    if "renormalize" in values:
        p = values["renormalize"].value
        if not (isinstance(p, bool) or (isinstance(p, int | float) and math.isfinite(p) and p > 0)):
            raise bad("renormalize", "true or false (or a positive number p: divide by the p-norm)")
    if "routed_scaling_factor" in values:
        scale = values["routed_scaling_factor"].value
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
            raise bad("routed_scaling_factor", "a positive number (the routed experts' output is multiplied by it)")
    if "num_expert_group" not in values:
        return
    groups = values["num_expert_group"].value
    if not is_int(groups) or groups < 1:
        raise bad("num_expert_group", "a positive integer (the number of expert groups)")
    if shape.num_experts % groups:
        raise bad("num_expert_group", f"a divisor of the {shape.num_experts} experts (groups of equal size)")
    top_groups = values["topk_group"].value if "topk_group" in values else 1
    if "topk_group" in values and (not is_int(top_groups) or not 1 <= top_groups <= groups):
        raise bad("topk_group", f"an integer in [1, {groups}] (the groups kept, of {groups})")
    held = top_groups * (shape.num_experts // groups)
    if shape.top_k > held:
        raise ConfigError(f"{name}: {values['top_k'].field or 'top_k'}: got {shape.top_k}; wanted at most {held}, "
                          f"the experts in the {top_groups} chosen group(s) of {shape.num_experts // groups}")


def _not_runnable(roots: list[Mapping[str, Any]], family: ModelFamilySpec, shape: MoEShape,
                  routing: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """Why the kernels here cannot run this family's experts as its modeling code does, read from the
    spec's words alone (scoring, renormalize p, group_score, activation, gated, latent_size, zero_experts)."""
    out = []
    scoring = routing.get("scoring", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        out.append(f"routing.scoring {scoring!r}: the routers here score by softmax or sigmoid")
    group_score = routing.get("group_score")
    if group_score is not None and group_score not in ("max", "top2_sum"):
        raise ConfigError(f"{name}: routing.group_score: got {group_score!r}; wanted max or top2_sum")
    p = routing.get("renormalize")
    if isinstance(p, int | float) and not isinstance(p, bool) and p != 1:
        out.append(f"routing.renormalize: the kept weights are divided by their {p}-norm; only 1 "
                   "(weights summing to 1) is run here")
    if shape.activation not in ACTIVATION_FNS:
        out.append(f"activation {shape.activation!r}: the kernels here run {', '.join(ACTIVATION_FNS)}")
    f = family.fields
    if "gated" in f and not resolve_field(roots, f["gated"], "gated", name):
        out.append("experts are not gated (down(act(up(x))), no gate projection); the kernels here run "
                   "down(act(gate(x)) * up(x))")
    latent = _present(roots, f["latent_size"].from_) if "latent_size" in f else None
    latent = latent if latent is not None else (f["latent_size"].default if "latent_size" in f else None)
    if latent:
        out.append(f"experts run in a latent space of {_int(latent, 'latent_size', name)} between projections "
                   f"from and back to hidden {shape.hidden}; not run here")
    zero = _present(roots, f["zero_experts"].from_) if "zero_experts" in f else None
    if zero:
        out.append(f"{_int(zero, 'zero_experts', name)} zero-compute (identity) experts are routed beside the "
                   f"{shape.num_experts} experts; not run here")
    out.extend(_requires(roots, family))
    return tuple(out)


def _requires(roots: list[Mapping[str, Any]], family: ModelFamilySpec) -> list[str]:
    """The family's ``requires`` tests that this config fails (the first root holding the field is tested;
    absent everywhere, the rule's default is)."""
    out = []
    for field, rule in family.requires.items():
        root = next((r for r in roots if any(get_path(r, n) is not MISSING for n in (field, *rule.aliases))),
                    roots[0])
        check = check_field(root, field, rule)
        if not check.passed:
            out.append(f"{check.message}: the kernels here implement only that (requires.{field} in family "
                       f"{family.family})")
    return out


_ACTIVATION_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


def _activation(value: Any, path: str) -> str:
    """The kernels' name for ``value``; another activation name (Nemotron-H's relu2) is kept as written
    and reported as not run here; anything else is bad input."""
    names = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu",
             "swigluoai": "swigluoai"}
    if str(value) in names:
        return names[str(value)]
    if isinstance(value, str) and _ACTIVATION_RE.match(value):
        return value
    raise ConfigError(f"{path}: hidden_act: got {value!r}; wanted an activation name such as "
                      f"{', '.join(sorted(names))}")


def _quant_config(cfg: Mapping[str, Any], roots: list[Mapping[str, Any]],
                  path: Path) -> tuple[Mapping[str, Any] | None, str]:
    for root in roots:
        q = root.get("quantization_config")
        if q is not None:
            if not isinstance(q, Mapping):
                raise ConfigError(f"{path}: quantization_config must be an object, got {type(q).__name__}")
            side = path.parent / "hf_quant_config.json"
            if side.exists() or side.is_symlink():  # a second source must agree
                guards.check_quant_sources(q, read_json(side, "hf_quant_config.json"), str(path), side.name)
            return q, f"{path.name}:quantization_config"
    side = path.parent / "hf_quant_config.json"
    if side.exists() or side.is_symlink():
        return read_json(side, "hf_quant_config.json"), side.name
    return None, "none (no quantization_config)"
