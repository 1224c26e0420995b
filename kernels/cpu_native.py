"""CPU experts with a compiled kernel (``csrc/cpu_moe.cpp``) for the weights torch ships no fast CPU op
for: 8-bit integer weights with group or channel scales, fp8e4m3 weights (per tensor, per channel,
block 128x128, MX 1x32), and int8 activation codes times int8 or int4 weight codes (W8A8, W4A8) with
exact int32 accumulation. Weights stay in checkpoint bytes; routing, bias and activations are the
torch-cpu-packed experts' (this class inherits its ``apply``).

The extension is compiled on first use by ``torch.utils.cpp_extension.load`` (ninja and a C++ compiler;
the kernel spec's ``requires_commands`` lets the oracle fall back where there is none) with ``-O3`` and
the vector ISA torch reports for this CPU (``torch.backends.cpu.get_cpu_capability``), which is part of
the build's name; the build lives under ``$MOE_REGISTRY_CACHE_DIR`` (default ``~/.cache/moe-registry``)
``/torch_extensions``, and torch's file baton in that directory lets one process build while the others
wait. ``-ffast-math`` is never used: it flushes the fp8 subnormals the kernel keeps exact.

Numerics. fp8e4m3 -> float32 is exact, by integer ops (the float32 bits of ``fp8 * 2^-120``, subnormals
included). Up to ``SMALL_M`` rows per expert the register kernel converts each 8 codes once for four rows
of x, sums code x x over a scale group in float32 and multiplies the group's sum by its scale (fp8: x
carries 2^60 and the scale the other 2^60, both checked finite, else the exact path below). More rows:
weight tiles dequantised exactly (``code * scale``, one rounding, as the reference does) into a reused
float32 buffer and multiplied by torch. fp8 activations are quantised in one compiled pass, bit-equal
to ``quant_ref`` (tested). Integer activations: the codes and scales are ``quant_ref.quantize_activation``'s,
the dot of each weight-scale group is exact in int32 (int16 pairs, ``_mm256_madd_epi16``), then
``y = x_scale * sum_g w_scale_g * dot_g`` in float32. fp8 NaN bytes are not special-cased: checkpoints
holding them are refused when they load.

Measured (issue 21): ``python tools/bench_cpu.py --preset qwen3-30b-a3b --tokens 1,16 --threads 2 --kernel
torch-cpu-native,torch-cpu-packed`` on the 2-vCPU AMD EPYC (Zen 3, AVX2+FMA, no AVX-512/VNNI; 32 MiB L3),
torch 2.13.0+cpu, load average 1-3.8 from other jobs; x over the float32 layer timed round-robin in the
same run, min-max (median) of 4 runs, torch-cpu-packed in the same runs in brackets:

======================================  ===============================  ===============================  ======
key pair (scheme)                       M=1                              M=16                             res/pk
======================================  ===============================  ===============================  ======
int8 group(128), W8A16 (gptq-w8a16 +2)  0.48-0.63 (0.61) [0.58-0.77]     0.29-0.38 (0.34) [0.42-0.63]     1.015
fp8 block(128x128) (fp8-block128 +1)    0.69-0.80 (0.80) [1.80-2.05]     0.41-0.62 (0.48) [1.28-1.63]     1.000
fp8 MX 1x32 (modelopt-mxfp8)            0.61-1.02 (0.96) [1.50-3.28]     0.46-0.70 (0.64) [1.22-2.56]     1.091
fp8 channel x fp8 token                 0.55-0.64 (0.57)                 0.38-0.57 (0.41)                 1.000
fp8 tensor x static fp8 tensor          0.51-0.79 (0.72)                 0.35-0.43 (0.42)                 1.003
W8A8 int8 channel x token (ct, quark)   0.55-0.78 (0.73)                 0.40-0.45 (0.40)                 1.000
W8A8 int8 tensor x static tensor        0.47-0.70 (0.64)                 0.33-0.45 (0.39)                 1.003
W4A8 int4 group(128) x token            0.51-0.79 (0.56)                 0.40-0.50 (0.43)                 1.000
======================================  ===============================  ===============================  ======

``--preset small --tokens 16`` (E=8 top-2 H=1024 I=512), 4 runs: int8 group 0.44-0.57 (packed 0.61-0.77),
fp8 block 0.62-0.79 (1.53-1.80), MX 0.64-0.95 (1.26-1.48), W8A8 0.45-0.71, W4A8 0.53-0.80. Per-channel
int8 (not claimed: torch-cpu-packed's int8pack op) measured equal in the same run, 0.44-0.47 at M=1.
One expert's N=1536 K=2048 GEMM at M=1 (12 rotating copies, 1 thread): float32 0.98 ms, int8 group 0.39,
fp8 block 0.42, MX 0.54; the second vCPU adds little (memory and vector-unit bound), so the row loop hands
64-row tasks to whichever thread is free (a fixed half per thread ran 1.8x slower under load). Past about
16 rows per expert the register kernel falls behind torch's float32 matmul (M=24: 1.7x), hence SMALL_M.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from moe_registry_kernels.cpu_packed import CpuPackedExperts, _placeholder
from moe_registry_kernels.dequant import e8m0_to_float, unpack_int4
from moe_registry_kernels.quant_ref import AMAX_FLOOR, fake_quantize_activation, quantize_activation

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


def _cache_root() -> Path:
    """The project's user cache (``MOE_REGISTRY_CACHE_DIR``, else ``$XDG_CACHE_HOME``/``~/.cache``/moe-registry)."""
    if os.environ.get("MOE_REGISTRY_CACHE_DIR"):
        return Path(os.environ["MOE_REGISTRY_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe-registry"


def native_ops():
    """``torch.ops.moe_registry_cpu``: the compiled ops, built once per cache dir, ISA, torch and Python version
    and loaded once per process (a library registers its op namespace once)."""
    with _LOCK:  # threads of this process; other processes wait on torch's baton in the build directory
        if not _OPS:
            from torch.utils.cpp_extension import load

            isa, flags = ISA.get(torch.backends.cpu.get_cpu_capability(), ("scalar", []))
            name = f"moe_registry_cpu_moe_{isa}"
            torch_ver = torch.__version__.split("+")[0].replace(".", "_")
            ver = f"torch{torch_ver}_py{sys.version_info[0]}{sys.version_info[1]}"
            build = _cache_root() / "torch_extensions" / f"{name}_{ver}"
            build.mkdir(parents=True, exist_ok=True)
            try:
                load(name=name, sources=[str(SOURCE)], extra_cflags=["-O3", *flags], build_directory=str(build),
                     verbose=False, is_python_module=False)
            except (RuntimeError, OSError) as err:  # no compiler, a failed build: one line, not a build log
                first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                raise ConfigError(f"kernel torch-cpu-native: building {SOURCE.name} in {build} failed ({first}); "
                                  "wanted a C++ compiler (c++) and ninja on PATH, or pick another kernel "
                                  "(--kernel torch-cpu-packed)") from None
            _OPS.append(torch.ops.moe_registry_cpu)
        return _OPS[0]


def _scale_grid(proj: ProjectionWeights, key: QuantKey, n: int, k: int) -> tuple[torch.Tensor, int, int]:
    """float32 scales [E, R, C] as stored (e8m0 read as 2^(e-127)) and the weight block each covers."""
    assert proj.scale is not None and key.scale is not None
    s = e8m0_to_float(proj.scale) if key.scale.dtype.name == "e8m0" else proj.scale.float()
    rows, cols = int(s.shape[1]), int(s.shape[2])
    g = key.scale.group
    srows = 1 if rows == n else (g.rows if g.rows > 0 else n)
    scols = k if cols == 1 else g.cols
    if -(-k // scols) != cols or -(-n // srows) != rows:
        raise ValueError(f"weight key {key}: a [{rows}, {cols}] scale grid does not cover [N={n}, K={k}] "
                         f"in blocks of {srows} x {scols}")
    return s.contiguous(), srows, scols


def _int8_codes(w: torch.Tensor, key: QuantKey) -> torch.Tensor:
    """int8 or uint8b128 codes [E, N, K] -> int8 real codes (the checkpoint's tensor when already int8)."""
    if w.dtype == torch.int8 and key.dtype.bias == 0:
        return w
    return torch.stack([(w[i].to(torch.int16) - key.dtype.bias).to(torch.int8) for i in range(w.shape[0])])


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


@dataclass(frozen=True)
class _Dequant:
    """int8 or fp8 codes [E, N, K] (int8 bytes) and float32 scales [E, R, C] over srows x scols blocks."""

    codes: torch.Tensor
    scale: torch.Tensor
    srows: int
    scols: int
    fp8: bool
    fold: bool  # fp8: every scale * 2^60 is finite, so the register kernel may fold 2^60 into x and the scale

    @staticmethod
    def build(proj: ProjectionWeights, key: QuantKey) -> _Dequant:
        e, n, k = (int(d) for d in proj.weight.shape)
        scale, srows, scols = _scale_grid(proj, key, n, k)
        fp8 = key.dtype.is_float
        codes = proj.weight.view(torch.int8) if fp8 else _int8_codes(proj.weight, key)
        fold = bool(torch.isfinite(scale * FP8_FOLD).all())
        return _Dequant(codes, scale, srows, scols, fp8, fold)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        ops = native_ops()
        w, s = self.codes[e], self.scale[e]
        if x.shape[0] <= SMALL_M:
            return ops.dq_gemm(x.contiguous(), w, s, self.srows, self.scols, self.fp8, self.fold)
        n, k = int(w.shape[0]), int(w.shape[1])
        step = max(1, min(n, TILE_ELEMENTS // k))
        tile = torch.empty(step, k, dtype=torch.float32)
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        for r in range(0, n, step):
            t = min(step, n - r)
            ops.dq_rows(w, s, self.srows, self.scols, self.fp8, r, tile[:t])
            torch.mm(x, tile[:t].T, out=out[:, r:r + t])
        return out


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
        return _IntCodes(_int8_codes(proj.weight, key), 8, scale, srows, scols)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def matmul(self, e: int, q: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        if self.bits == 4 and q.shape[1] % 32:
            q = torch.nn.functional.pad(q, (0, 32 - q.shape[1] % 32))
        return native_ops().int_gemm(q, xs, self.codes[e], self.bits, self.scale[e], self.srows, self.scols)


def _build_proj(proj: ProjectionWeights, key: QuantKey, activation: QuantKey) -> _Dequant | _IntCodes:
    if not key.quantized or key.zero_point != "none" or key.scale2 is not None or key.dtype.name == "e2m1":
        raise ValueError(f"torch-cpu-native does not run weight key {key}")
    if activation.quantized and activation.dtype.name == "int8":
        return _IntCodes.build(proj, key)
    if key.dtype.bits != 8:
        raise ValueError(f"torch-cpu-native runs 4-bit weights only with int8 activations, got {key}")
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
        Experts.__init__(self, ExpertWeights(_placeholder(weights.w13), _placeholder(weights.w2), wkey, akey,
                                             weights.layout), config)
        self._perm = tuple(None if p.perm is None else p.perm.to(torch.int64) for p in (weights.w13, weights.w2))
        self._bias = tuple(None if p.bias is None else p.bias.float() for p in (weights.w13, weights.w2))
        self._input_scale = (weights.w13.input_scale, weights.w2.input_scale)

    def _fake_quant(self, which: int, x: torch.Tensor) -> torch.Tensor:
        """Activations as the GEMM sees them, float32: fp8 per token, per group or static per tensor in one
        compiled pass (bit-equal to quant_ref's, tested), other keys through quant_ref."""
        key = self.weights.activation_key
        if not key.quantized:
            return x.float()
        g, static = key.scale.group, self._input_scale[which]
        if key.dtype.name == "fp8e4m3" and key.scale.dtype.name == "float32" and (
                (key.scale.dynamic and g.rows in (1, -1) and not (g.rows == -1 and g.cols == -1))
                or (not key.scale.dynamic and static is not None and static.numel() == 1)):
            cols = int(x.shape[1]) if g.cols == -1 else g.cols
            fixed = 0.0 if key.scale.dynamic else float(static.reshape(-1)[0])
            return native_ops().fp8_fake_quant(x.float().contiguous(), cols, AMAX_FLOOR, fixed)
        return fake_quantize_activation(x, key, static, torch.float32)

    def _gemm(self, which: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 (one expert's rows) -> [T, N] float32: activation quantisation (the reference's),
        act-order permutation, the compiled GEMM, bias."""
        proj = self.w13 if which == 0 else self.w2
        key = self.weights.activation_key
        perm = self._perm[which]
        if isinstance(proj, _IntCodes):
            qa = quantize_activation(x.float(), key, self._input_scale[which])
            q = qa.q if perm is None else qa.q.index_select(1, perm[e])
            xs = qa.scale.float().reshape(-1).expand(int(q.shape[0])).contiguous()
            y = proj.matmul(e, q.contiguous(), xs)
        else:
            x = self._fake_quant(which, x)
            y = proj.matmul(e, x if perm is None else x.index_select(1, perm[e]))
        bias = self._bias[which]
        return y if bias is None else y + bias[e]
