"""Reading one MoE layer out of a safetensors checkpoint (single file or sharded with an index).

Safetensors only — never pickle. Only the headers are read up front; tensors of the requested
layer are then read one by one, so loading layer N of a large model does not read the rest.
Every tensor is checked against the scheme's declared tensors (name, dtype, symbolic shape)
before anything is converted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from moe_registry.checkpoint.tensor_index import CheckpointIndex, LayerNames, TensorInfo, layer_names
from moe_registry.checkpoint.values import check_all_equal
from moe_registry.core import guards
from moe_registry.core.errors import CheckpointError
from moe_registry.core.vocab import ROLES
from moe_registry.situation.runtime import MoEShape
from moe_registry.spec.expr import ExprError, parse_expr
from moe_registry.spec.view import ModelFamilySpec, SchemeSpec, TensorSpec

# A projection may carry a bias (gpt-oss style); it is optional for every scheme.
BIAS_SPEC = TensorSpec(dtype=["bfloat16", "float16", "float32"], shape=["out"], optional=True, all_equal=None,
                       stacked=None)
LAYER_WIDE = frozenset({"input_scale"})
"""Per-expert checkpoint tensors that conversion collapses over ALL experts into one layer-wide value
(``ProjectionWeights.input_scale``: the largest static activation scale, as vLLM does). A rank that reads only
its own experts still reads these (one scalar per projection) for every expert, so that its layer-wide value
is the single-process layer's, not the largest over its own experts."""


@dataclass(frozen=True)
class StackedTensor:
    """A checkpoint tensor that holds every expert read at once, as stored: dim 0 is the expert (or, for a 2-D
    ``layout`` such as ``("E*out", "in")``, each expert's rows), then the dims ``layout`` names (None: the
    expert's slice is already [out, in, ...]). ``part`` is the projection it holds (gate_up, gate, up or down);
    a gate_up part holds gate and up along ``split_dim`` of one expert's [out, ...] slice, in ``order``
    (``halves``: gate then up; ``interleaved``: even and odd rows), or one value both share (``split_dim`` None).
    Turning it into per-expert [out, in] tensors is the formats stage's job (``formats.stacked``)."""

    tensor: torch.Tensor
    part: str
    layout: tuple[str, ...] | None = None
    split_dim: int | None = 0
    order: str = "halves"


@dataclass(frozen=True)
class LayerTensors:
    """One layer's raw checkpoint tensors: per expert, role → tensor name → tensor, and the tensors stored
    stacked over experts (``stacked``: (part, tensor name) → :class:`StackedTensor`, sliced to the experts
    read). Read for a subset of the experts (an expert-parallel rank), ``experts`` holds those of ``expert_ids``
    (global ids, in that order), and ``layer_wide`` / ``stacked_wide`` every expert's :data:`LAYER_WIDE`
    tensors; read whole, ``expert_ids`` is None. ``formats.stacked.experts_of`` gives every expert's tensors
    in one mapping."""

    experts: tuple[Mapping[str, Mapping[str, torch.Tensor]], ...]
    router: torch.Tensor | None
    correction_bias: torch.Tensor | None
    names: LayerNames
    has_bias: bool
    router_bias: torch.Tensor | None = None
    expert_ids: tuple[int, ...] | None = None
    layer_wide: tuple[Mapping[str, Mapping[str, torch.Tensor]], ...] = ()
    stacked: Mapping[tuple[str, str], StackedTensor] = field(default_factory=dict)
    stacked_wide: Mapping[tuple[str, str], StackedTensor] = field(default_factory=dict)

    def experts_to(self, device: torch.device) -> LayerTensors:
        """These tensors with every expert's (stacked and layer-wide ones included) on ``device``, the router's
        where they are: what a layer converted where its kernel runs reads."""
        def moved(maps: tuple[Mapping[str, Mapping[str, torch.Tensor]], ...]) -> tuple[dict, ...]:
            return tuple({role: {name: t.to(device) for name, t in by_name.items()} for role, by_name in m.items()}
                         for m in maps)

        def moved_stacked(stacked: Mapping[tuple[str, str], StackedTensor]) -> dict:
            return {key: replace(st, tensor=st.tensor.to(device)) for key, st in stacked.items()}
        return replace(self, experts=moved(self.experts), layer_wide=moved(self.layer_wide),
                       stacked=moved_stacked(self.stacked), stacked_wide=moved_stacked(self.stacked_wide))

    def router_only(self) -> LayerTensors:
        """These tensors without any expert's: what a built layer keeps (its kernel holds its own copy of the
        experts, and routing needs only the router's tensors and the names)."""
        return replace(self, experts=(), layer_wide=(), stacked={}, stacked_wide={})


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
               bindings: Mapping[str, Any], shape: MoEShape, experts: Sequence[int] | None = None) -> LayerTensors:
    """Check every expert tensor's header of ``layer``, then load its router and the tensors of ``experts``
    (global ids, in that order; default all): per-expert tensors by name, fused ones by slice. With a subset,
    every expert's :data:`LAYER_WIDE` tensors are loaded too (``LayerTensors.layer_wide``)."""
    with index.held_open():  # each file's header parsed once for the layer, not once per tensor
        return _read_layer(index, family, layer, scheme, bindings, shape, experts)


