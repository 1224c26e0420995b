"""The modular kernel: a PrepareFinalize (dispatch before the GEMMs, combine after) around an
Experts (the GEMMs). Splitting them lets a local, batched or all2all dispatch run any experts
implementation of the matching activation format.

Formats: ``standard`` hands the experts hidden [M, H] with the routing; ``batched`` hands them
[E, T, H] with ``expert_num_tokens`` [E] (the first n rows of each expert's slab are real), which
is what an all2all dispatch naturally produces. An all2all over torch.distributed implements the
same two methods: ``prepare`` sends rows to their experts' ranks and ``finalize`` sends them back.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from moe_registry.layer.experts import ActivationFormat, Experts

__all__ = [
    "DispatchRecord",
    "PreparedInput",
    "BatchedDispatch",
    "group_by_expert",
    "combine_batched",
    "PrepareFinalize",
    "LocalPrepareFinalize",
    "BatchedLocalPrepareFinalize",
    "FusedMoEKernel",
]

_HIDDEN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class DispatchRecord:
    """What a PrepareFinalize's ``prepare`` leaves for its ``finalize``: each one subclasses it with what it needs
    (so this module names no dispatcher's record, and dispatchers elsewhere add theirs)."""


@dataclass(frozen=True)
class BatchedDispatch(DispatchRecord):
    """Where each (token, slot) pair went, in dispatch order (sorted by expert, stable): it came
    from row ``token`` and sits at ``[expert, position]`` of the batched slab; ``weight`` is its
    router weight, already applied on the input when ``weight_applied``."""

    token: torch.Tensor  # int64 [M*k]
    expert: torch.Tensor  # int64 [M*k]
    position: torch.Tensor  # int64 [M*k]
    weight: torch.Tensor  # float32 [M*k]
    weight_applied: bool
    num_tokens: int
    local: torch.Tensor | None = None  # bool [M*k]: False for a pair another rank's experts compute (then unused)


def group_by_expert(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                    rows_per_expert: int, apply_router_weight_on_input: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      BatchedDispatch]:
    """Rows grouped per expert into a zeroed slab [E, T, H], their counts [E] and where each pair went. A pair
    whose id is outside [0, E) (an expert of another rank) is counted nowhere and written to a spare row past
    the slab, so nothing is read on the host; a pair past T is the caller's to refuse."""
    m, top_k = topk_ids.shape
    e, t = num_experts, rows_per_expert
    flat = topk_ids.reshape(-1).to(torch.int64)
    local = (flat >= 0) & (flat < e)
    key = torch.where(local, flat, e)  # foreign pairs sort last, into bin e
    order = torch.argsort(key, stable=True)
    expert = key[order]
    # scatter_add, not bincount: CUDA's bincount reads the largest id on the host, which a CUDA graph cannot hold
    counts = torch.zeros(e + 1, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))[:e]
    offsets = torch.cumsum(counts, 0) - counts
    here = local[order]
    expert = torch.where(here, expert, 0)
    position = torch.where(here, torch.arange(flat.numel(), device=flat.device) - offsets[expert], 0)
    token = order // top_k
    weight = topk_weights.reshape(-1)[order].to(torch.float32)
    rows = hidden[token]
    if apply_router_weight_on_input:
        rows = (rows.float() * weight[:, None]).to(hidden.dtype)
    slab = hidden.new_zeros(e * t + 1, hidden.shape[1])
    slab[torch.where(here & (position < t), expert * t + position, e * t)] = rows
    dispatch = BatchedDispatch(token, expert, position, weight, apply_router_weight_on_input, m, here)
    return slab[:e * t].view(e, t, hidden.shape[1]), counts, dispatch


