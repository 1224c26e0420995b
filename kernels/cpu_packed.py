"""CPU experts that keep weights quantized: the GEMMs read packed weights through the ops torch ships
for CPUs, and only the experts the routing hits are computed, each on its own tokens.

Per weight key (what the layer holds; built once from the ``nk`` layout, one expert at a time; the
Experts' ``weights`` keep shapes and keys only, so nothing pins the converted tensors):

- 4-bit (uint4 + zero point, uint4b8): ``torch._convert_weight_to_int4pack_for_cpu`` codes [N, K/2]
  per expert and a bfloat16 ``[G, N, 2]`` scale-and-zero table per expert, computed by
  ``torch._weight_int4pack_mm_for_cpu``. Torch's convention is ``w = (q - 8) * s + z`` with a float
  ``z``: AWQ and GPTQ-asym ``(q - zp) * s`` map to ``z = (8 - zp) * s``, GPTQ symmetric uint4b8
  ``(q - 8) * s`` to ``z = 0`` (checked against the reference by the conformance suite). The op
  takes group sizes 32..256; per-channel scales are repeated over 256/128/64/32-column groups.
- 8-bit integer (int8, uint8b128 as ``code - 128``): int8 codes; per-channel/per-tensor scales go
  through one ``torch._weight_int8pack_mm`` with unit scales and a float32 scale after it; group
  scales (GPTQ / compressed-tensors 8-bit) through one call per group on codes stored [G, N, g]
  (torch has no group-scaled int8 op; the exact alternative, ``q + 128 = 16 hi + lo`` as one int4pack
  weight [hi | lo] along K with scales 16 s and s, was no faster at 2 threads and slower at 1: below).
- fp8e4m3: the checkpoint's bytes, viewed as int8, dequantised a row tile at a time into a reused
  int32 buffer by integer ops (sign-extend, ``<< 20``, mask: the float32 bits of ``fp8 * 2^-120``,
  exact for normals and subnormals, which stay float32 subnormals in the matmul). block(128x128)
  scales are folded into the activations (one scaled copy of x per 128-row block, one bmm per tile)
  while an expert has fewer than 128 rows; otherwise, and for 1x32 MX scales, the tile is multiplied
  by the scales before a float32 matmul.

Activations: the 4- and 8-bit ops are fast on this CPU only in bfloat16, so they get bfloat16
hidden states. No int8 activations: feeding int8 codes (exact in bfloat16) works, but the ops round
each integer dot product to bfloat16 and requantising GEMM1's output then flips codes (2.0e-2 from
the reference measured). ``torch.ops.quantized.linear_dynamic`` (fbgemm, onednn and x86
engines) takes the N=1536 K=2048 GEMM in 0.21-0.72 ms at M=1, but fed integer codes (padded with two
columns so its per-tensor range is [-128, 127]) it gave 1.8e-1 relative error, and torch 2.13 deprecates
quantized tensors: W8A8/W4A8 run on the compiled kernel (``cpu_native``, exact int32 dots).
fp8 activations are fake-quantised by ``quant_ref.fake_quantize_activation``, the function the reference
calls. Everything between the GEMMs (bias, act-and-mul, router weight) is float32.

Measured on the 2-core AMD EPYC (AVX2, no AVX-512/VNNI/AMX; L2 512 KiB per core, L3 32 MiB), torch
2.13.0+cpu, 2 threads, load average 1-3 from other jobs (repeat runs differ by 10-20%), one expert
GEMM N=1536 K=2048 (Qwen3-30B-A3B's w13), 12 rotating weight copies, time over a float32 ``x @ W.T``
in the same run (a one-thread run's column, load 5-8, in brackets):

================================================  ===========  ===========  ===========
op (weights resident)                              M=1          M=4          M=16
================================================  ===========  ===========  ===========
float32 ``x @ W.T`` (4 B/weight)                   1.00         1.00         1.00
int4pack_mm_for_cpu, bfloat16 x (0.5 B)            0.28-0.31    0.15-0.17    0.43-0.59
int8pack_mm per channel, bfloat16 x (1 B)          0.38-0.41    0.20-0.23    0.44-0.62
int8, one int8pack call per 128-group              0.75-1.03    0.35-0.37    1.1-1.7
int8 as two int4pack calls (hi, lo planes)         0.63-0.64    0.31-0.32    0.77-1.13
int8 as one int4pack call, [hi | lo] along K       0.56-0.62    0.29-0.32    0.77-0.87
  the same three at 1 thread: per group 0.80-0.86, two calls 0.99-1.10, one call 0.97-1.08
int8 per group, activations masked to G rows       2.5-3.5      --           --
int4/int8pack, float32 / float16 x                 (3.5-26)     (5-25)       (10-66)
``_int_mm`` int8 x int8 -> int32                   (2.6-15)     (3.7-10)     (21)
``_scaled_mm`` fp8 (any scales)                    (49-66)      (7-10)       (5-8)
fp8 ``copy_`` to float32 (torch's conversion)      7-8.5        --           --
fp8 int32 bit trick, scales on 256-row tiles       1.53-1.65    1.02-1.09    --
fp8 int32 bit trick, 512-row tiles                 1.32         0.93-1.01    --
fp8 bit trick, block scales on x, bmm, 512 rows    1.08         0.72-0.76    --
fp8 bit trick, block scales on x, bmm, 1536 rows   0.90-1.21    0.70-0.73    --
fp8 int16 bit trick to bfloat16, bf16 bmm          1.28-1.49    --           --
================================================  ===========  ===========  ===========

In the Qwen3-30B-A3B layer at M=1 (``tools/bench_cpu.py`` shape, same run, x over the float32 layer)
group-scaled int8 took 0.63-0.67 per group and 0.63-0.64 as one [hi | lo] int4pack call at 2 threads,
0.74-0.79 and 1.06-1.12 at 1 thread; per-channel int8pack 0.40-0.43 (1 thread 0.68), AWQ int4
0.36-0.39. So: bfloat16 int4/int8 packed ops; one int8pack call per group. fp8 is bound
by the dequantisation passes (copy, shift, mask: about 0.25 ns per weight, the float32 GEMM of the
same weights 0.3 ns when they come from DRAM): in the Qwen3-30B-A3B layer at M=1 those passes took 55%
of the time, the matmuls on the cache-hot tile 16%. Layer tile sweep (M=1, x over the float32 layer):
2^18 elements 2.3-2.8, 2^19 1.8-2.1, 2^20 1.5-1.7, 2^21 1.7-2.1, 2^22 1.9-2.4; 2^20 is used. Against
the earlier 2 MiB tiles with scales on the weights (same run): block(128x128) 1.92 -> 1.53 at M=1 and
1.51 -> 1.29 at M=16, MX 1.57 -> 1.45 at M=1. Still slower than float32: no torch CPU op reads fp8.
Layer results: ``tools/bench_cpu.py`` (docs/performance.md). Group-scaled int8 and fp8 run on
the compiled kernel (``cpu_native``: its docstring has the same-run comparison); this one keeps 4-bit and
per-channel int8 (where the compiled kernel measured no faster).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from moe_registry_kernels.activations import act_and_mul
from moe_registry_kernels.dequant import e8m0_to_float, unpack_int4
from moe_registry_kernels.quant_ref import fake_quantize_activation

from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import Experts, ExpertsConfig

__all__ = ["CpuPackedExperts"]

FOREIGN_EXPERT = -1  # expert parallelism: a pair routed to another rank's expert adds nothing here
INT4_OP_GROUPS = (256, 128, 64, 32)  # group sizes torch._weight_int4pack_mm_for_cpu takes
FP8_TILE_ELEMENTS = 1 << 20  # dequantisation tile: 4 MiB, rows = this // K (fastest of 2^18..2^22 measured)
FP8_BITS_SHIFT = 20  # e4m3 exponent+mantissa (7 bits) land at float32 bits 20..26: value * 2^-120
FP8_BITS_MASK = 0x87FFFFFF - (1 << 32)  # keep the sign and those 7 bits of the sign-extended int8
FP8_BITS_UNSCALE = 2.0 ** 120
FP8_FOLD = 2.0 ** 60  # half of 2^120 on the activations, half on the output: both stay in float32's range


def _pad_cols(t: torch.Tensor, k: int) -> torch.Tensor:
    return t if t.shape[-1] == k else F.pad(t, (0, k - t.shape[-1]))


def _scale_per_group(proj: ProjectionWeights, key: QuantKey, n: int, k: int) -> torch.Tensor:
    """float32 [E, N, ceil(K/g)] scales (per-channel/per-tensor stored [E, N, 1] stay one column)."""
    assert proj.scale is not None and key.scale is not None
    s = e8m0_to_float(proj.scale) if key.scale.dtype.name == "e8m0" else proj.scale.float()
    if s.shape[1] != n:  # block(rows x cols): one row of scales per `rows` weight rows
        s = s.repeat_interleave(key.scale.group.rows, dim=1)[:, :n]
    return s


def _int_codes(w: torch.Tensor, key: QuantKey) -> torch.Tensor:
    """Stored integer weights -> int32 [E, N, K] real codes (type bias removed, zero not applied)."""
    st = key.dtype
    raw = unpack_int4(w).to(torch.int32) if st.bits == 4 else w.to(torch.int32)
    if st.signed and st.bits == 4:
        raw = torch.where(raw >= 8, raw - 16, raw)
    return raw - st.bias


@dataclass(frozen=True)
class _Int4:
    """4-bit weights in torch's CPU int4pack layout (per expert) with bf16 [G, N, 2] scales+zeros."""

    packed: tuple[torch.Tensor, ...]
    scale_zero: torch.Tensor
    group: int
    k: int

    @staticmethod
    def build(proj: ProjectionWeights, key: QuantKey) -> _Int4:
        e, n = int(proj.weight.shape[0]), int(proj.weight.shape[1])
        k = 2 * int(proj.weight.shape[2])
        cols = key.scale.group.cols if key.scale is not None else -1
        # one op group that tiles the key's group (or the row, per channel): exact repetition of scales
        group = next((g for g in INT4_OP_GROUPS if (k if cols == -1 else cols) % g == 0), None)
        if group is None:
            raise ValueError(f"4-bit weight key {key}: group {cols} (K={k}) is not a multiple of 32, "
                             "which torch._weight_int4pack_mm_for_cpu needs")
        kp = -(-k // group) * group
        scale = _scale_per_group(proj, key, n, k)
        zero = proj.zero.float() if proj.zero is not None else torch.zeros(1)
        low = key.dtype.min_value - key.dtype.bias  # smallest real code: uint4 0, uint4b8 -8
        packed, tables = [], []
        for i in range(e):
            q = _pad_cols(_int_codes(proj.weight[i:i + 1], key)[0] - low, kp)  # nibbles 0..15
            s_i, z_i = scale[i], (zero[i] if proj.zero is not None else zero)
            # (c - zp) * s = (q + low - zp) * s = (q - 8) * s + z_f: torch's convention w = (q - 8) * s + z
            z_f = (8 + low - z_i) * s_i
            reps = kp // group if s_i.shape[1] == 1 else cols // group
            s_g = s_i.repeat_interleave(reps, dim=1)[:, :kp // group]
            z_g = z_f.expand_as(s_i).repeat_interleave(reps, dim=1)[:, :kp // group]
            packed.append(torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1))
            tables.append(torch.stack((s_g.T, z_g.T), dim=-1).to(torch.bfloat16))
        return _Int4(tuple(packed), torch.stack(tables).contiguous(), group, k)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.packed) + self.scale_zero.nbytes

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        x = _pad_cols(x, self.packed[e].shape[1] * 2)
        return torch._weight_int4pack_mm_for_cpu(x, self.packed[e], self.group, self.scale_zero[e]).float()


@dataclass(frozen=True)
class _Int8:
    """8-bit integer codes as int8: [E, N, K] with float32 [E, N] per-channel scales applied after
    the GEMM, or [E, G, N, g] blocks with bf16 [E, G, N] group scales (one op call per group)."""

    codes: torch.Tensor
    scale: torch.Tensor
    grouped: bool
    k: int
    unit_scale: torch.Tensor | None = None  # bf16 ones [N] for the per-channel op call (made once)

    @staticmethod
    def build(proj: ProjectionWeights, key: QuantKey) -> _Int8:
        e, n, k = (int(d) for d in proj.weight.shape)
        assert key.scale is not None
        if proj.weight.dtype == torch.int8 and key.dtype.bias == 0:
            codes = proj.weight  # already int8 codes: shared, not copied
        else:  # uint8b128: code - 128, one expert at a time (no int32 copy of the whole layer)
            codes = torch.stack([_int_codes(proj.weight[i:i + 1], key)[0].to(torch.int8) for i in range(e)])
        scale = _scale_per_group(proj, key, n, k)
        if scale.shape[2] == 1:  # per channel / per tensor
            return _Int8(codes, scale[..., 0].contiguous(), False, k, torch.ones(n, dtype=torch.bfloat16))
        g = key.scale.group.cols
        groups = scale.shape[2]
        blocks = _pad_cols(codes, groups * g).view(e, n, groups, g).permute(0, 2, 1, 3).contiguous()
        return _Int8(blocks, scale.transpose(1, 2).to(torch.bfloat16).contiguous(), True, k)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if not self.grouped:
            assert self.unit_scale is not None and x.dtype == torch.bfloat16
            return torch._weight_int8pack_mm(x, self.codes[e], self.unit_scale).float() * self.scale[e]
        groups, g = int(self.codes.shape[1]), int(self.codes.shape[3])
        x = _pad_cols(x, groups * g)
        parts = [torch._weight_int8pack_mm(x[:, j * g:(j + 1) * g], self.codes[e, j], self.scale[e, j])
                 for j in range(groups)]
        return torch.stack(parts).float().sum(0)


@dataclass(frozen=True)
class _Fp8:
    """fp8e4m3 bytes (a view of the checkpoint's, as int8) and float32 [E, ceil(N/rows), ceil(K/cols)] scales.

    Each row tile is dequantised by integer ops to float32 bits of ``fp8 * 2^-120`` (exact, fp8 subnormals
    become float32 subnormals). Scales shared by ``rows`` > 1 weight rows (block(128x128)) and fewer
    activation rows than that are folded into the activations instead of the weights: one copy of x per
    row block, times ``s * 2^60`` group by group, one bmm over the tile's row blocks, the output times
    2^60 (no pass over the weight tile). Otherwise the tile is multiplied by ``s * 2^120`` per group
    (``unscale``: by 2^120 first, then ``s``, where ``s * 2^120`` overflows float32)."""

    codes: torch.Tensor
    scale: torch.Tensor
    rows: int
    cols: int
    unscale: bool
    k: int

    @staticmethod
    def build(proj: ProjectionWeights, key: QuantKey) -> _Fp8:
        e, n, k = (int(d) for d in proj.weight.shape)
        assert key.scale is not None and proj.scale is not None
        s = e8m0_to_float(proj.scale) if key.scale.dtype.name == "e8m0" else proj.scale.float()
        rows = 1 if s.shape[1] == n else key.scale.group.rows
        cols = k if s.shape[2] == 1 else key.scale.group.cols
        unscale = not bool(torch.isfinite((s.double() * FP8_BITS_UNSCALE).float()).all())
        return _Fp8(proj.weight.view(torch.int8), s.contiguous(), rows, cols, unscale, k)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def tile_rows(self, k_padded: int, n: int) -> int:
        """Rows per dequantised tile: about FP8_TILE_ELEMENTS, whole scale row blocks, at most the layer's N."""
        rows = max(self.rows, FP8_TILE_ELEMENTS // k_padded // self.rows * self.rows)
        return min(rows, -(-n // self.rows) * self.rows)

    def matmul(self, e: int, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        n, k, m = int(self.codes.shape[1]), self.k, int(x.shape[0])
        groups = int(self.scale.shape[2])
        kp = groups * self.cols
        x = _pad_cols(x, kp)
        xs = None
        if self.rows > 1 and m < self.rows:  # fold: [blocks, M, kp] activations times s * 2^60 per group
            xs = (x.view(1, m, groups, self.cols) * (self.scale[e] * FP8_FOLD)[:, None, :, None]).view(-1, m, kp)
            if not bool(torch.isfinite(xs).all()):
                xs = None
        step = int(buf.shape[0])
        out = torch.empty(m, n, dtype=torch.float32)
        for r in range(0, n, step):
            t = min(step, n - r)
            tile = buf[:t]
            tile[:, :k].copy_(self.codes[e, r:r + t])  # sign-extending int8 -> int32
            w = tile.bitwise_left_shift_(FP8_BITS_SHIFT).bitwise_and_(FP8_BITS_MASK).view(torch.float32)
            if xs is not None:
                whole = t // self.rows * self.rows
                b0 = r // self.rows
                if whole:
                    y = torch.bmm(xs[b0:b0 + whole // self.rows], w[:whole].view(-1, self.rows, kp).transpose(1, 2))
                    out[:, r:r + whole] = y.transpose(0, 1).reshape(m, whole)
                if whole < t:  # the layer's last, partial row block
                    torch.mm(xs[b0 + whole // self.rows], w[whole:].T, out=out[:, r + whole:r + t])
                continue
            if self.unscale:
                w.mul_(FP8_BITS_UNSCALE)
            f = self.scale[e, r // self.rows:-(-(r + t) // self.rows)]
            f = f.repeat_interleave(self.rows, dim=0)[r % self.rows:r % self.rows + t] if self.rows > 1 else f
            w.view(t, groups, self.cols).mul_((f if self.unscale else f * FP8_BITS_UNSCALE)[:, :, None])
            torch.mm(x, w.T, out=out[:, r:r + t])
        return out.mul_(FP8_FOLD) if xs is not None else out


def _build_proj(proj: ProjectionWeights, key: QuantKey) -> _Int4 | _Int8 | _Fp8:
    if not key.quantized:
        raise ValueError("torch-cpu-packed keeps quantized weights; unquantized weights run on the reference")
    if key.dtype.is_float:
        return _Fp8.build(proj, key)
    if key.dtype.bits == 4:
        return _Int4.build(proj, key)
    return _Int8.build(proj, key)


# what Experts.weights keeps of a projection whose packed copies the kernel builds (ProjectionWeights.with_stand_ins)
PACKED_FIELDS = ("weight", "scale", "zero", "scale2")


class CpuPackedExperts(Experts):
    """Packed-weight CPU experts (see the module docstring). ``weights`` keeps shapes, keys, perm,
    bias and input scales; the packed projections are ``w13`` and ``w2``."""

    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        if weights.layout != "nk":
            raise ValueError(f"torch-cpu-packed reads layout 'nk', got {weights.layout!r}")
        if weights.device.type != "cpu":
            raise ValueError(f"torch-cpu-packed runs on the cpu, the weights are on {weights.device}")
        self.w13 = _build_proj(weights.w13, weights.weight_key)
        self.w2 = _build_proj(weights.w2, weights.weight_key)
        super().__init__(ExpertWeights(weights.w13.with_stand_ins(*PACKED_FIELDS),
                                       weights.w2.with_stand_ins(*PACKED_FIELDS), weights.weight_key,
                                       weights.activation_key, weights.layout), config)
        self._perm = tuple(None if p.perm is None else p.perm.to(torch.int64) for p in (weights.w13, weights.w2))
        self._bias = tuple(None if p.bias is None else p.bias.float() for p in (weights.w13, weights.w2))
        self._input_scale = (weights.w13.input_scale, weights.w2.input_scale)
        self._fp8_bufs: dict[tuple[int, int], torch.Tensor] = {}

    def resident_weight_bytes(self) -> int:
        """Bytes held for expert weights, scales and zero points (biases, perm and input scales not counted)."""
        return self.w13.nbytes() + self.w2.nbytes()

    def _fp8_buffer(self, rows: int, k_padded: int) -> torch.Tensor:
        """The dequantisation tile for this shape, made once and reused (workspace, not weights)."""
        buf = self._fp8_bufs.get((rows, k_padded))
        if buf is None:
            buf = self._fp8_bufs[(rows, k_padded)] = torch.zeros(rows, k_padded, dtype=torch.int32)
        return buf

    def _gemm(self, which: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 (one expert's rows) -> [T, N] float32 through projection ``which`` (0: w13, 1: w2):
        activation quantisation, act-order permutation, the packed GEMM, bias."""
        proj = self.w13 if which == 0 else self.w2
        key = self.weights.activation_key
        if key.quantized:  # fp8 activations (the spec claims no int8 ones: see its comment)
            x = fake_quantize_activation(x, key, self._input_scale[which], torch.float32)
        perm = self._perm[which]
        if perm is not None:
            x = x.index_select(1, perm[e])
        if isinstance(proj, _Fp8):
            kp = int(proj.scale.shape[2]) * proj.cols
            y = proj.matmul(e, x.float(), self._fp8_buffer(proj.tile_rows(kp, int(proj.codes.shape[1])), kp))
        else:
            y = proj.matmul(e, x.to(torch.bfloat16))
        bias = self._bias[which]
        return y if bias is None else y + bias[e]

    def _mlp(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(1, e, act_and_mul(self._gemm(0, e, x), self.config.activation))

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        m, top_k = topk_ids.shape
        num_experts = self.weights.num_experts
        out = torch.zeros(m, hidden.shape[1], dtype=torch.float32)
        if m == 0:
            return out.to(hidden.dtype)
        flat = topk_ids.reshape(-1).to(torch.int64)
        lo, hi = int(flat.min()), int(flat.max())
        if lo < FOREIGN_EXPERT or hi >= num_experts:
            raise ValueError(f"topk_ids must be in [0, {num_experts}) or {FOREIGN_EXPERT} (a foreign expert), "
                             f"got values in [{lo}, {hi}]")
        order = torch.argsort(flat, stable=True)  # one sort: each expert's pairs are contiguous
        counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()
        tokens = order // top_k
        router = topk_weights.reshape(-1).index_select(0, order).float()
        on_input = self.config.apply_router_weight_on_input
        placed = []  # (expert, its tokens, their router weights); foreign pairs sort first and are skipped
        for e, (first, n) in enumerate(zip(itertools.accumulate(counts[:-1]), counts[1:], strict=True)):
            if n:
                placed.append((e, tokens[first:first + n], router[first:first + n, None]))

        def gathered(e: int, tok: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            x = hidden.index_select(0, tok).float()
            return x * w if on_input else x

        def whole() -> torch.Tensor:  # GEMM1's whole input, as the reference takes it (foreign tokens too)
            x = hidden.float()
            return x * topk_weights.reshape(m, 1).float() if on_input else x

        # lazily: one expert's rows and outputs alive at a time (a 4k-token prefill holds no copy of all of them)
        jobs = ((e, gathered(e, tok, w)) for e, tok, w in placed)
        for (_, tok, w), y in zip(placed, self._mlps(jobs, whole), strict=True):
            out.index_add_(0, tok, y if on_input else y * w)
        return out.to(hidden.dtype)

    def _mlps(self, jobs: Iterable[tuple[int, torch.Tensor]],
              whole: Callable[[], torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
        """Each (expert, rows) job through its expert MLP, one at a time. ``whole``: the layer's whole GEMM1 input
        (None: the jobs' rows), for a subclass whose activation scale spans the layer (torch-cpu-native's
        per-tensor dynamic fp8); the experts here are independent."""
        return (self._mlp(e, x) for e, x in jobs)

    def apply_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """Batched format: x [E, T, H], the first expert_num_tokens[e] rows of x[e] are real; no router
        weights (finalize applies them). Returns [E, T, H] in x's dtype; rows past a count are zero."""
        num_experts = self.weights.num_experts
        if x.dim() != 3 or x.shape[0] != num_experts:
            raise ValueError(f"batched input must be [E={num_experts}, T, H], got {tuple(x.shape)}")
        out = torch.zeros(x.shape, dtype=torch.float32)
        counts = expert_num_tokens.tolist()
        for e, n in enumerate(counts):
            if n < 0 or n > x.shape[1]:
                raise ValueError(f"expert_num_tokens[{e}] = {n} is outside [0, {x.shape[1]}]")
        filled = [(e, n) for e, n in enumerate(counts) if n]
        for (e, n), y in zip(filled, self._mlps((e, x[e, :n].float()) for e, n in filled), strict=True):
            out[e, :n] = y
        return out.to(x.dtype)


def packed_checkpoint_bytes(weights: ExpertWeights) -> int:
    """Bytes a checkpoint stores for these experts' weights, scales and zero points: codes at the key's
    bit width, one scale per group (per channel: N, per tensor: 1, per expert) at its dtype's width,
    zero points at the weight's bit width. The yardstick for :meth:`CpuPackedExperts.resident_weight_bytes`."""
    key = weights.weight_key
    total = 0
    for proj in (weights.w13, weights.w2):
        e, n = int(proj.weight.shape[0]), int(proj.weight.shape[1])
        bits = key.dtype.bits if key.quantized else proj.weight.element_size() * 8
        k = int(proj.weight.shape[2]) * (2 if key.quantized and key.dtype.bits == 4 else 1)
        total += e * n * k * bits // 8
        if key.quantized and key.scale is not None:
            g = key.scale.group
            rows = 1 if g.rows == -1 and g.cols == -1 else (n if g.rows in (1, -1) else -(-n // g.rows))
            cols = 1 if g.cols == -1 else -(-k // g.cols)
            total += e * rows * cols * key.scale.dtype.bits // 8
            if key.zero_point == "group":
                total += math.ceil(e * rows * cols * bits / 8)
    return total