def _read_layer(index: CheckpointIndex, family: ModelFamilySpec, layer: int, scheme: SchemeSpec,
                bindings: Mapping[str, Any], shape: MoEShape, experts: Sequence[int] | None) -> LayerTensors:
    ids = _expert_ids(experts, shape.num_experts)
    names = layer_names(family, layer, index)
    if names.fused is not None and scheme.checkpoint.fused_names is not None:
        names = replace(names, fused=replace(names.fused, tensor_names=scheme.checkpoint.fused_names))
        parts, has_bias, wide = _read_fused_stacked(index, names, layer, scheme, shape, bindings, ids)
        return replace(_with_router(index, names, shape, _no_tensors(shape, ids), has_bias), expert_ids=ids,
                       stacked=parts, stacked_wide=wide)
    if names.fused is not None:  # one 'weight' tensor per projection: nothing layer-wide
        parts, has_bias = _read_fused(index, names, layer, scheme, shape, ids)
        return replace(_with_router(index, names, shape, _no_tensors(shape, ids), has_bias), expert_ids=ids,
                       stacked=parts)
    projections = names.projections
    assert names.expert_prefix is not None and projections is not None
    stacked = _stacked_names(index, names, scheme)
    names = replace(names, stacked=stacked)
    declared = {**{t: v for t, v in scheme.checkpoint.tensors.items() if t not in (stacked or {})}, "bias": BIAS_SPEC}
    expert_re = re.compile(re.escape(names.expert_prefix).replace(r"\{expert\}", r"([^.]+)") + r"\.(.+)$")
    by_projection: dict[tuple[int, str], set[str]] = {}
    for tname in index.tensors:
        m = expert_re.match(tname)
        if m:
            proj, _, tensor = m.group(2).partition(".")
            by_projection.setdefault((guards.expert_index(m.group(1), tname), proj), set()).add(tensor)
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
            prefix = names.projection(e, role)
            present = by_projection.get((e, projections[role]), set())
            unexpected = sorted(present - set(declared))
            if unexpected and unexpected[0] in (stacked or {}):
                held = stacked[unexpected[0]].format(part="down" if role == "down" else "gate_up")  # type: ignore[index]
                raise CheckpointError(f"{prefix}.{unexpected[0]}: per expert, but this layer also holds it stacked "
                                      f"over its experts as {held}; wanted one of the two")
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
    wanted = range(shape.num_experts) if ids is None else ids
    loaded = {e: {role: {t: _load_checked(index, full, declared[t], scheme.scheme) for t, full in tensors.items()}
                  for role, tensors in plan[e].items()} for e in wanted}
    wide: tuple[Mapping[str, Mapping[str, torch.Tensor]], ...] = ()
    if ids is not None:  # every expert's layer-wide scalars; an owned expert's are already loaded
        wide = tuple({role: {t: (loaded[e][role][t] if e in loaded else
                                 _load_checked(index, full, declared[t], scheme.scheme))
                             for t, full in tensors.items() if t in LAYER_WIDE}
                      for role, tensors in plan[e].items()} for e in range(shape.num_experts))
    parts, parts_wide = _read_stacked(index, stacked, scheme, shape, values_b, ids) if stacked else ({}, {})
    tensors_out = _with_router(index, names, shape, tuple(loaded[e] for e in wanted), bias_flags == {True})
    return replace(tensors_out, expert_ids=ids, layer_wide=wide, stacked=parts, stacked_wide=parts_wide)


