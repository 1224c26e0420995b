"""Tensors stored stacked over experts, as one [out, in] tensor per expert and projection: the first layout
change of a fused or stacked checkpoint. The reader (``checkpoint.read``) checks their shapes and records how
each is laid out (:class:`~moe_registry.checkpoint.read.StackedTensor`); here they are put in the nk order of one
projection ([E, out, in]), gate and up are taken apart as the family orders them, and each expert gets its
slice beside the tensors it stores on its own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moe_registry.checkpoint.read import LayerTensors, StackedTensor
from moe_registry.core.vocab import ROLES

ExpertTensorMap = dict[str, dict[str, torch.Tensor]]
"""One expert's tensors: role (gate, up, down) -> tensor name -> tensor."""


def to_nk(t: torch.Tensor, layout: tuple[str, ...] | None, e: int) -> torch.Tensor:
    """A stacked tensor in ``layout`` (shape already checked; None: already [E, out, ...]) as [E, out, in]."""
    if layout is None:
        return t
    if layout[0].startswith("E*"):  # 2-D: expert e is rows [e*n, (e+1)*n)
        t = t.reshape(e, t.shape[0] // e, t.shape[1])
        layout = ("E", layout[0][2:], layout[1])
    return t.transpose(1, 2) if layout == ("E", "in", "out") else t


def split_gate_up(t: torch.Tensor, dim: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up along ``dim`` of a stacked [E, ...] tensor, as the family orders them: even and odd
    positions (``interleaved``) or halves."""
    index: list[slice] = [slice(None)] * t.dim()
    if order == "interleaved":
        index[dim] = slice(0, None, 2)
        gate = t[tuple(index)]
        index[dim] = slice(1, None, 2)
        return gate, t[tuple(index)]
    half = t.shape[dim] // 2
    return t.narrow(dim, 0, half), t.narrow(dim, half, half)


def per_role(stacked: Mapping[tuple[str, str], StackedTensor], e: int) -> dict[str, dict[str, torch.Tensor]]:
    """role -> tensor name -> [E, out, ...] for ``e`` experts: each stacked tensor in nk order, a gate_up part
    taken apart into gate and up (or given to both, when they share one value)."""
    out: dict[str, dict[str, torch.Tensor]] = {role: {} for role in ROLES}
    for (part, name), st in stacked.items():
        t = to_nk(st.tensor, st.layout, e)
        if part != "gate_up":
            out[part][name] = t
        elif st.split_dim is None:
            out["gate"][name] = out["up"][name] = t
        else:
            out["gate"][name], out["up"][name] = split_gate_up(t, st.split_dim + 1, st.order)
    return out


def _merged(own: Sequence[Mapping[str, Mapping[str, torch.Tensor]]], stacked: Mapping[tuple[str, str], StackedTensor],
            e: int) -> list[ExpertTensorMap]:
    roles = per_role(stacked, e) if stacked else {}
    return [{role: {**own[x].get(role, {}), **{n: v[x] for n, v in roles.get(role, {}).items()}} for role in ROLES}
            for x in range(e)]


def experts_of(tensors: LayerTensors) -> list[ExpertTensorMap]:
    """Every expert read (``tensors.expert_ids`` order), role -> tensor name -> tensor: the tensors it stores on
    its own and its slice of the stacked ones."""
    return _merged(tensors.experts, tensors.stacked, len(tensors.experts))


def layer_wide_of(tensors: LayerTensors) -> list[ExpertTensorMap]:
    """Every expert's layer-wide tensors (read for an expert-parallel rank; empty otherwise), in the same form."""
    n = len(tensors.layer_wide) or next((int(st.tensor.shape[0]) for st in tensors.stacked_wide.values()), 0)
    return _merged(tensors.layer_wide or [{}] * n, tensors.stacked_wide, n)
