"""From per-expert, per-role projections to :class:`ExpertWeights` in layout ``nk``: gate and up
fused into w13 (gate rows first), every projection stacked over experts. Formats only say how one
projection of one expert converts; fusion, stacking, biases and the consistency checks that span
experts or roles live here once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moe_registry.core.errors import CheckpointError, MoERegistryError
from moe_registry.core.keys import PER_CHANNEL, PER_TENSOR, QuantKey
from moe_registry.core.vocab import ROLES
from moe_registry.formats.checks import check_finite, check_scales, require
from moe_registry.formats.registry import ONE_PROJECTION, ConvertContext, ExpertTensors
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights

__all__ = ["ProjectionPart", "RoleConverter", "assemble", "Namer", "layout_scale_dtype", "group_size",
           "scaled_projection"]

Namer = Callable[[str], str]
"""tensor short name ('qweight') -> full checkpoint name, for one expert's one projection."""


@dataclass(frozen=True)
class ProjectionPart:
    """One expert's gate, up or down projection in the ``nk`` layout, without the expert dimension.

    ``perm`` (int64 [K]) is the act-order permutation; ``perm_tensor`` names the checkpoint tensor
    it came from, so a disagreement between gate and up can be reported. ``input_scale`` is a
    float32 scalar (static activation scale).
    """

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    perm_tensor: str | None = None
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    scale2: torch.Tensor | None = None  # second-level (global) weight scale, float32 [out, 1] (NVFP4)


_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                 "e8m0": torch.uint8, "fp8e4m3": torch.float8_e4m3fn}


def layout_scale_dtype(key: QuantKey) -> torch.dtype:
    """The dtype ``nk`` stores a weight scale in: float32 for per-channel/per-tensor (stored
    expanded [N, 1], exact), raw uint8 exponents for e8m0, else the key's scale dtype."""
    if key.scale is None:
        raise MoERegistryError(f"weight key {key} has no scale; a quantized format needs one")
    if key.scale.group in (PER_CHANNEL, PER_TENSOR):
        return torch.float32
    try:
        return _SCALE_DTYPES[key.scale.dtype.name]
    except KeyError:
        raise MoERegistryError(f"no nk storage for scale dtype {key.scale.dtype.name} in key {key}") from None


def group_size(key: QuantKey, k: int) -> int:
    """Input columns per scale group for a projection with ``k`` inputs (-1 in the key: all)."""
    g = key.group_size
    return k if g is None or g <= 0 else g


def scaled_projection(tensors: Mapping[str, torch.Tensor], name: Namer, ctx: ConvertContext) -> ProjectionPart:
    """``weight`` with one ``weight_scale`` per tensor or per output channel (float32 [out, 1]) and, for a
    static activation key, its one ``input_scale`` (Quark INT8, AutoFP8 / ModelOpt / compressed-tensors FP8)."""
    weight = require(tensors, "weight", name("weight"))
    ws = require(tensors, "weight_scale", name("weight_scale"))
    check_scales(ws, name("weight_scale"))
    n = int(weight.shape[0])
    if ws.numel() == 1:
        scale = ws.to(torch.float32).reshape(1, 1).expand(n, 1).clone()
    elif ws.numel() == n:
        scale = ws.to(torch.float32).reshape(n, 1)
    else:
        raise CheckpointError(
            f"{name('weight_scale')}: shape {list(ws.shape)} is neither per-tensor ([] or [1]) nor "
            f"per-channel ([{n}] or [{n}, 1]) for {name('weight')} of shape {list(weight.shape)}"
        )
    act = ctx.activation_key.scale
    input_scale = None
    if act is not None and not act.dynamic:
        s = require(tensors, "input_scale", name("input_scale"))
        check_scales(s, name("input_scale"))
        if s.numel() != 1:
            raise CheckpointError(
                f"{name('input_scale')}: shape {list(s.shape)}; expected one per-tensor scale ([] or [1])"
            )
        input_scale = s.to(torch.float32).reshape(())
    return ProjectionPart(weight=weight, scale=scale, input_scale=input_scale)