def _no_tensors(shape: MoEShape, ids: tuple[int, ...] | None) -> tuple[Mapping[str, Mapping[str, torch.Tensor]], ...]:
    """One empty entry per expert read: a layer whose expert tensors are all stacked (``LayerTensors.stacked``)."""
    return tuple({role: {} for role in ROLES} for _ in range(shape.num_experts if ids is None else len(ids)))


def _stacked_names(index: CheckpointIndex, names: LayerNames, scheme: SchemeSpec) -> dict[str, str] | None:
    """Declared tensor -> full stacked name (with {part}) when this layer holds any of them stacked over
    experts under its experts module (``TensorSpec.stacked``), else None: the layer is read per expert."""
    assert names.expert_prefix is not None
    container = names.expert_prefix.removesuffix(".{expert}")
    if container == names.expert_prefix:
        return None  # the family's experts have no module of their own to hold a stacked tensor
    full = {t: f"{container}.{spec.stacked.name}" for t, spec in scheme.checkpoint.tensors.items()
            if spec.stacked is not None}
    held = any(name.format(part=part) in index.tensors for name in full.values() for part in ("gate_up", "down"))
    return full if held else None


def _read_stacked(index: CheckpointIndex, stacked: Mapping[str, str], scheme: SchemeSpec, shape: MoEShape,
                  values_b: Mapping[str, int], ids: tuple[int, ...] | None
                  ) -> tuple[dict[tuple[str, str], StackedTensor], dict[tuple[str, str], StackedTensor]]:
    """The tensors stacked over experts (shapes checked), sliced to ``ids``: down's as stored, gate_up's with gate
    and up along its first dimension that grows with out (halves), or shared when none does; and, for a subset,
    the whole :data:`LAYER_WIDE` ones. Read whole even for an expert-parallel rank: scales, a few bytes per
    expert."""
    e, i, h = shape.num_experts, shape.intermediate, shape.hidden
    out: dict[tuple[str, str], StackedTensor] = {}
    wide: dict[tuple[str, str], StackedTensor] = {}
    for tname, template in stacked.items():
        tspec = scheme.checkpoint.tensors[tname]
        assert tspec.stacked is not None
        dims = tspec.stacked.shape if tspec.stacked.shape is not None else tspec.shape
        for part, size in (("gate_up", {"in": h, "out": 2 * i}), ("down", {"in": i, "out": h})):
            full = template.format(part=part)
            if full not in index.tensors:
                if tspec.optional:
                    continue
                raise CheckpointError(f"{full}: missing (scheme {scheme.scheme} needs "
                                      f"{', '.join(sorted(scheme.checkpoint.tensors))}; this layer holds "
                                      f"{', '.join(sorted(stacked))} stacked over its experts)")
            t = _load_stacked(index, full, tspec, dims, e, {**size, **values_b}, scheme.scheme)
            mine = t if ids is None else t[list(ids)]
            if part == "down":
                out[(part, tname)] = StackedTensor(mine, part, split_dim=None)
                if ids is not None and tname in LAYER_WIDE:
                    wide[(part, tname)] = StackedTensor(t, part, split_dim=None)
                continue
            try:  # one projection's slice (gate's or up's): out is the intermediate size
                one = [parse_expr(str(d)).evaluate({"in": h, "out": i, **values_b}) for d in dims]
            except ExprError as err:
                raise CheckpointError(f"{full}: gate's share of its shape {dims} cannot be computed for "
                                      f"intermediate size {i}: {err}") from None
            both = list(t.shape[1:])
            dim = next((d for d, (a, b) in enumerate(zip(one, both, strict=True)) if a != b), None)
            if dim is not None and both[dim] != 2 * one[dim]:
                raise CheckpointError(f"{full}: shape {list(t.shape)}, {both[dim]} along dim {dim + 1} for gate and "
                                      f"up together; wanted 2 x {one[dim]} there (gate's, then up's; intermediate "
                                      f"size {i})")
            # dim None: one slice for all of gate_up (a per-tensor scale), which gate and up share
            out[(part, tname)] = StackedTensor(mine, part, split_dim=dim)
            if ids is not None and tname in LAYER_WIDE:
                wide[(part, tname)] = StackedTensor(t, part, split_dim=dim)
    return out, wide


