"""The torch reference experts: what a scheme means, computed from dequantized weights.

Per expert e and each token row x routed to it::

    x = x * w_router               (only with apply_router_weight_on_input; top_k must be 1)
    x = fake_quant(x, activation_key, w13.input_scale)
    h = x @ W13[e]^T + b13[e]
    a = act_and_mul(h, activation)
    a = fake_quant(a, activation_key, w2.input_scale)
    y = a @ W2[e]^T + b2[e]
    out[token] += w_router * y     (unless the weight was applied on the input)

``fake_quant`` is :func:`quant_ref.fake_quantize_activation` (identity when unquantized). A
per-tensor dynamic activation key (``quant_method: fp8`` dynamic) has one scale per GEMM input, as
vLLM's fp8 MoE quantises it: one amax over the whole hidden state (router weight applied when it
goes on the input) for GEMM1, one over every routed pair's intermediate for GEMM2. The
float32 path (:class:`ReferenceExperts`) is what every kernel is checked against; the float64 path
(:func:`reference_moe`) runs the same code and checks the reference itself. This is a reference:
it reads expert token counts on the host, so it synchronises with the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from moe_registry_kernels.activations import act_and_mul
from moe_registry_kernels.dequant import dequantize
from moe_registry_kernels.quant_ref import fake_quantize_activation, per_tensor_dynamic, quantize_activation

from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import Experts, ExpertsConfig

# expert parallelism marks a pair routed to another rank's expert with this id: it adds nothing here
FOREIGN_EXPERT = -1

__all__ = ["DenseExperts", "dense_experts", "ReferenceExperts", "reference_moe", "reference_moe_batched"]


@dataclass(frozen=True)
class DenseExperts:
    """Experts dequantized once into ``w13`` [E, 2I, H] and ``w2`` [E, H, I] of one compute dtype, or, for
    unquantized weights kept as stored, cast to it one expert at a time where they are used (:func:`_weight`)."""

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None
    input_scale13: torch.Tensor | None
    input_scale2: torch.Tensor | None
    activation_key: QuantKey

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])


def dense_experts(weights: ExpertWeights, dtype: torch.dtype = torch.float32, *,
                  keep_stored: bool = False) -> DenseExperts:
    """Dequantize both projections (and cast biases) to ``dtype``. ``keep_stored``: unquantized weights stay the
    stored tensors (a bfloat16 checkpoint's experts are then held once, not again in float32)."""
    if weights.layout != "nk":
        raise ValueError(f"the reference reads layout 'nk', got {weights.layout!r}")

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    def dense(proj: ProjectionWeights) -> torch.Tensor:
        if keep_stored and not weights.weight_key.quantized and proj.weight.is_floating_point():
            return proj.weight
        return dequantize(proj, weights.weight_key, dtype=dtype)

    return DenseExperts(
        w13=dense(weights.w13),
        w2=dense(weights.w2),
        b13=cast(weights.w13.bias),
        b2=cast(weights.w2.bias),
        input_scale13=weights.w13.input_scale,
        input_scale2=weights.w2.input_scale,
        activation_key=weights.activation_key,
    )


def _weight(w: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s weight in ``dtype`` (a cast only where the weights were kept as stored)."""
    return w[e].to(dtype)


def _expert_mlp(dense: DenseExperts, e: int, x: torch.Tensor, activation: str,
                dtype: torch.dtype) -> torch.Tensor:
    """One expert on rows x [T, H] -> [T, H] in ``dtype`` (no router weight)."""
    key = dense.activation_key
    xq = fake_quantize_activation(x, key, dense.input_scale13, dtype)
    h = xq @ _weight(dense.w13, e, dtype).T
    if dense.b13 is not None:
        h = h + dense.b13[e]
    a = act_and_mul(h, activation)
    aq = fake_quantize_activation(a, key, dense.input_scale2, dtype)
    y = aq @ _weight(dense.w2, e, dtype).T
    if dense.b2 is not None:
        y = y + dense.b2[e]
    return y


def _run_experts(dense: DenseExperts, jobs: list[tuple[int, torch.Tensor]], activation: str,
                 dtype: torch.dtype, gemm1_input: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each (expert, rows) job through its expert MLP -> [rows, H] in ``dtype``. Per-tensor dynamic
    activation keys: GEMM1's scale from ``gemm1_input`` (default: all jobs' inputs), GEMM2's from
    all the jobs' intermediates."""
    key = dense.activation_key
    if not per_tensor_dynamic(key):
        return [_expert_mlp(dense, e, x, activation, dtype) for e, x in jobs]
    if not jobs:
        return []
    static = dataclasses.replace(key, scale=dataclasses.replace(key.scale, dynamic=False))
    s13 = quantize_activation(torch.cat([x for _, x in jobs]) if gemm1_input is None else gemm1_input, key).scale
    inter = []
    for e, x in jobs:
        h = fake_quantize_activation(x, static, s13, dtype) @ _weight(dense.w13, e, dtype).T
        inter.append(act_and_mul(h if dense.b13 is None else h + dense.b13[e], activation))
    s2 = quantize_activation(torch.cat(inter), key).scale
    out = []
    for (e, _), a in zip(jobs, inter, strict=True):
        y = fake_quantize_activation(a, static, s2, dtype) @ _weight(dense.w2, e, dtype).T
        out.append(y if dense.b2 is None else y + dense.b2[e])
    return out


def _moe(dense: DenseExperts, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
         config: ExpertsConfig, dtype: torch.dtype) -> torch.Tensor:
    """Standard-format layer [M, H] -> [M, H] in ``dtype``; pairs with id FOREIGN_EXPERT add zero."""
    m, top_k = topk_ids.shape
    num_experts = dense.num_experts
    out = torch.zeros(m, hidden.shape[1], dtype=dtype, device=hidden.device)
    if m == 0:
        return out
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    lo, hi = int(flat_ids.min()), int(flat_ids.max())
    if lo < FOREIGN_EXPERT or hi >= num_experts:
        raise ValueError(f"topk_ids must be in [0, {num_experts}) or {FOREIGN_EXPERT} (a foreign expert), "
                         f"got values in [{lo}, {hi}]")
    # foreign pairs (expert parallelism: another rank's expert) contribute nothing: sorted first, skipped
    order = torch.argsort(flat_ids, stable=True)
    num_foreign = int((flat_ids == FOREIGN_EXPERT).sum())
    tokens = order // top_k
    router = topk_weights.reshape(-1)[order].to(dtype)
    counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=num_experts).tolist()
    start = num_foreign
    jobs, placed = [], []
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok, w = tokens[start:start + n], router[start:start + n, None]
        start += n
        x = hidden[tok].to(dtype)
        jobs.append((e, x * w if config.apply_router_weight_on_input else x))
        placed.append((tok, w))
    # per-tensor dynamic activations: GEMM1's scale comes from the whole hidden state (router weight
    # applied; tokens of foreign experts too); no other key reads it
    whole = None
    if per_tensor_dynamic(dense.activation_key):
        whole = hidden.to(dtype)
        if config.apply_router_weight_on_input:  # every (token, expert) pair's scaled row
            whole = (whole[:, None, :] * topk_weights.to(dtype)[:, :, None]).reshape(m * top_k, -1)
    for (tok, w), y in zip(placed, _run_experts(dense, jobs, config.activation, dtype, whole), strict=True):
        out.index_add_(0, tok, y if config.apply_router_weight_on_input else y * w)
    return out


def _moe_batched(dense: DenseExperts, x: torch.Tensor, expert_num_tokens: torch.Tensor,
                 config: ExpertsConfig, dtype: torch.dtype) -> torch.Tensor:
    """Batched-format layer [E, T, H] -> [E, T, H] in ``dtype``; rows past a count stay zero."""
    num_experts = dense.num_experts
    if x.dim() != 3 or x.shape[0] != num_experts:
        raise ValueError(f"batched input must be [E={num_experts}, T, H], got {tuple(x.shape)}")
    if expert_num_tokens.shape != (num_experts,):
        raise ValueError(f"expert_num_tokens must be [{num_experts}], got {tuple(expert_num_tokens.shape)}")
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    jobs = []
    for e, n in enumerate(expert_num_tokens.tolist()):
        if n < 0 or n > x.shape[1]:
            raise ValueError(f"expert_num_tokens[{e}] = {n} is outside [0, {x.shape[1]}]")
        if n:
            jobs.append((e, x[e, :n].to(dtype)))
    for (e, rows), y in zip(jobs, _run_experts(dense, jobs, config.activation, dtype), strict=True):
        out[e, :rows.shape[0]] = y
    return out


class ReferenceExperts(Experts):
    """Float32 reference; quantized weights are dequantized once here, not per call; unquantized ones are kept
    as stored and cast per expert in the call (a bfloat16 model's experts are not held a second time)."""

    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        super().__init__(weights, config)
        self.dense = dense_experts(weights, torch.float32, keep_stored=True)

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return _moe(self.dense, hidden, topk_weights, topk_ids, self.config, torch.float32).to(hidden.dtype)

    def apply_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """Batched format: x [E, T, H], the first expert_num_tokens[e] rows of x[e] are real; no
        router weights here (finalize applies them). Returns [E, T, H] in x's dtype."""
        return _moe_batched(self.dense, x, expert_num_tokens, self.config, torch.float32).to(x.dtype)


def reference_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  weights: ExpertWeights, config: ExpertsConfig,
                  compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Ground truth: the same computation in ``compute_dtype``; returns [M, H] in ``compute_dtype``
    (not the hidden dtype, so comparisons keep its precision)."""
    return _moe(dense_experts(weights, compute_dtype), hidden, topk_weights, topk_ids, config, compute_dtype)


def reference_moe_batched(x: torch.Tensor, expert_num_tokens: torch.Tensor, weights: ExpertWeights,
                          config: ExpertsConfig, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Batched-format ground truth, [E, T, H] in ``compute_dtype``."""
    return _moe_batched(dense_experts(weights, compute_dtype), x, expert_num_tokens, config, compute_dtype)


def reference_linear(x: torch.Tensor, proj: ProjectionWeights, weight_key: QuantKey, activation_key: QuantKey,
                     compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Ground truth of a kernel's one-projection form (a Linear): rows x [M, K] quantised as ``activation_key``
    says, times the dequantised weight of the one-expert projection ``proj``; [M, N] in ``compute_dtype``."""
    xq = fake_quantize_activation(x, activation_key, proj.input_scale, compute_dtype)
    return xq @ dequantize(proj, weight_key, dtype=compute_dtype)[0].T
