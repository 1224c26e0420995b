"""CPU experts for unquantized (bfloat16, float16, float32) weights, kept as the checkpoint stores them: no
float32 copy, only the experts the routing hits read, through torch's grouped GEMM.

One call is: one stable sort of the (token, expert) pairs by expert (pairs of another rank's expert, id -1,
sort first and are dropped), one gather of the routed rows, one ``torch._grouped_mm`` for gate/up over all
experts (offsets end each expert's rows; experts without rows cost nothing), the bias, activation and router
weight in float32, one ``torch._grouped_mm`` for down, and one ``index_add_`` into a float32 sum over top-k.
The GEMMs take and give the weights' dtype (torch's CPU grouped GEMM has no wider output), so a bfloat16
layer rounds each GEMM's output to bfloat16 as transformers' ``grouped_mm`` experts do; the sums over K
inside the GEMM and over top-k here are float32.

Experts with at most ``GEMV_ROWS`` rows sort before the others and run as a grouped GEMM of their own with
oneDNN turned off (bfloat16 only): torch's CPU GEMM then takes its own reduced-precision GEMV, which reads
bfloat16 weights at the memory's speed, where oneDNN's bfloat16 GEMM reads them at about half of it however
few the rows. At decode most routed experts have one or two rows. Measured on the 2-core AMD EPYC (AVX-512 with
bf16), torch 2.13.0+cpu, 2 threads, load average below 1, ms per expert GEMM N=1536 K=2048 (Qwen3-30B-A3B's
w13, 6 MiB in bfloat16) over 64 rotating copies; ``x.sum()`` over the weight reads it at 33 GB/s:

=====================================  ======  ======  ======  ======  ======
rows                                    1       2       4       8       32
=====================================  ======  ======  ======  ======  ======
bfloat16 ``mm`` / ``_grouped_mm``       0.36    0.33    0.36    0.41    0.72
  the same with oneDNN off              0.19    0.28    0.74    1.25    4.40
float16 (no oneDNN path here)           0.19    0.29    0.74    1.28    4.5
float32 ``mm``                          0.83    1.45    1.33    1.41    1.93
=====================================  ======  ======  ======  ======  ======

The whole Qwen3-30B-A3B layer (E=128, top-8, H=2048, I=768, random routing over all 128 experts, the same
run), ms per call in bfloat16: M=1 3.4 (with oneDNN for every expert 6.4; transformers 5.24's
``grouped_mm`` experts 6.2; the float32 reference 7.0), M=8 20.5 (37.3, 34.5, 46.4), M=64 85 (86, 89, 950).
In float16 M=1 3.6 and M=8 19.9 against transformers' 3.0 and 18.9.

``torch._grouped_mm`` on the CPU wants 16-byte strides: hidden and intermediate a multiple of 8 elements in
16-bit dtypes.
"""

from __future__ import annotations

import torch
from moe_registry_kernels.activations import act_and_mul

from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.experts import Experts, ExpertsConfig

__all__ = ["CpuGroupedExperts"]

FOREIGN_EXPERT = -1  # expert parallelism: a pair routed to another rank's expert adds nothing here
GEMV_ROWS = 2  # experts with at most this many rows run on torch's GEMV, not oneDNN (bfloat16: module docstring)