def _expert_ids(experts: Sequence[int] | None, num_experts: int) -> tuple[int, ...] | None:
    """The experts to read as a tuple of distinct ids in [0, num_experts) (None: all)."""
    if experts is None:
        return None
    ids = tuple(int(e) for e in experts)
    bad = [e for e in ids if not 0 <= e < num_experts]
    if bad or len(set(ids)) != len(ids):
        raise CheckpointError(f"experts to read {list(ids)}: wanted distinct ids in [0, {num_experts}) "
                              f"({num_experts} experts in config.json)")
    return ids


def _load_stacked(index: CheckpointIndex, full: str, tspec: TensorSpec, dims: Sequence[int | str], num_experts: int,
                  values: Mapping[str, int], scheme: str, ids: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor stacked over experts, [E, *dims] (one expert's ``dims`` evaluated with ``values``), its
    header checked against that before anything is read; with ``ids`` only their slices."""
    stacked = TensorSpec(dtype=tspec.dtype, shape=[num_experts, *dims], optional=False, all_equal=None, stacked=None)
    _check_tensor(full, index.tensors[full], stacked, values)
    return _load_checked(index, full, tspec, scheme, ids)


def _load_checked(index: CheckpointIndex, full: str, spec: TensorSpec, scheme: str,
                  ids: tuple[int, ...] | None = None) -> torch.Tensor:
    """Load one tensor (of a stacked one, only the slices of ``ids``); one whose value the scheme fixes
    (``all_equal``) must hold it everywhere."""
    t = index.load(full) if ids is None else index.load_experts(full, ids)
    if spec.all_equal is not None:
        check_all_equal(t, spec.all_equal, full, f"scheme {scheme} fixes this tensor")
    return t


def _with_router(index: CheckpointIndex, names: LayerNames, shape: MoEShape,
                 experts: tuple[Mapping[str, Mapping[str, torch.Tensor]], ...], has_bias: bool) -> LayerTensors:
    """The layer's tensors with its router weight, router bias and correction bias, shapes checked."""
    router = index.load(names.router) if names.router in index.tensors else None
    if router is not None and tuple(router.shape) != (shape.num_experts, shape.hidden):
        raise CheckpointError(f"{names.router}: shape {list(router.shape)}; expected "
                              f"[{shape.num_experts}, {shape.hidden}] (num_experts x hidden_size from config.json)")
    return LayerTensors(experts, router, _per_expert(index, names.correction_bias, shape), names, has_bias,
                        _per_expert(index, names.router_bias, shape))


def _per_expert(index: CheckpointIndex, name: str | None, shape: MoEShape) -> torch.Tensor | None:
    """A per-expert vector (router bias, correction bias) as [E]; stored [E] or [1, E] (ERNIE 4.5)."""
    if not name or name not in index.tensors:
        return None
    info = index.tensors[name]
    if math.prod(info.shape) != shape.num_experts or len(info.shape) < 1:
        raise CheckpointError(f"{name}: shape {list(info.shape)}; expected [{shape.num_experts}] "
                              "(one value per expert, num_experts from config.json)")
    return index.load(name).reshape(shape.num_experts)


def _read_fused(index: CheckpointIndex, names: LayerNames, layer: int, scheme: SchemeSpec, shape: MoEShape,
                ids: tuple[int, ...] | None = None) -> tuple[dict[tuple[str, str], StackedTensor], bool]:
    """A fused family's stacked tensors as stored, with their layouts, shapes and dtypes checked first (of
    every expert, or of ``ids`` alone: only their slices are read), and whether they carry biases.

    The fused tensors are the scheme's one ``weight`` tensor for every expert at once, so only
    schemes that declare exactly that per projection are read this way. With several declared
    layouts, the first that every tensor's shape fits is used."""
    assert names.fused is not None
    fused = names.fused
    parts = fused.parts
    declared = scheme.checkpoint.tensors
    if set(declared) != {"weight"}:
        raise CheckpointError(f"{fused.of(parts[0])}: layer {layer} stores its experts fused as stacked tensors; "
                              f"scheme {scheme.scheme} declares per-expert tensors {', '.join(sorted(declared))} "
                              "(fused experts are read for schemes with one 'weight' tensor per projection)")
    spec = declared["weight"]
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    gate_up = {"in": h, "out": 2 * i}
    one = {"in": h, "out": i}
    dims = {"gate_up": gate_up, "gate": one, "up": one, "down": {"in": i, "out": h}}
    why = {"gate_up": {"in": "hidden", "out": f"2 x intermediate {i}"}, "gate": {"in": "hidden", "out": "intermediate"},
           "up": {"in": "hidden", "out": "intermediate"}, "down": {"in": "intermediate", "out": "hidden"}}
    infos = {}
    for what in parts:
        name = fused.of(what)
        assert name is not None
        if name not in index.tensors:
            near = sorted(t for t in index.tensors if t.startswith(name.rsplit(".", 1)[0] + "."))
            seen = ", ".join(near[:3]) + (f" and {len(near) - 3} more" if len(near) > 3 else "")
            raise CheckpointError(f"{name}: missing (naming.fused.{what}; beside it: {seen or 'nothing'}; "
                                  f"is layer {layer} a MoE layer stored fused?)")
        infos[what] = index.tensors[name]
        if infos[what].dtype not in spec.dtypes:
            raise CheckpointError(f"{name}: dtype {infos[what].dtype}; expected {' or '.join(spec.dtypes)}")

    def order(what: str, layout: tuple[str, ...]) -> tuple[str, ...]:
        return fused.down_layout if what == "down" and fused.down_layout is not None else layout

    def size(what: str, d: str) -> int:
        return e * dims[what][d[2:]] if d.startswith("E*") else e if d == "E" else dims[what][d]

    def wanted(what: str, layout: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(size(what, d) for d in order(what, layout))

    def meaning(what: str, d: str) -> str:
        if d.startswith("E*"):
            return f"experts {e} x {why[what][d[2:]]} {dims[what][d[2:]]}"
        return "experts" if d == "E" else why[what][d]

    layout = next((lay for lay in fused.layouts if all(infos[w].shape == wanted(w, lay) for w in parts)), None)
    if layout is None:
        what = next(w for w in parts if infos[w].shape != wanted(w, fused.layouts[0]))
        options = " or ".join(
            f"{list(wanted(what, lay))} ([{', '.join(order(what, lay))}] with "
            f"{', '.join(f'{d}={size(what, d)} ({meaning(what, d)})' for d in order(what, lay))})"
            for lay in dict.fromkeys(order(what, lay) for lay in fused.layouts))
        raise CheckpointError(f"{fused.of(what)}: shape {list(infos[what].shape)}; expected {options}, "
                              f"from config.json and naming.fused.{'down_layout' if order(what, ()) else 'layout'}")
    def rows(what: str, first: str) -> int:  # rows per expert along dim 0: 1 for [E, ...], n for a 2-D [E*n, ...]
        return dims[what][first[2:]] if first.startswith("E*") else 1

    loaded = {what: index.load_experts(fused.of(what), ids, rows(what, order(what, layout)[0]))  # type: ignore[arg-type]
              for what in parts}
    for what in ("gate_up", "down"):
        bias_name = fused.of(f"{what}_bias")
        if bias_name and bias_name in index.tensors:
            binfo = index.tensors[bias_name]
            if binfo.dtype not in BIAS_SPEC.dtypes:
                raise CheckpointError(f"{bias_name}: dtype {binfo.dtype}; expected {' or '.join(BIAS_SPEC.dtypes)}")
            if binfo.shape != (e, dims[what]["out"]):
                raise CheckpointError(f"{bias_name}: shape {list(binfo.shape)}; expected [{e}, {dims[what]['out']}] "
                                      f"([E, out] with E={e}, out={dims[what]['out']})")
            loaded[f"{what}_bias"] = index.load_experts(bias_name, ids)
    if ("gate_up_bias" in loaded) != ("down_bias" in loaded):
        have, lack = ("gate_up_bias", "down_bias") if "gate_up_bias" in loaded else ("down_bias", "gate_up_bias")
        raise CheckpointError(f"{fused.of(lack) or 'naming.fused.' + lack}: missing while {fused.of(have)} exists; "
                              "expected a bias on both fused projections or on neither")
    split = {"gate_up": 0}
    parts_out = {(what, "weight"): StackedTensor(loaded[what], what, order(what, layout), split.get(what),
                                                 fused.gate_up_order) for what in parts}
    if "gate_up_bias" in loaded:
        parts_out[("gate_up", "bias")] = StackedTensor(loaded["gate_up_bias"], "gate_up", None, 0, fused.gate_up_order)
        parts_out[("down", "bias")] = StackedTensor(loaded["down_bias"], "down", None, None)
    return parts_out, "gate_up_bias" in loaded


def _read_fused_stacked(index: CheckpointIndex, names: LayerNames, layer: int, scheme: SchemeSpec, shape: MoEShape,
                        bindings: Mapping[str, Any], ids: tuple[int, ...] | None = None
                        ) -> tuple[dict[tuple[str, str], StackedTensor], bool, dict[tuple[str, str], StackedTensor]]:
    """The tensors of a fused family whose scheme stores every declared tensor stacked over experts
    (``checkpoint.fused_names``): ``<fused name><template>`` is [E, *shape] with out first, gate and up along
    its out dim in the family's gate_up_order; biases as :func:`_read_fused`. With ``ids``, only their slices are
    read, and every expert's :data:`LAYER_WIDE` tensors whole (third value)."""
    assert names.fused is not None and names.fused.tensor_names is not None
    fused = names.fused
    if fused.gate_up is None:
        raise CheckpointError(f"{fused.down}: scheme {scheme.scheme} reads stacked tensors (checkpoint.fused_names) "
                              "of a family with one gate_up tensor; this family names gate and up apart")
    e, i = shape.num_experts, shape.intermediate
    values_b = {f"${k}": v for k, v in bindings.items() if isinstance(v, int) and not isinstance(v, bool)}
    dims = {"gate_up": {"in": shape.hidden, "out": 2 * i}, "down": {"in": i, "out": shape.hidden}}
    loaded: dict[tuple[str, str], torch.Tensor] = {}
    wide: dict[tuple[str, str], torch.Tensor] = {}
    for what in ("gate_up", "down"):
        for tname, tspec in scheme.checkpoint.tensors.items():
            full = f"{fused.of(what)}{fused.tensor_names.format(tensor=tname)}"
            if full not in index.tensors:
                if tspec.optional:
                    continue
                raise CheckpointError(f"{full}: missing (scheme {scheme.scheme} stores "
                                      f"{', '.join(sorted(scheme.checkpoint.tensors))} stacked over experts)")
            whole = ids is None or tname in LAYER_WIDE
            t = _load_stacked(index, full, tspec, tspec.shape, e, {**dims[what], **values_b}, scheme.scheme,
                              None if whole else ids)
            loaded[(what, tname)] = t if ids is None or not whole else t[list(ids)]
            if ids is not None and tname in LAYER_WIDE:
                wide[(what, tname)] = t
    biases = {}
    for what in ("gate_up", "down"):
        bias_name = fused.of(f"{what}_bias")
        if bias_name and bias_name in index.tensors:
            binfo = index.tensors[bias_name]
            _check_tensor(bias_name, binfo, TensorSpec(dtype=BIAS_SPEC.dtype, shape=[e, "out"], optional=False,
                                                       all_equal=None, stacked=None), dims[what])
            biases[what] = index.load_experts(bias_name, ids)
    if len(biases) == 1:
        have, lack = ("gate_up", "down") if "gate_up" in biases else ("down", "gate_up")
        raise CheckpointError(f"{fused.of(lack + '_bias') or 'naming.fused.' + lack + '_bias'}: missing while "
                              f"{fused.of(have + '_bias')} exists; expected a bias on both fused projections "
                              "or on neither")
    order = fused.gate_up_order

    def part(what: str, t: torch.Tensor) -> StackedTensor:
        return StackedTensor(t, what, None, 0 if what == "gate_up" else None, order)

    out = {key: part(key[0], t) for key, t in loaded.items()}
    out.update({(what, "bias"): part(what, t) for what, t in biases.items()})
    return out, bool(biases), {key: part(key[0], t) for key, t in wide.items()}