def combine_batched(expert_output: torch.Tensor, d: BatchedDispatch) -> torch.Tensor:
    """Each token's sum over its pairs of the experts' rows [E, T, H], router weights applied, in float32
    [num_tokens, H]; pairs computed elsewhere (``d.local`` False) add nothing."""
    y = expert_output[d.expert, d.position].float()
    if not d.weight_applied:
        y = y * d.weight[:, None]
    if d.local is not None:
        y = torch.where(d.local[:, None], y, 0.0)
    out = torch.zeros(d.num_tokens, expert_output.shape[-1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, d.token, y)


@dataclass(frozen=True)
class PreparedInput:
    """What the experts are called with. Standard: ``hidden`` [M, H] and the routing as given.
    Batched: ``hidden`` [E, T, H], ``expert_num_tokens`` int32 [E] and the ``dispatch`` record
    finalize needs to combine."""

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation_format: ActivationFormat
    expert_num_tokens: torch.Tensor | None = None
    dispatch: DispatchRecord | None = None


class PrepareFinalize(abc.ABC):
    """Dispatch and combine around the experts; ``activation_format`` is what prepare produces."""

    activation_format: ClassVar[ActivationFormat]

    @abc.abstractmethod
    def prepare(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                apply_router_weight_on_input: bool = False) -> PreparedInput:
        """Turn [M, H] hidden states and routing into the experts' input. Must not mutate inputs."""

    @abc.abstractmethod
    def finalize(self, expert_output: torch.Tensor, prepared: PreparedInput) -> torch.Tensor:
        """Turn the experts' output back into [M, H] in the hidden dtype."""

    def num_global_experts(self, local_experts: int) -> int:
        """The expert ids routing may name when the experts hold ``local_experts``: the same number in
        one process; a dispatcher over ranks returns every rank's total (and refuses a wrong share)."""
        return local_experts


class LocalPrepareFinalize(PrepareFinalize):
    """Standard format on one device: nothing to move, the experts weight and sum top-k."""

    activation_format: ClassVar[ActivationFormat] = "standard"

    def prepare(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                apply_router_weight_on_input: bool = False) -> PreparedInput:
        return PreparedInput(hidden, topk_weights, topk_ids, "standard")

    def finalize(self, expert_output: torch.Tensor, prepared: PreparedInput) -> torch.Tensor:
        return expert_output


class BatchedLocalPrepareFinalize(PrepareFinalize):
    """Batched format on one device: rows grouped per expert into [E, T, H], combined back with
    the router weights in float32.

    T is ``max_tokens_per_expert`` if given (a fixed shape, as CUDA graphs want; overflow raises,
    which reads counts on the host), else M, enough when no row repeats an expert.
    """

    activation_format: ClassVar[ActivationFormat] = "batched"

    def __init__(self, num_experts: int, max_tokens_per_expert: int | None = None) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        if max_tokens_per_expert is not None and max_tokens_per_expert < 1:
            raise ValueError(f"max_tokens_per_expert must be positive, got {max_tokens_per_expert}")
        self.num_experts = num_experts
        self.max_tokens_per_expert = max_tokens_per_expert

    def prepare(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                apply_router_weight_on_input: bool = False) -> PreparedInput:
        m, top_k = topk_ids.shape
        if apply_router_weight_on_input and top_k != 1:
            raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got top_k = {top_k}")
        t = self.max_tokens_per_expert if self.max_tokens_per_expert is not None else max(m, 1)
        slab, counts, dispatch = group_by_expert(hidden, topk_weights, topk_ids, self.num_experts, t,
                                                 apply_router_weight_on_input)
        if self.max_tokens_per_expert is not None and topk_ids.numel():
            most = int(counts.max())
            if most > t:
                raise ValueError(f"an expert received {most} tokens, more than max_tokens_per_expert = {t}")
        return PreparedInput(slab, topk_weights, topk_ids, "batched", counts.to(torch.int32), dispatch)

    def finalize(self, expert_output: torch.Tensor, prepared: PreparedInput) -> torch.Tensor:
        d = prepared.dispatch
        if not isinstance(d, BatchedDispatch):
            raise ValueError("finalize got a PreparedInput without a batched dispatch record")
        return combine_batched(expert_output, d).to(expert_output.dtype)


class FusedMoEKernel(torch.nn.Module):
    """prepare -> experts -> finalize. ``validate`` checks inputs first with clear messages: their layout
    (:meth:`check_layout`, from shapes, dtypes and devices only) and their ids (:meth:`check_ids`, range and
    repeats, which read values on the host). A caller whose ids are right by construction turns ``validate``
    off and checks the layout itself: a host read stalls the GPU's queue and cannot be captured in a CUDA
    graph."""

    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts, *, validate: bool = True) -> None:
        super().__init__()
        fmt = experts.config.activation_format
        if prepare_finalize.activation_format != fmt:
            raise ValueError(
                f"{type(prepare_finalize).__name__} produces the {prepare_finalize.activation_format!r} "
                f"activation format but {type(experts).__name__} is configured for {fmt!r}"
            )
        if fmt == "batched" and not callable(getattr(experts, "apply_batched", None)):
            raise ValueError(f"{type(experts).__name__} has no apply_batched for the batched format")
        pf_experts = getattr(prepare_finalize, "num_experts", None)
        if pf_experts is not None and pf_experts != experts.weights.num_experts:
            raise ValueError(
                f"{type(prepare_finalize).__name__} has num_experts = {pf_experts} but the experts "
                f"hold {experts.weights.num_experts}"
            )
        self.prepare_finalize = prepare_finalize
        self.experts = experts
        self.validate = validate
        self.num_experts = prepare_finalize.num_global_experts(experts.weights.num_experts)

    def _check(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        self.check_layout(hidden, topk_weights, topk_ids)
        self.check_ids(topk_ids)

    def check_layout(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """ValueError unless the inputs' shapes, dtypes and devices are what the experts take; reads no values."""
        w = self.experts.weights
        if hidden.dim() != 2:
            raise ValueError(f"hidden must be 2-D [M, H], got shape {tuple(hidden.shape)}")
        if hidden.dtype not in _HIDDEN_DTYPES:
            raise ValueError(f"hidden dtype must be float16, bfloat16 or float32, got {hidden.dtype}")
        if hidden.shape[1] != w.hidden_size:
            raise ValueError(f"hidden has H = {hidden.shape[1]} but the experts have hidden size {w.hidden_size}")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"topk_ids must be [M={hidden.shape[0]}, k], got shape {tuple(topk_ids.shape)}"
            )
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(
                f"topk_weights shape {tuple(topk_weights.shape)} differs from topk_ids shape "
                f"{tuple(topk_ids.shape)}"
            )
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_weights must be floating point (any float dtype; used as float32), "
                             f"got {topk_weights.dtype}")
        for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if t.device != hidden.device:
                raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")

    def check_ids(self, topk_ids: torch.Tensor) -> None:
        """ValueError unless every id is in [0, num_experts) and no row repeats one (reads ids on the host)."""
        num_experts = self.num_experts
        top_k = topk_ids.shape[1]
        if topk_ids.numel():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < 0 or hi >= num_experts:
                raise ValueError(f"topk_ids must be in [0, {num_experts}), got values in [{lo}, {hi}]")
            if top_k > 1:
                s = torch.sort(topk_ids, dim=1).values
                if bool((s[:, 1:] == s[:, :-1]).any()):
                    raise ValueError("topk_ids repeats an expert within a token's row")

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(topk_weights, torch.Tensor) and topk_weights.is_floating_point():
            topk_weights = topk_weights.float()  # a router's weights in any float dtype (transformers': the model's)
        if self.validate:
            self._check(hidden, topk_weights, topk_ids)
        m, top_k = topk_ids.shape
        if self.experts.config.apply_router_weight_on_input and top_k > 1:
            # transformers' Llama4TextMoe at any top-k: each expert runs on the input scaled by its weight and
            # the k outputs add up; as k rows of top-1 the prepare/experts path below needs no other form
            rows = self._forward(hidden.repeat_interleave(top_k, dim=0), topk_weights.reshape(-1, 1),
                                 topk_ids.reshape(-1, 1))
            return rows.view(m, top_k, -1).float().sum(dim=1).to(hidden.dtype)
        return self._forward(hidden, topk_weights, topk_ids)

    def _forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        pf = self.prepare_finalize
        prepared = pf.prepare(hidden, topk_weights, topk_ids,
                              apply_router_weight_on_input=self.experts.config.apply_router_weight_on_input)
        if prepared.activation_format == "standard":
            out = self.experts.apply(prepared.hidden, prepared.topk_weights, prepared.topk_ids)
        else:
            out = self.experts.apply_batched(prepared.hidden, prepared.expert_num_tokens)
        return pf.finalize(out, prepared)