RoleConverter = Callable[[Mapping[str, torch.Tensor], Namer, ConvertContext], ProjectionPart]
"""Converts one projection's tensors (checked values, new tensors out); bias is handled here."""


def assemble(experts: Sequence[ExpertTensors], ctx: ConvertContext, convert_role: RoleConverter) -> ExpertWeights:
    """Run ``convert_role`` on every (expert, role of ``ctx.roles``) and build the fused, stacked weights (one
    projection: w13 is w2)."""
    if len(experts) == 0:
        raise CheckpointError("no experts to convert: the checkpoint layer has zero expert tensors")
    if ctx.roles not in (ROLES, ONE_PROJECTION):
        raise MoERegistryError(f"roles {ctx.roles}: a conversion makes every role {ROLES} or one projection "
                               f"{ONE_PROJECTION}")
    fused = ctx.roles == ROLES
    if fused:
        _check_bias_presence(experts, ctx, ("gate", "up"))
    _check_bias_presence(experts, ctx, ("down",))
    w13: list[_Rows] = []
    w2: list[_Rows] = []
    for e, tensors in enumerate(experts):
        parts = {role: _convert_one(tensors, e, role, ctx, convert_role) for role in ctx.roles}
        if fused:
            w13.append(_fuse(parts["gate"], parts["up"], _namer(ctx, e, "gate"), _namer(ctx, e, "up")))
        w2.append(_Rows.of(parts["down"]))
    down = _stack(w2)
    return ExpertWeights(_stack(w13) if fused else down, down, ctx.weight_key, ctx.activation_key, "nk")


def _namer(ctx: ConvertContext, expert: int, role: str) -> Namer:
    return lambda tensor: ctx.tensor_name(expert, role, tensor)


def _convert_one(tensors: ExpertTensors, e: int, role: str, ctx: ConvertContext,
                 convert_role: RoleConverter) -> ProjectionPart:
    name = _namer(ctx, e, role)
    if role not in tensors:
        raise CheckpointError(
            f"expert {e} has no {role} projection (no {name('*')} tensors); "
            f"expected roles {', '.join(ROLES)}, found {', '.join(sorted(tensors)) or 'none'}"
        )
    role_tensors = tensors[role]
    part = convert_role(role_tensors, name, ctx)
    if "bias" not in role_tensors:
        return part
    bias = role_tensors["bias"]
    check_finite(bias, name("bias"))
    return dataclasses.replace(part, bias=bias.to(torch.float32).reshape(-1))


def _check_bias_presence(experts: Sequence[ExpertTensors], ctx: ConvertContext, roles: tuple[str, ...]) -> None:
    """A fused, stacked projection has a bias everywhere or nowhere; half a bias is a broken file."""
    have = [(e, r) for e, t in enumerate(experts) for r in roles if "bias" in t.get(r, {})]
    if not have or len(have) == len(experts) * len(roles):
        return
    missing = next((e, r) for e, t in enumerate(experts) for r in roles if "bias" not in t.get(r, {}))
    raise CheckpointError(
        f"missing checkpoint tensor {ctx.tensor_name(*missing, 'bias')} while "
        f"{ctx.tensor_name(*have[0], 'bias')} exists; expected a bias on every "
        f"{'/'.join(roles)} projection of every expert, or on none"
    )


ROW_FIELDS = ("weight", "scale", "zero", "bias", "scale2")  # the fields w13 fuses and every projection stacks


@dataclass(frozen=True)
class _Rows:
    """One expert's projection as its stacked weights will hold it: each of :data:`ROW_FIELDS` as the tensors its
    rows concatenate (gate's then up's for w13; None where a part has none), so that fusing and stacking copy
    each byte once."""

    fields: dict[str, tuple[torch.Tensor, ...] | None]
    perm: torch.Tensor | None
    input_scale: torch.Tensor | None

    @classmethod
    def of(cls, part: ProjectionPart) -> _Rows:
        """A projection that is stacked alone (w2)."""
        fields = {f: None if getattr(part, f) is None else (getattr(part, f),) for f in ROW_FIELDS}
        return cls(fields, part.perm, part.input_scale)