def _nk_view(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] weights as the grouped GEMM's [E, K, N] operand: a transposed view, no copy, where one of the
    last two dimensions is contiguous (the checkpoint's tensor as it is); a contiguous copy otherwise."""
    if w.stride(-1) != 1 and w.stride(-2) != 1:
        w = w.contiguous()
    return w.transpose(1, 2)


class CpuGroupedExperts(Experts):
    """Unquantized CPU experts on ``torch._grouped_mm`` (see the module docstring); ``weights`` are the
    converted tensors themselves, the GEMMs read them through transposed views."""

    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        if weights.layout != "nk":
            raise ValueError(f"torch-cpu-grouped reads layout 'nk', got {weights.layout!r}")
        if weights.weight_key.quantized:
            raise ValueError(f"torch-cpu-grouped runs unquantized weights, got {weights.weight_key}")
        if weights.device.type != "cpu":
            raise ValueError(f"torch-cpu-grouped runs on the cpu, the weights are on {weights.device}")
        super().__init__(weights, config)
        self._w13 = _nk_view(weights.w13.weight)
        self._w2 = _nk_view(weights.w2.weight)
        self._dtype = self._w13.dtype
        self._bias = tuple(None if p.bias is None else p.bias.float() for p in (weights.w13, weights.w2))

    def resident_weight_bytes(self) -> int:
        """Bytes held for the expert weights (biases not counted)."""
        return sum(w.untyped_storage().nbytes() for w in (self._w13, self._w2))

    def _grouped(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, gemv: bool) -> torch.Tensor:
        """One grouped GEMM; ``gemv``: every group has at most GEMV_ROWS rows, run on torch's own reduced-precision
        GEMV instead of oneDNN (bfloat16 only). The flag is process-wide, read per op and put back at once: a GEMM
        another thread runs in that window takes torch's own path too, which changes its speed, not what it means;
        a caller who turned oneDNN off keeps it off."""
        if not (gemv and self._dtype == torch.bfloat16 and torch._C._get_mkldnn_enabled()):
            return torch._grouped_mm(x, w, offs=offsets)
        torch._C._set_mkldnn_enabled(False)
        try:
            return torch._grouped_mm(x, w, offs=offsets)
        finally:
            torch._C._set_mkldnn_enabled(True)

    def _mlp(self, x: torch.Tensor, offsets: torch.Tensor, experts: torch.Tensor, router: torch.Tensor | None,
             gemv: bool = False) -> torch.Tensor:
        """Rows x [S, H] in the weights' dtype, grouped by expert (``offsets``: int32 end of each expert's rows,
        ``experts``: each row's expert, read only for biases) -> float32 [S, H], times ``router`` [S, 1] if given."""
        b13, b2 = self._bias
        h = self._grouped(x, self._w13, offsets, gemv).float()
        if b13 is not None:
            h += b13.index_select(0, experts)
        a = act_and_mul(h, self.config.activation).to(self._dtype)
        y = self._grouped(a, self._w2, offsets, gemv).float()
        if b2 is not None:
            y += b2.index_select(0, experts)
        return y if router is None else y.mul_(router)

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        m, top_k = topk_ids.shape
        num_experts = self.weights.num_experts
        if m == 0:
            return torch.zeros(hidden.shape, dtype=hidden.dtype)
        flat = topk_ids.reshape(-1).to(torch.int64)
        lo, hi = (v.item() for v in torch.aminmax(flat))
        if lo < FOREIGN_EXPERT or hi >= num_experts:
            raise ValueError(f"topk_ids must be in [0, {num_experts}) or {FOREIGN_EXPERT} (a foreign expert), "
                             f"got values in [{lo}, {hi}]")
        counts = torch.bincount(flat + 1, minlength=num_experts + 1)
        per_expert = counts[1:]
        # experts with few rows sort first (key + E for the others): each class is one grouped GEMM
        many = per_expert > GEMV_ROWS
        key = flat + (many.index_select(0, flat.clamp(min=0)) & (flat >= 0)).to(torch.int64) * num_experts
        order = torch.sort(key, stable=True)[1]
        foreign, few_rows = torch.stack((counts[0], per_expert[~many].sum())).tolist()
        out = torch.zeros(m, hidden.shape[1], dtype=torch.float32)
        if foreign == flat.numel():
            return out.to(hidden.dtype)
        pairs = order[foreign:]
        tokens = pairs // top_k
        experts = flat.index_select(0, pairs)
        on_input = self.config.apply_router_weight_on_input
        router = topk_weights.reshape(-1).index_select(0, pairs).float()[:, None]
        x = hidden.index_select(0, tokens)
        if on_input:
            x = x.float().mul_(router)
        x = x.to(self._dtype)
        routed = flat.numel() - foreign
        for start, stop, gemv in ((0, few_rows, True), (few_rows, routed, False)):
            if start == stop:
                continue
            sizes = per_expert.masked_fill(many if gemv else ~many, 0)
            y = self._mlp(x[start:stop], sizes.cumsum(0, dtype=torch.int32), experts[start:stop],
                          None if on_input else router[start:stop], gemv)
            out.index_add_(0, tokens[start:stop], y)
        return out.to(hidden.dtype)

    def apply_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """Batched format: x [E, T, H], the first expert_num_tokens[e] rows of x[e] are real; no router
        weights (finalize applies them). Returns [E, T, H] in x's dtype; rows past a count are zero."""
        num_experts = self.weights.num_experts
        if x.dim() != 3 or x.shape[0] != num_experts:
            raise ValueError(f"batched input must be [E={num_experts}, T, H], got {tuple(x.shape)}")
        counts = expert_num_tokens.to(torch.int64)
        bad = [(e, n) for e, n in enumerate(counts.tolist()) if n < 0 or n > x.shape[1]]
        if bad:
            raise ValueError(f"expert_num_tokens[{bad[0][0]}] = {bad[0][1]} is outside [0, {x.shape[1]}]")
        valid = torch.arange(x.shape[1]) < counts[:, None]  # [E, T]: the real rows, expert by expert
        many = counts > GEMV_ROWS
        out = torch.zeros(x.shape, dtype=x.dtype)
        for gemv in (True, False):
            mask = valid & (many != gemv)[:, None]
            rows = x[mask]
            if rows.numel():
                sizes = counts.masked_fill(many == gemv, 0)
                experts = torch.repeat_interleave(torch.arange(num_experts), sizes)
                out[mask] = self._mlp(rows.to(self._dtype), sizes.cumsum(0, dtype=torch.int32), experts, None,
                                      gemv).to(x.dtype)
        return out
