"""CPU experts on 8-bit activation codes and integer dot products (``csrc/cpu_dot8.cpp``), for 4- and 8-bit
integer weights with group or channel scales, symmetric or with zero points (GPTQ, AWQ, compressed-tensors
W4A16 / W8A16) and for FP4 weights (MXFP4, NVFP4: an e2m1 code is twice its value an integer, -12..12, so it
takes the same dots exactly, as ggml's MXFP4 does): llama.cpp's way of running a MoE layer on a CPU, on the
checkpoints' own codes.

Why: torch-cpu-native sums ``code x x`` in float32, exact but bound by float FMAs at decode (one
token: each weight meets one activation); dotting int8 activation codes with the weight codes does 32-64
multiply-adds per instruction (AVX-512 VNNI ``vpdpbusd``, AVX2 ``vpmaddubsw``). What it costs: the
activations are quantised, each row once per GEMM, per block of 32 columns (``d = amax / 127``, as ggml's
Q8_0) - GEMM1's input once per token for all its experts, GEMM2's per (token, expert). The error this adds
(about 0.4% of the output's norm on random data, measured by the conformance suite) stays inside the
schemes' tolerance; the kernel spec declares it (``emulation``: explain and run say it), and torch-cpu-native
keeps the exact sums (``--prefer torch-cpu-native``).

FP8 W8A8 (128x128 weight blocks with activations per 128 columns, or channel scales with activations per token):
no emulation - the activations are quantised to e4m3 as the schemes declare (bit-equal to the reference's fake
quantisation), so weight and activation codes are both e4m3 values, whose products are exact in float32; the
dots run on AVX-512 BF16 (``vdpbf16ps``: every e4m3 value is a bfloat16) where the CPU has it, else on float32
FMAs. torch-cpu-native, which runs these schemes in float32 from the dequantised activations, computes the same
numbers but for float32 rounding order, at a quarter of the speed or less at decode (``tools/bench_cpu_peer.py``).
W8A8 int8 (per-channel int8 weights, activations per token): no emulation either - one activation scale a row.

Weights are repacked when the layer is built: unsigned codes (int4 nibbles 0..15, int8 bytes 0..255) with a
float32 scale per (row, group) and a uint8 zero where the checkpoint has zero points (uint4b8 and uint8b128 keep
none: their fixed 8 and 128 are folded into the dots; NVFP4 keeps its group scales in float16 and its tensor
scale once per output row), four rows interleaved per 64 columns (see the C++ header), in one buffer per
projection aligned for huge pages: one contiguous stream per 64-row task, and each 64-column chunk of four rows
loaded once for every token of a pass. One call per GEMM covers every (token, expert) pair of the layer: the rows
are quantised once, then each (expert, 64-row block) is a task of one parallel region, taken by whichever thread
comes free.

The library is built per instruction set the CPU has (``avx512bf16``, ``avx512vnni``, ``avx2``, as torch's cpuinfo
probes say; the oracle checks the kernel spec's ``cpu_features``, AVX2 and FMA, from /proc/cpuinfo before this is
built), its op namespace named after it, so two builds load side by side (the tests compare them).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from moe_registry_kernels.activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, act_and_mul
from moe_registry_kernels.cpu_build import BuildError, ExtensionError, Flags, load_extension
from moe_registry_kernels.cpu_native import cache_root
from moe_registry_kernels.cpu_packed import FOREIGN_EXPERT, PACKED_FIELDS
from moe_registry_kernels.dequant import e8m0_to_float
from moe_registry_kernels.quant_ref import AMAX_FLOOR

from moe_registry.core.errors import ConfigError
from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import Experts, ExpertsConfig
from moe_registry.layer.linear import Linear

__all__ = ["Dot8Experts", "dot8_ops", "best_isa", "ISA_FLAGS"]

SOURCE = Path(__file__).parent / "csrc" / "cpu_dot8.cpp"
CHUNK = 64  # columns per weight chunk (K is padded to it); scale groups are multiples of it, or one block
BLOCK = 32  # activation block (columns per activation scale)
ROWS = 4  # interleaved rows
FP8_GROUP = 128  # fp8 weight blocks and activation groups: 128 columns
E2M1_ZERO = 12  # the kernel reads an e2m1 code as 12 + twice its value (0..24): unsigned, integer, zero at 12
SIGNED_INT8_ZERO = 128  # a signed int8 code is read as offset binary (its top bit flipped): zero at 128
INT8_PER_TOKEN = "int8 scale:float32:token:dynamic"  # the W8A8 int8 schemes' activations, quantised by the kernel
# the builds, best first: (name, the torch.cpu probes that must all say yes, compiler flags)
_VNNI = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
ISA_FLAGS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    # the VNNI build with vdpbf16ps for the fp8 weights' dots
    ("avx512bf16", ("_is_avx512_supported", "_is_vnni_supported", "_is_avx512_bf16_supported"),
     (*_VNNI, "-mavx512bf16")),
    ("avx512vnni", ("_is_avx512_supported", "_is_vnni_supported"), _VNNI),
    ("avx2", ("_is_avx2_supported",), ("-mavx2", "-mfma")),
    ("scalar", (), ()),
)
ACT_CODES = {None: 0, "silu": 1, "gelu": 2, "swigluoai": 3}  # the op's act argument (activations.py's functions)
_LOCK = threading.Lock()
_OPS: dict[str, object] = {}


def runs(isa: str) -> bool:
    """Whether this CPU runs the build ``isa`` (torch's cpuinfo probes; the oracle reads /proc/cpuinfo's flags
    for the kernel spec's ``cpu_features``, the same CPUID bits)."""
    probes = next(p for name, p, _ in ISA_FLAGS if name == isa)
    return all(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)


def best_isa() -> str:
    """The fastest build this CPU runs."""
    return next(name for name, _, _ in ISA_FLAGS if runs(name))


def dot8_ops(isa: str | None = None):
    """The compiled ops of one build (default: the best this CPU runs), built once per source, flags, torch and
    Python (``cpu_build``), loaded once per process."""
    name = isa or best_isa()
    flags = {n: f for n, _, f in ISA_FLAGS}
    if name not in flags:
        raise ConfigError(f"kernel torch-cpu-dot8: no build {name!r}; wanted one of {', '.join(flags)}")
    if not runs(name):
        raise ConfigError(f"kernel torch-cpu-dot8: this CPU does not run the {name} build; it runs {best_isa()}")
    cflags = flags[name]
    with _LOCK:
        if name not in _OPS:
            ns = f"moe_registry_dot8_{name}"
            omp = [("-fopenmp",), ()] if torch.backends.openmp.is_available() else [()]
            variants = [Flags(("-O3", *o, *cflags, f"-DDOT8_NS={ns}"), o) for o in omp]
            cache = cache_root() / "extensions"
            try:
                load_extension(f"moe_registry_cpu_dot8_{name}", [SOURCE], variants, cache,
                               what=f"the torch-cpu-dot8 kernel ({name})",
                               why=", the kernel chosen for this layer (--prefer torch-cpu-native needs no new build)")
            except BuildError as err:
                raise ConfigError(f"kernel torch-cpu-dot8: building {SOURCE.name} in {cache} failed ({err}); wanted "
                                  "a C++ compiler (c++) and ninja on PATH, or pick another kernel "
                                  "(--kernel torch-cpu-packed)") from None
            except ExtensionError as err:
                raise ConfigError(f"kernel torch-cpu-dot8: {err}") from None
            _OPS[name] = getattr(torch.ops, ns)
        return _OPS[name]


def e2m1_scales(proj: ProjectionWeights, key: QuantKey) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An e2m1 projection's group scales as the kernel takes them, halved for the codes' doubling, and its
    multiplier per output row: e8m0 read as 2^(e-127), float32 [E, N, G], and none; or (NVFP4) e4m3 in float16
    [E, N, G] - an e4m3 value halved (2^-10 .. 224, four significant bits) is exact there, two bytes a group
    where a float32 took four - with the float32 tensor scale2 [E, N] applied to each output once."""
    if key.scale.dtype.name == "e8m0":
        if key.scale2 is not None:
            raise ValueError(f"weight key {key}: torch-cpu-dot8 takes a second-level scale over e4m3 group scales")
        return e8m0_to_float(proj.scale) * 0.5, None
    if key.scale2 is None or proj.scale2 is None:
        raise ValueError(f"weight key {key}: torch-cpu-dot8 takes e4m3 group scales with a float32 second-level "
                         f"scale (NVFP4), got {'no' if proj.scale2 is None else 'a'} scale2")
    e, n = int(proj.scale.shape[0]), int(proj.scale.shape[1])
    return (proj.scale.float() * 0.5).half(), proj.scale2.float().reshape(e, n)


@dataclass(frozen=True)
class Dot8Proj:
    """One projection of every expert in the kernel's layout: codes [E, Np/4, Kp/64, 4, 32 or 64] uint8,
    scale [E, Np, G] float32 (groups of 16: float16, each chunk's 4 x 4 of a row group side by side), zero
    [E, Np, G] uint8 where the key has zero points (else empty: every code's zero is ``zero_const``), row_scale
    [E, Np] float32 multiplying each output row (NVFP4's tensor scale) or None; n real rows, k real columns, gs
    columns per group; e2m1: the 4-bit codes are FP4."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    n: int
    k: int
    bits: int
    gs: int
    e2m1: bool = False
    zero_const: int = -1  # the one zero of every code (no zero points), or -1: zero holds them
    row_scale: torch.Tensor | None = None
    fp8: bool = False  # e4m3 codes, dotted with e4m3 activation codes per group of gs columns
    per_token: bool = False  # activations quantised to int8 with one scale a row (W8A8 int8), not one per 32 columns

    @staticmethod
    def build(proj: ProjectionWeights, key: QuantKey, ops, activation: QuantKey | None = None) -> Dot8Proj:
        """The kernel's layout of ``proj``, its codes in the build's weight buffer (``ops.weight_buffer``: on
        huge pages where the OS offers them, which the decode's once-per-step stream of the codes wants);
        ``activation``: the activation key the layer runs (fp8 weights take the fp8 one their scheme binds)."""
        if key.dtype.name == "fp8e4m3":
            return Dot8Proj._build_fp8(proj, key, activation, ops)
        per_token = activation is not None and activation.quantized
        if per_token and not (key.dtype.name == "int8" and str(activation) == INT8_PER_TOKEN):
            raise ValueError(f"torch-cpu-dot8 quantises 16- and 32-bit activations itself (and takes {INT8_PER_TOKEN} "
                             f"ones on int8 weights), got activation key {activation} on weight key {key}")
        bits, e2m1 = key.dtype.bits, key.dtype.name == "e2m1"
        integer = not key.dtype.is_float and bits in (4, 8) and key.scale2 is None
        if not (integer or e2m1) or key.scale is None:
            raise ValueError(f"torch-cpu-dot8 runs 4- and 8-bit integer weights with one scale level and e2m1 "
                             f"weights, got {key}")
        e, n, kw = (int(d) for d in proj.weight.shape)
        k = kw * 2 if bits == 4 else kw
        kp, np_ = -(-k // CHUNK) * CHUNK, -(-n // ROWS) * ROWS
        scale, row_scale = e2m1_scales(proj, key) if e2m1 else (proj.scale.float(), None)
        if scale.dim() != 3 or scale.shape[:2] != (e, n):
            raise ValueError(f"weight key {key}: wanted scales [E={e}, N={n}, groups], got {tuple(scale.shape)}")
        groups = int(scale.shape[2])
        gs = kp if groups == 1 else k // groups
        if groups > 1 and (gs * groups != k or (gs not in (BLOCK // 2, BLOCK) and gs % CHUNK)):
            raise ValueError(f"weight key {key}: {groups} scale groups over K={k}; torch-cpu-dot8 takes groups of "
                             f"{BLOCK // 2} or {BLOCK} columns or a multiple of {CHUNK}")
        if (gs == BLOCK // 2) != (scale.dtype == torch.float16):
            raise ValueError(f"weight key {key}: torch-cpu-dot8 takes groups of {BLOCK // 2} with e4m3 scales "
                             f"(NVFP4) only, got groups of {gs} with {scale.dtype} scales")
        if key.zero_point == "group":
            if proj.zero is None or tuple(proj.zero.shape) != tuple(scale.shape):
                got = None if proj.zero is None else tuple(proj.zero.shape)
                raise ValueError(f"weight key {key}: wanted zero points on the scale grid {tuple(scale.shape)}, "
                                 f"got {got}")
            zero, zero_const = proj.zero.to(torch.uint8), -1
        else:  # one zero for every code, folded into the dots: none stored (signed int8: as offset binary)
            zero_const = E2M1_ZERO if e2m1 else SIGNED_INT8_ZERO if key.dtype.name == "int8" else key.dtype.bias
            zero = torch.empty(0, dtype=torch.uint8)
        cb = 32 if bits == 4 else CHUNK
        codes = ops.weight_buffer(e * np_ * kp * bits // 8).view(e, np_ // ROWS, kp // CHUNK, ROWS, cb)
        for i in range(e):
            u = proj.weight[i].view(torch.uint8)
            if key.dtype.name == "int8":  # two's complement to offset binary: the top bit flipped
                u = u ^ SIGNED_INT8_ZERO
            if kp != k or np_ != n:
                u = torch.nn.functional.pad(u, (0, (kp - k) * bits // 8, 0, np_ - n))
            if bits == 4:
                # byte j of a row's 64-column chunk: column j low, column 32 + j high. Made from the stored bytes
                # (byte b: column 2b low, 2b + 1 high) without unpacking: a chunk's bytes b and 16 + b give its
                # bytes 2b (both low nibbles) and 2b + 1 (both high ones)
                x = u.view(np_ // ROWS, ROWS, kp // CHUNK, 2, 16).permute(0, 2, 1, 3, 4)
                a, b = x[..., 0, :], x[..., 1, :]
                pair = codes[i].view(np_ // ROWS, kp // CHUNK, ROWS, 16, 2)
                pair[..., 0].copy_((a & 0x0F) | (b << 4))
                pair[..., 1].copy_((a >> 4) | (b & 0xF0))
            else:
                codes[i] = u.view(np_ // ROWS, ROWS, kp // CHUNK, CHUNK).permute(0, 2, 1, 3)
        rows_pad = (0, kp // gs - groups, 0, np_ - n)  # padded rows, and groups of the padded columns: scale 0
        scale = torch.nn.functional.pad(scale, rows_pad)
        if zero_const < 0:
            zero = torch.nn.functional.pad(zero, rows_pad).contiguous()
        if gs == BLOCK // 2:  # a chunk's 4 x 4 scales of a row group side by side (the C++ sidx)
            scale = scale.view(e, np_ // ROWS, ROWS, kp // CHUNK, 4).transpose(2, 3).reshape(e, np_, kp // gs)
        if row_scale is not None:
            row_scale = torch.nn.functional.pad(row_scale, (0, np_ - n)).contiguous()
        return Dot8Proj(codes, scale.contiguous(), zero, n, k, bits, gs, e2m1, zero_const, row_scale,
                        per_token=per_token)

    @staticmethod
    def _build_fp8(proj: ProjectionWeights, key: QuantKey, activation: QuantKey | None, ops) -> Dot8Proj:
        """fp8e4m3 weights with float32 scales per 128x128 block (activations: e4m3 per 128 columns, dynamic) or
        per channel (activations: e4m3 per token, dynamic): the e4m3 bytes as the int8 layout's, the scales per
        row [E, Np, G] over groups of FP8_GROUP columns (per channel: one group)."""
        act = activation
        wg, ag = key.scale.group, None if act is None or not act.quantized else act.scale.group
        block = (wg.rows, wg.cols) == (FP8_GROUP, FP8_GROUP) and ag is not None and (ag.rows, ag.cols) == (1, FP8_GROUP)
        channel = (wg.rows, wg.cols) == (1, -1) and ag is not None and (ag.rows, ag.cols) == (1, -1)
        if not ((block or channel) and key.scale.dtype.name == "float32" and not key.scale.dynamic
                and act.dtype.name == "fp8e4m3" and act.scale.dtype.name == "float32" and act.scale.dynamic):
            raise ValueError(f"torch-cpu-dot8 runs fp8e4m3 weights with float32 scales per 128x128 block or per "
                             f"channel, their activations fp8e4m3 per 128 columns or per token (dynamic); got "
                             f"weight key {key}, activation key {activation}")
        e, n, k = (int(d) for d in proj.weight.shape)
        kp, np_ = -(-k // CHUNK) * CHUNK, -(-n // ROWS) * ROWS
        scale = proj.scale.float()
        want = (e, -(-n // FP8_GROUP), -(-k // FP8_GROUP)) if block else (e, n, 1)
        if tuple(scale.shape) != want:
            raise ValueError(f"weight key {key}: wanted scales {list(want)}, got {list(scale.shape)}")
        if block:
            scale = scale.repeat_interleave(FP8_GROUP, 1)[:, :n]
        gs = min(FP8_GROUP, kp) if block else kp
        codes = ops.weight_buffer(e * np_ * kp).view(e, np_ // ROWS, kp // CHUNK, ROWS, CHUNK)
        for i in range(e):
            u = torch.nn.functional.pad(proj.weight[i].view(torch.uint8), (0, kp - k, 0, np_ - n))  # byte 0: +0.0
            codes[i] = u.view(np_ // ROWS, ROWS, kp // CHUNK, CHUNK).permute(0, 2, 1, 3)
        scale = torch.nn.functional.pad(scale, (0, 0, 0, np_ - n)).contiguous()
        return Dot8Proj(codes, scale, torch.empty(0, dtype=torch.uint8), n, k, 8, gs, fp8=True)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.zero, self.row_scale) if t is not None)

    def gemm(self, ops, a: torch.Tensor, experts: torch.Tensor, row_div: int = 1, act: str | None = None,
             combine: torch.Tensor | None = None, per: int = 1) -> torch.Tensor:
        """Pair i's activation row a[i // row_div] (``act``: act(gate) * up of that [gate | up] row) times expert
        experts[i] (< 0: nothing): [P, N], or with router weights ``combine`` [P] the weighted sum over each
        run of ``per`` pairs, [P / per, N]."""
        if self.fp8:
            return ops.fp8_gemm(a, row_div, experts, self.codes, self.scale, self.n, self.gs, AMAX_FLOOR,
                                ACT_CODES[act], SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, combine, per)
        return ops.gemm(a, row_div, experts, self.codes, self.scale, self.zero, self.zero_const, self.row_scale,
                        self.n, self.bits, self.e2m1, self.gs, ACT_CODES[act], SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT,
                        combine, per, self.per_token)


class Dot8Experts(Experts):
    """Experts whose two GEMMs each run as one compiled call over every (token, expert) pair of the layer; the
    activation function, bias, act-order permutation and router weights around them in float32 torch ops."""

    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        if weights.layout != "nk":
            raise ValueError(f"torch-cpu-dot8 reads layout 'nk', got {weights.layout!r}")
        if weights.device.type != "cpu":
            raise ValueError(f"torch-cpu-dot8 runs on the cpu, the weights are on {weights.device}")
        self._ops = dot8_ops()  # compile (or load) now: a build failure surfaces when the layer is built
        self.w13 = Dot8Proj.build(weights.w13, weights.weight_key, self._ops, weights.activation_key)
        self.w2 = Dot8Proj.build(weights.w2, weights.weight_key, self._ops, weights.activation_key)
        super().__init__(ExpertWeights(weights.w13.with_stand_ins(*PACKED_FIELDS),
                                       weights.w2.with_stand_ins(*PACKED_FIELDS), weights.weight_key,
                                       weights.activation_key, weights.layout), config)
        self._perm = tuple(None if p.perm is None else p.perm.to(torch.int64) for p in (weights.w13, weights.w2))
        self._bias = tuple(None if p.bias is None else p.bias.float() for p in (weights.w13, weights.w2))

    def resident_weight_bytes(self) -> int:
        return self.w13.nbytes() + self.w2.nbytes()

    def _pairs(self, a: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The expert MLP of every pair (activation row a[i] for pair i): [P, H] float32, foreign pairs' rows 0."""
        known = experts.clamp(min=0)
        if self._perm[0] is not None:  # act-order: each pair's row in its expert's column order
            a = a.gather(1, self._perm[0].index_select(0, known))
        h = self.w13.gemm(self._ops, a.contiguous(), experts)
        if self._bias[0] is not None:
            h = h + self._bias[0].index_select(0, known)
        inter = act_and_mul(h, self.config.activation)
        if self._perm[1] is not None:
            inter = inter.gather(1, self._perm[1].index_select(0, known))
        y = self.w2.gemm(self._ops, inter.contiguous(), experts)
        if self._bias[1] is not None:
            y = y + self._bias[1].index_select(0, known)
        if self._bias[0] is not None or self._bias[1] is not None:
            y = y * (experts >= 0).unsqueeze(1)  # a foreign pair's bias is not this rank's to add
        return y

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        m, top_k = topk_ids.shape
        if m == 0:
            return torch.zeros(0, hidden.shape[1], dtype=hidden.dtype)
        experts = topk_ids.reshape(-1).to(torch.int64)
        lo, hi = int(experts.min()), int(experts.max())
        if lo < FOREIGN_EXPERT or hi >= self.weights.num_experts:
            raise ValueError(f"topk_ids must be in [0, {self.weights.num_experts}) or {FOREIGN_EXPERT} (a foreign "
                             f"expert), got values in [{lo}, {hi}]")
        x = hidden.float().contiguous()
        router = topk_weights.reshape(-1).float().contiguous()
        plain = (self._perm[0] is None and self._perm[1] is None and self._bias[0] is None
                 and self._bias[1] is None and not self.config.apply_router_weight_on_input)
        if plain:  # two calls: GEMM1 reads each token's row for its top_k pairs; GEMM2 applies the activation
            # function as it quantises its input and adds each token's pairs by their router weights
            h = self.w13.gemm(self._ops, x, experts, row_div=top_k)
            return self.w2.gemm(self._ops, h, experts, act=self.config.activation, combine=router,
                                per=top_k).to(hidden.dtype)
        if self.config.apply_router_weight_on_input:
            y = self._pairs(x.repeat_interleave(top_k, 0) * router.unsqueeze(1), experts)
        else:
            y = self._pairs(x.repeat_interleave(top_k, 0), experts) * router.unsqueeze(1)
        return y.view(m, top_k, -1).sum(1).to(hidden.dtype)

    def apply_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """Batched format: x [E, T, H], the first expert_num_tokens[e] rows of x[e] are real; no router
        weights (finalize applies them). Returns [E, T, H] in x's dtype; rows past a count are zero."""
        num_experts = self.weights.num_experts
        if x.dim() != 3 or x.shape[0] != num_experts:
            raise ValueError(f"batched input must be [E={num_experts}, T, H], got {tuple(x.shape)}")
        t = int(x.shape[1])
        counts = expert_num_tokens.tolist()
        for e, n in enumerate(counts):
            if n < 0 or n > t:
                raise ValueError(f"expert_num_tokens[{e}] = {n} is outside [0, {t}]")
        rows = torch.cat([torch.arange(e * t, e * t + n) for e, n in enumerate(counts)] or [torch.zeros(0)]).long()
        experts = torch.repeat_interleave(torch.arange(num_experts), torch.tensor(counts, dtype=torch.int64))
        out = torch.zeros(num_experts * t, x.shape[2], dtype=torch.float32)
        if rows.numel():
            out[rows] = self._pairs(x.reshape(num_experts * t, -1).float().index_select(0, rows), experts)
        return out.view(x.shape).to(x.dtype)


class Dot8Linear(Linear):
    """A model's dense linear stored in a scheme this kernel runs, as one projection of one expert: packed once in
    the experts' layout, every call one compiled GEMM over the rows (activations quantised as the experts' are);
    act-order columns gathered first."""

    def __init__(self, weights: ProjectionWeights, weight_key: QuantKey, activation_key: QuantKey) -> None:
        super().__init__(weights, weight_key, activation_key)
        if weights.weight.device.type != "cpu" or weights.weight.shape[0] != 1:
            raise ValueError(f"torch-cpu-dot8's linear takes one projection on the cpu, got weight "
                             f"{list(weights.weight.shape)} on {weights.weight.device}")
        self._ops = dot8_ops()
        self.proj = Dot8Proj.build(weights, weight_key, self._ops, activation_key)
        self._perm = None if weights.perm is None else weights.perm[0].to(torch.int64)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        a = x.float()
        if self._perm is not None:
            a = a.index_select(1, self._perm)
        one_expert = torch.zeros(a.shape[0], dtype=torch.int64)
        return self.proj.gemm(self._ops, a.contiguous(), one_expert).to(x.dtype)

    def resident_weight_bytes(self) -> int:
        return self.proj.nbytes()