def _fuse(gate: ProjectionPart, up: ProjectionPart, gate_name: Namer, up_name: Namer) -> _Rows:
    """w13 = gate rows then up rows. Gate and up read the same input, so act-order must agree."""
    perm = gate.perm
    if gate.perm is not None or up.perm is not None:
        known = gate.perm if gate.perm is not None else up.perm
        assert known is not None
        g = gate.perm if gate.perm is not None else torch.arange(known.numel(), device=known.device)
        u = up.perm if up.perm is not None else torch.arange(known.numel(), device=known.device)
        if not torch.equal(g, u):
            j = int((g != u).nonzero()[0, 0])
            gate_src = gate_name(gate.perm_tensor or up.perm_tensor or "perm")
            up_src = up_name(up.perm_tensor or gate.perm_tensor or "perm")
            raise CheckpointError(
                f"{up_src} orders the input columns differently from {gate_src} (first difference at "
                f"sorted position {j}: up takes column {int(u[j])}, gate column {int(g[j])}); gate and up "
                "share their input, so they must have the same act-order permutation"
            )
        perm = g
    scales = [s for s in (gate.input_scale, up.input_scale) if s is not None]
    fields = {f: None if getattr(gate, f) is None or getattr(up, f) is None else (getattr(gate, f), getattr(up, f))
              for f in ROW_FIELDS}
    return _Rows(fields, perm, torch.stack(scales).max() if scales else None)


def _stack_rows(pieces: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """[experts, rows, ...]: expert e's rows the concatenation of ``pieces[e]`` along dim 0, written into one
    tensor (torch.stack of torch.cat copies every byte twice, the larger part of loading a 16-bit layer).
    Pieces that torch.stack would not take as they are (shapes or dtypes differing) go through it anyway, for
    its promotion or its error."""
    first = pieces[0]
    like = first[0]
    if not all(t.dim() >= 1 and t.dtype == like.dtype and t.shape[1:] == like.shape[1:] for t in first) or any(
            len(p) != len(first) or any(t.dtype != f.dtype or t.shape != f.shape for t, f in zip(p, first, strict=True))
            for p in pieces):
        return torch.stack([torch.cat(p, dim=0) if len(p) > 1 else p[0] for p in pieces])
    out = torch.empty((len(pieces), sum(t.shape[0] for t in first), *like.shape[1:]), dtype=like.dtype,
                      device=like.device)
    for e, p in enumerate(pieces):
        row = 0
        for t in p:
            out[e, row:row + t.shape[0]].copy_(t)
            row += t.shape[0]
    return out


def _stack(parts: list[_Rows]) -> ProjectionWeights:
    """Stack over experts; experts without act-order get the identity permutation."""

    def stacked(field: str) -> torch.Tensor | None:
        values = [p.fields[field] for p in parts]
        return None if any(v is None for v in values) else _stack_rows(values)  # type: ignore[arg-type]

    perm = None
    if any(p.perm is not None for p in parts):
        known = next(p.perm for p in parts if p.perm is not None)
        perm = torch.stack([torch.arange(known.numel(), device=known.device) if p.perm is None else p.perm
                            for p in parts]).to(torch.int32)
    scales = [p.input_scale for p in parts if p.input_scale is not None]
    input_scale = torch.stack(scales).max().reshape(1).to(torch.float32) if scales else None
    weight = stacked("weight")
    assert weight is not None  # every converted part has a weight
    return ProjectionWeights(
        weight=weight,
        scale=stacked("scale"),
        zero=stacked("zero"),
        perm=perm,
        bias=stacked("bias"),
        input_scale=input_scale,
        scale2=stacked("scale2"),
    )
