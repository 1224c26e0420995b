"""CPU experts with a compiled kernel (``csrc/cpu_moe.cpp``) for the weights torch ships no fast CPU op
for: 8-bit integer weights with group or channel scales (uint8 with a zero point per group too), fp8e4m3
weights (per tensor, per channel, block 128x128, MX 1x32), FP4 (e2m1) weights with e8m0 scales per 32 (MXFP4)
or e4m3 scales per 16 and a float32 second-level scale (NVFP4), and int8 activation codes times int8 or int4
weight codes (W8A8, W4A8) with exact int32 accumulation; and 4-bit integer weights on 16- or 32-bit activations
(AWQ, GPTQ), whose one torch CPU op is fast only on bfloat16 inputs and rounds its output to bfloat16: here the
nibbles are decoded by a byte shuffle and summed in float32, the reference's numbers in float16 and float32
too. Weights stay in checkpoint bytes (uint8 codes and zero points as ``value - 128``, one byte each; int4
zero points as ``zero - 8 + 128``; MX and NVFP4 scales as their e8m0 / e4m3 bytes); routing, bias
and activations are the torch-cpu-packed experts' (this class inherits its ``apply``), except that a
dynamic per-tensor activation scale (fp8-w8a8-dynamic) spans the layer: one amax over the whole GEMM1 input,
one over all routed intermediates (every GEMM1 first), as the reference and vLLM compute it; each GEMM then
takes the static per-tensor path.

The extension is compiled on first use by ``torch.utils.cpp_extension.load`` (ninja and a C++ compiler;
the kernel spec's ``requires_commands`` lets the oracle fall back where there is none) with ``-O3``,
``-fopenmp`` and the vector ISA torch reports for this CPU (``torch.backends.cpu.get_cpu_capability``), which
is part of the build's name; ``cpu_build`` keeps the library under ``$MOE_REGISTRY_CACHE_DIR`` (default
``~/.cache/moe-registry``) ``/extensions``, named by a digest of the source, flags, torch and Python, loads it
without a lock once built, and lets one process build it (an flock its death releases) while the others
wait. ``-fopenmp`` matters: ``at::parallel_for`` is inlined from ATen's headers and runs on one thread in a
build without it (the first builds did: their "the second vCPU adds little" was that); the extension's
``libgomp.so.1`` is the one torch has loaded. ``-ffast-math`` is never used: it flushes the fp8 subnormals
the kernel keeps exact.

Numerics. fp8e4m3 -> float32 is exact, by integer ops (the float32 bits of ``fp8 * 2^-120``, subnormals
included); e2m1 -> twice its value as int8 by one byte shuffle over a 16-entry table, exact (the 1/2 joins
the row's final multiplier); e8m0 and e4m3 scales are decoded exactly, once per group (a scalar decode). Up to
``SMALL_M`` rows per expert the register kernel converts each 8 codes once for up to four rows of x (one or
two rows: four independent sums per row, so decode is not bound by the FMA latency), sums code x x over a
scale group in float32 and multiplies the group's sum by its scale (fp8: x carries 2^60 and the scale the
other 2^60, both checked finite, else the exact path below); a zero point subtracts ``zero * sum(x over the
group)`` before the scale; NVFP4's second-level scale multiplies each output once. More rows: weight tiles
dequantised as the reference dequantises (one rounding: ``code * scale``, ``(code - zero) * scale``,
``e2m1 * (scale * scale2)``; bit-equal, tested for every fp8 byte, every e2m1 code and every e8m0 / e4m3
scale byte) into a reused float32 buffer and multiplied by torch. fp8 activations are quantised in one
compiled pass, bit-equal to ``quant_ref`` (tested). Integer activations: the codes and scales are
``quant_ref.quantize_activation``'s, the dot of each weight-scale group is exact in int32 (int16 pairs,
``_mm256_madd_epi16``), then ``y = x_scale * sum_g w_scale_g * dot_g`` in float32. fp8 and e8m0 NaN bytes
are not special-cased: checkpoints holding them are refused when they load.

Measured with ``python tools/bench_cpu.py --preset qwen3-30b-a3b --tokens 1,16 --threads 2
--kernel torch-cpu-native,torch-cpu-packed --json``, 3 runs, on the 2-vCPU AMD EPYC (family 25 model 17,
Zen 4: AVX-512 present, this build uses AVX2+FMA; L2 1 MiB per core, L3 32 MiB), torch 2.13.0+cpu, load
average 1.5-2 from other jobs; x over the float32 layer (9.2-10.7 ms at M=1, 131-149 ms at M=16) timed
round-robin in the same run, min-max (median), torch-cpu-packed in the same runs in brackets:

======================================  ===============================  ===============================  ======
key pair (scheme)                       M=1                              M=16                             res/pk
======================================  ===============================  ===============================  ======
int8 group(128), W8A16 (gptq-w8a16 +2)  0.22-0.23 (0.22) [0.43-0.50]     0.17-0.18 (0.17) [0.33-0.40]     1.015
uint8 group(128) + zp (ct-w8a16-asym+2) 0.24-0.24 (0.24)                 0.18-0.18 (0.18)                 1.015
MXFP4 e2m1 x e8m0/32 (mxfp4 +2)         0.31-0.34 (0.31)                 0.25-0.27 (0.25)                 1.000
NVFP4 e2m1 x e4m3/16 x f32 (nvfp4 +2)   0.35-0.40 (0.36)                 0.29-0.33 (0.29)                 1.005
fp8 block(128x128) (fp8-block128 +1)    0.27-0.29 (0.28) [1.07-1.59]     0.21-0.22 (0.21) [0.83-1.28]     1.000
fp8 MX 1x32 (modelopt-mxfp8)            0.32-0.34 (0.33) [1.12-3.59]     0.26-0.27 (0.26) [0.95-3.37]     1.000
fp8 channel x fp8 token                 0.27-0.28 (0.28)                 0.21-0.21 (0.21)                 1.000
fp8 tensor x static fp8 tensor          0.28-0.29 (0.28)                 0.21-0.22 (0.21)                 1.003
fp8 tensor x dynamic fp8 tensor         0.29-0.31 (0.30)                 0.21-0.23 (0.22)                 1.003
W8A8 int8 channel x token (ct, quark)   0.32-0.32 (0.32)                 0.22-0.24 (0.22)                 1.000
W8A8 int8 tensor x static tensor        0.26-0.28 (0.27)                 0.19-0.20 (0.19)                 1.003
W4A8 int4 group(128) x token            0.29-0.40 (0.30)                 0.21-0.23 (0.21)                 1.000
======================================  ===============================  ===============================  ======

``--preset small --tokens 16`` (E=8 top-2 H=1024 I=512), 3 runs: int8 group 0.32-0.32 (packed 0.52-0.55),
uint8 + zp 0.35-0.37, MXFP4 0.41-0.43, NVFP4 0.53-0.53, fp8 block 0.43-0.44 (packed 1.21-1.24), MX fp8
0.41-0.42 (packed 1.02-1.05), fp8 tensor x dynamic tensor 0.46-0.47, W8A8 0.36-0.45, W4A8 0.47-0.47.
One expert's N=1536 K=2048 GEMM (12 rotating copies, 2 threads), x over float32 ``x @ W.T`` (0.70 ms at
M=1): M=1 int8 group 0.16, MX fp8 0.29, MXFP4 0.31, NVFP4 0.33 (1 thread: int8 0.28, MXFP4 0.52); the row
loop hands 64-row tasks to whichever thread is free. Rows per expert, register kernel / dequantised tiles:
M=8 int8 0.46 / 1.23, NVFP4 0.76 / 1.22; M=16 int8 0.71 / 1.16, NVFP4 1.22 / 1.16; M=32 int8 1.07 / 1.14,
NVFP4 1.86 / 1.13, hence SMALL_M = 16 (the layer benchmarks above route about one row to an expert at M=16
of the Qwen3 shape, four in the small one).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from moe_registry_kernels.activations import act_and_mul
from moe_registry_kernels.cpu_build import BuildError, ExtensionError, Flags, load_extension
from moe_registry_kernels.cpu_packed import PACKED_FIELDS, CpuPackedExperts
from moe_registry_kernels.dequant import e8m0_to_float, unpack_int4
from moe_registry_kernels.quant_ref import (
    AMAX_FLOOR,
    FP8_MAX,
    fake_quantize_activation,
    per_tensor_dynamic,
    quantize_activation,
)

from moe_registry.core.errors import ConfigError
from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import Experts, ExpertsConfig

__all__ = ["NativeExperts", "native_ops"]

SOURCE = Path(__file__).parent / "csrc" / "cpu_moe.cpp"
SMALL_M = 16  # rows per expert up to which the register kernel runs; more: dequantised tiles and torch.mm
TILE_ELEMENTS = 1 << 20  # float32 tile for the many-rows path (4 MiB)
FP8_FOLD = 2.0 ** 60  # fp8 codes convert to fp8 * 2^-120: x carries 2^60 of it, the group's scale the other 2^60
# torch's CPU capability -> (the build's ISA name, its flags); the source uses AVX2 (+FMA) at most
ISA = {"AVX2": ("avx2", ["-mavx2", "-mfma", "-mf16c"]), "AVX512": ("avx2", ["-mavx2", "-mfma", "-mf16c"])}
_LOCK = threading.Lock()
_OPS: list = []  # the loaded op namespace, once per process


def cache_root() -> Path:
    """The project's user cache (``MOE_REGISTRY_CACHE_DIR``, else ``$XDG_CACHE_HOME``/``~/.cache``/moe-registry)."""
    if os.environ.get("MOE_REGISTRY_CACHE_DIR"):
        return Path(os.environ["MOE_REGISTRY_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-registry"


def native_ops():
    """``torch.ops.moe_registry_cpu``: the compiled ops, built once per source, ISA, flags, torch and Python version
    (``cpu_build``: found without a lock, built by one process at a time, renamed into place) and loaded once per
    process (a library registers its op namespace once)."""
    with _LOCK:  # threads of this process; other processes share cpu_build's file lock
        if not _OPS:
            isa, flags = ISA.get(torch.backends.cpu.get_cpu_capability(), ("scalar", []))
            name = f"moe_registry_cpu_moe_{isa}"
            # OpenMP where torch has it (at::parallel_for's threads); a compiler that refuses -fopenmp (Apple's
            # clang) gets a second, single-threaded build rather than no kernel
            omp = [("-fopenmp",), ()] if torch.backends.openmp.is_available() else [()]
            variants = [Flags(("-O3", *o, *flags), o) for o in omp]
            cache = cache_root() / "extensions"
            try:
                load_extension(name, [SOURCE], variants, cache, what="the torch-cpu-native kernel",
                               why=", the kernel chosen for this layer (--kernel torch-cpu-packed needs no compiler)")
            except BuildError as err:  # no compiler, a failed build: one line, not a build log
                raise ConfigError(f"kernel torch-cpu-native: building {SOURCE.name} in {cache} failed ({err}); "
                                  "wanted a C++ compiler (c++) and ninja on PATH, or pick another kernel "
                                  "(--kernel torch-cpu-packed)") from None
            except ExtensionError as err:  # another process's build held too long, a bad wait bound
                raise ConfigError(f"kernel torch-cpu-native: {err}") from None
            _OPS.append(torch.ops.moe_registry_cpu)
        return _OPS[0]


def _scale_grid(proj: ProjectionWeights, key: QuantKey, n: int, k: int,
                keep_bytes: bool = False) -> tuple[torch.Tensor, int, int]:
    """Scales [E, R, C] as stored and the weight block each covers: float32 (e8m0 read as 2^(e-127)), or with
    ``keep_bytes`` e8m0 as its uint8 bytes and e4m3 as float8_e4m3fn (decoded in registers)."""
    assert proj.scale is not None and key.scale is not None
    name = key.scale.dtype.name
    if keep_bytes and name in ("e8m0", "fp8e4m3"):
        s = proj.scale.view(torch.uint8) if name == "e8m0" else proj.scale.view(torch.float8_e4m3fn)
    else:
        s = e8m0_to_float(proj.scale) if name == "e8m0" else proj.scale.float()
    rows, cols = int(s.shape[1]), int(s.shape[2])
    g = key.scale.group
    srows = 1 if rows == n else (g.rows if g.rows > 0 else n)
    scols = k if cols == 1 else g.cols
    if -(-k // scols) != cols or -(-n // srows) != rows:
        raise ValueError(f"weight key {key}: a [{rows}, {cols}] scale grid does not cover [N={n}, K={k}] "
                         f"in blocks of {srows} x {scols}")
    return s.contiguous(), srows, scols


def _int8_codes(w: torch.Tensor, offset: int) -> torch.Tensor:
    """Byte codes [E, N, K] minus ``offset`` as int8 (uint8b128: the real codes; uint8 with zero points: code -
    128, the zero points likewise), one expert at a time; the checkpoint's tensor when already int8 at 0."""
    if w.dtype == torch.int8 and offset == 0:
        return w
    return torch.stack([(w[i].to(torch.int16) - offset).to(torch.int8) for i in range(w.shape[0])])


def _pack_int4(w: torch.Tensor, key: QuantKey) -> torch.Tensor:
    """Checkpoint 4-bit codes [E, N, K/2] -> uint8 [E, N, Kp/2] in the kernel's order (Kp: K rounded up to 32,
    padded with zero values): per 32 codes, byte j holds stored code j (low nibble) and j + 16 (high);
    stored code = real + 8."""
    out = []
    for i in range(w.shape[0]):
        q = unpack_int4(w[i:i + 1])[0].to(torch.int16) - key.dtype.bias + 8  # uint4b8 stored codes 0..15
        n, k = q.shape
        kp = -(-k // 32) * 32
        q = torch.nn.functional.pad(q, (0, kp - k), value=8)  # code 8: the value 0 (x is padded with 0 too)
        b = q.view(n, kp // 32, 2, 16)
        out.append((b[:, :, 0] | (b[:, :, 1] << 4)).to(torch.uint8).reshape(n, k // 2))
    return torch.stack(out)


# weight code kinds of the compiled dq_gemm / dq_rows (their `kind` argument)
KIND_INT8, KIND_FP8, KIND_FP4, KIND_INT4 = 0, 1, 2, 3
# int4 zero points kept as zero - 8 + 128: the kernel subtracts 128 (as from uint8's) and decodes nibble - 8
INT4_ZERO_OFFSET = 120


@dataclass(frozen=True)
class _Dequant:
    """Weight codes [E, N, K] (int8 bytes; uint8 checkpoints as code - 128; e2m1: packed [E, N, K/2]) with
    scales [E, R, C] over srows x scols blocks (float32, e8m0 bytes or e4m3 bytes), optional uint8 zero points
    on the scale grid and a float32 second-level scale per output row [E, N]."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    scale2: torch.Tensor | None
    srows: int
    scols: int
    kind: int
    fold: bool  # fp8: every scale * 2^60 is finite, so the register kernel may fold 2^60 into x and the scale

    @staticmethod
    def build(proj: ProjectionWeights, key: QuantKey) -> _Dequant:
        e, n, kw = (int(d) for d in proj.weight.shape)
        fp4 = key.dtype.name == "e2m1"
        int4 = key.dtype.bits == 4 and not key.dtype.is_float
        scale, srows, scols = _scale_grid(proj, key, n, kw * 2 if fp4 or int4 else kw, keep_bytes=True)
        zero = scale2 = None
        if fp4:
            kind, codes = KIND_FP4, proj.weight.view(torch.uint8)
        elif int4:  # the nk layout's bytes as they are (low nibble: the even column)
            if key.dtype.name not in ("uint4", "uint4b8"):
                raise ValueError(f"torch-cpu-native decodes uint4 and uint4b8 nibbles, got weight key {key}")
            kind, codes = KIND_INT4, proj.weight.view(torch.uint8)
            if key.zero_point == "group":
                zshape = None if proj.zero is None else tuple(proj.zero.shape)
                if zshape != tuple(scale.shape):
                    raise ValueError(f"weight key {key}: wanted zero points on the scale grid {tuple(scale.shape)}, "
                                     f"got {zshape}")
                zero = (proj.zero.to(torch.int16) + INT4_ZERO_OFFSET).to(torch.uint8).contiguous()
        elif key.dtype.is_float:
            kind, codes = KIND_FP8, proj.weight.view(torch.int8)
        else:
            kind = KIND_INT8
            if key.zero_point == "group":  # (code - zero) = (code - 128) - (zero - 128): both kept in one byte
                zshape = None if proj.zero is None else tuple(proj.zero.shape)
                if proj.weight.dtype != torch.uint8 or zshape != tuple(scale.shape):
                    raise ValueError(f"weight key {key}: wanted uint8 codes and uint8 zero points on the scale grid "
                                     f"{tuple(scale.shape)}, got {proj.weight.dtype} codes, zero points {zshape}")
                codes = _int8_codes(proj.weight, 128)
                zero = proj.zero.contiguous()
            else:
                codes = _int8_codes(proj.weight, key.dtype.bias)
        if key.scale2 is not None:
            if proj.scale2 is None:
                raise ValueError(f"weight key {key} has a second-level scale but the projection has no scale2")
            scale2 = proj.scale2.float().reshape(e, n).contiguous()
        fold = kind != KIND_FP8 or bool(torch.isfinite(_float_scale(scale) * FP8_FOLD).all())
        return _Dequant(codes, scale, zero, scale2, srows, scols, kind, fold)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.zero, self.scale2) if t is not None)

    def _args(self, e: int) -> tuple:
        return (self.codes[e], self.scale[e], None if self.zero is None else self.zero[e],
                None if self.scale2 is None else self.scale2[e], self.srows, self.scols, self.kind)

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        ops = native_ops()
        if x.shape[0] <= SMALL_M:
            return ops.dq_gemm(x.contiguous(), *self._args(e), self.fold)
        n, k = int(self.codes.shape[1]), int(x.shape[1])
        step = max(1, min(n, TILE_ELEMENTS // k))
        tile = torch.empty(step, k, dtype=torch.float32)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for r in range(0, n, step):
            t = min(step, n - r)
            ops.dq_rows(*self._args(e), r, tile[:t])
            torch.mm(x, tile[:t].T, out=out[:, r:r + t])
        return out


def _float_scale(scale: torch.Tensor) -> torch.Tensor:
    """A scale grid as float32 values (e8m0 bytes read as 2^(e-127))."""
    return e8m0_to_float(scale) if scale.dtype == torch.uint8 else scale.float()


@dataclass(frozen=True)
class _IntCodes:
    """int8 [E, N, K] or packed int4 [E, N, K/2] weight codes with float32 scales [E, R, C] (W8A8, W4A8)."""

    codes: torch.Tensor
    bits: int
    scale: torch.Tensor
    srows: int
    scols: int

    @staticmethod
    def build(proj: ProjectionWeights, key: QuantKey) -> _IntCodes:
        e, n, kw = (int(d) for d in proj.weight.shape)
        k = kw * 2 if key.dtype.bits == 4 else kw
        scale, srows, scols = _scale_grid(proj, key, n, k)
        if key.dtype.bits == 4:
            kp = -(-k // 32) * 32
            if scols % 32 and scols != k:
                raise ValueError(f"weight key {key}: groups of {scols} columns; the int4 kernel needs multiples of 32")
            return _IntCodes(_pack_int4(proj.weight, key), 4, scale, srows, kp if scols == k else scols)
        return _IntCodes(_int8_codes(proj.weight, key.dtype.bias), 8, scale, srows, scols)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def matmul(self, e: int, q: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        if self.bits == 4 and q.shape[1] % 32:
            q = torch.nn.functional.pad(q, (0, 32 - q.shape[1] % 32))
        return native_ops().int_gemm(q, xs, self.codes[e], self.bits, self.scale[e], self.srows, self.scols)


def _build_proj(proj: ProjectionWeights, key: QuantKey, activation: QuantKey) -> _Dequant | _IntCodes:
    if not key.quantized:
        raise ValueError(f"torch-cpu-native does not run weight key {key}")
    if activation.quantized and activation.dtype.name == "int8":
        if key.zero_point != "none" or key.scale2 is not None or key.dtype.name == "e2m1":
            raise ValueError(f"torch-cpu-native does not run weight key {key} with int8 activations")
        return _IntCodes.build(proj, key)
    if key.dtype.bits not in (4, 8):
        raise ValueError(f"torch-cpu-native does not run weight key {key}")
    return _Dequant.build(proj, key)


class NativeExperts(CpuPackedExperts):
    """Compiled-kernel CPU experts (see the module docstring); routing, bias and activation functions are
    :class:`CpuPackedExperts`' (inherited ``apply``/``apply_batched``), the projections ``w13``/``w2`` ours."""

    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        if weights.layout != "nk":
            raise ValueError(f"torch-cpu-native reads layout 'nk', got {weights.layout!r}")
        if weights.device.type != "cpu":
            raise ValueError(f"torch-cpu-native runs on the cpu, the weights are on {weights.device}")
        native_ops()  # compile (or load) now: a build failure surfaces when the layer is built, not mid-forward
        wkey, akey = weights.weight_key, weights.activation_key
        self.w13 = _build_proj(weights.w13, wkey, akey)
        self.w2 = _build_proj(weights.w2, wkey, akey)
        Experts.__init__(self, ExpertWeights(weights.w13.with_stand_ins(*PACKED_FIELDS),
                                             weights.w2.with_stand_ins(*PACKED_FIELDS), wkey, akey,
                                             weights.layout), config)
        self._perm = tuple(None if p.perm is None else p.perm.to(torch.int64) for p in (weights.w13, weights.w2))
        self._bias = tuple(None if p.bias is None else p.bias.float() for p in (weights.w13, weights.w2))
        self._input_scale = (weights.w13.input_scale, weights.w2.input_scale)

    def _mlps(self, jobs: Iterable[tuple[int, torch.Tensor]],
              whole: Callable[[], torch.Tensor] | None = None) -> Iterator[torch.Tensor]:
        """Per-tensor dynamic activations: every expert's GEMM1 on one scale from the whole GEMM1 input, then
        every GEMM2 on one scale from all intermediates (each then the static per-tensor path); this alone
        holds every expert's rows at once."""
        if not per_tensor_dynamic(self.weights.activation_key):
            return super()._mlps(jobs, whole)
        jobs = list(jobs)
        if not jobs:
            return iter(())
        s1 = _tensor_scale(whole() if whole is not None else torch.cat([x for _, x in jobs]))
        inter = [act_and_mul(self._gemm(0, e, x, s1), self.config.activation) for e, x in jobs]
        s2 = _tensor_scale(torch.cat(inter))
        return iter([self._gemm(1, e, a, s2) for (e, _), a in zip(jobs, inter, strict=True)])

    def _fake_quant(self, which: int, x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Activations as the GEMM sees them, float32: fp8 per token, per group or per tensor (static, or a
        layer-wide dynamic ``tensor_scale``) in one compiled pass (bit-equal to quant_ref's, tested), other
        keys through quant_ref."""
        key = self.weights.activation_key
        if not key.quantized:
            return x.float()
        g = key.scale.group
        static = tensor_scale if tensor_scale is not None else self._input_scale[which]
        per_tensor = tensor_scale is not None or (not key.scale.dynamic and static is not None and static.numel() == 1)
        if key.dtype.name == "fp8e4m3" and key.scale.dtype.name == "float32" and (
                per_tensor or (key.scale.dynamic and g.rows in (1, -1) and not (g.rows == -1 and g.cols == -1))):
            cols = int(x.shape[1]) if g.cols == -1 or per_tensor else g.cols
            fixed = float(static.reshape(-1)[0]) if per_tensor else 0.0
            return native_ops().fp8_fake_quant(x.float().contiguous(), cols, AMAX_FLOOR, fixed)
        return fake_quantize_activation(x, key, static, torch.float32)

    def _gemm(self, which: int, e: int, x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] float32 (one expert's rows) -> [T, N] float32: activation quantisation (the reference's;
        ``tensor_scale``: a layer-wide dynamic per-tensor scale), act-order permutation, the compiled GEMM, bias."""
        proj = self.w13 if which == 0 else self.w2
        key = self.weights.activation_key
        perm = self._perm[which]
        if isinstance(proj, _IntCodes):
            qa = quantize_activation(x.float(), key, self._input_scale[which])
            q = qa.q if perm is None else qa.q.index_select(1, perm[e])
            xs = qa.scale.float().reshape(-1).expand(int(q.shape[0])).contiguous()
            y = proj.matmul(e, q.contiguous(), xs)
        else:
            x = self._fake_quant(which, x, tensor_scale)
            y = proj.matmul(e, x if perm is None else x.index_select(1, perm[e]))
        bias = self._bias[which]
        return y if bias is None else y + bias[e]


def _tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The dynamic per-tensor fp8 scale of x, float32 [1], as quant_ref.quantize_activation computes it."""
    return x.float().abs().amax().reshape(1).clamp(min=AMAX_FLOOR) / FP8_MAX
