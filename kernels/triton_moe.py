"""Fused MoE in Triton: one GEMM kernel over expert-sorted token blocks, for every weight key of
the shipped schemes, and the Experts classes built on it.

The layer (standard format) is::

    align(topk_ids) (+ quantise(hidden), same launch at decode)
        -> GEMM1 (w13, + bias, act_and_mul in its epilogue) -> quantise?
        -> GEMM2 (w2, + bias, × router weight, split-K) -> sum over top-k (and splits)

Weights are in the ``nk`` layout of :mod:`moe_registry.formats.weights` ([E, N, K], K contiguous), which
is also what fp8 and int8 tensor-core dots want for B. The GEMM kernel is specialised by
constexprs that say how a weight tile becomes something a ``tl.dot`` takes:

- 16-bit weights: used as they are.
- integer codes (uint4 with zero points, uint4b8, int4, uint8b128, int8 as W8A16): 4-bit tiles are
  loaded once as bytes and split into low (even k) and high (odd k) nibbles, each multiplied
  with the matching even/odd half of the activation tile, so no byte is loaded twice; one scale
  (and zero) per group and column is loaded per tile and broadcast over the group's rows.
- W8A8 int8: int8 × int8 dot accumulating in int32; per-token and per-channel scales are applied
  once after the K loop.
- fp8 with e8m0 per-32 scales (MXFP8): dequantised to the 16-bit activation dtype in registers
  (Hopper has no MX dot); MXFP8 activations, when the scheme quantises them, are dequantised the
  same way, so the numerics are the scheme's.
- fp8 with 128×128 block scales (W8A8): fp8 dot per K tile, scaled there by the token-group and
  weight-block scales (they change every 128 columns).

Nothing here reads a device value on the host: buffers are sized by worst cases and kernels
skip blocks past ``num_tokens_post_padded``, so the layer can be captured in a CUDA graph.
"""

import contextlib
import contextvars
import functools
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from moe_registry_kernels import triton_ops

from moe_registry.core.keys import QuantKey, parse_quant_key
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.experts import Experts, ExpertsConfig

__all__ = [
    "Scheme",
    "scheme_from_keys",
    "get_config",
    "fused_experts",
    "fused_experts_batched",
    "TritonExperts",
    "TritonBatchedExperts",
]

log = logging.getLogger("moe_registry")
CONFIG_DIR = Path(__file__).parent / "configs"
# GEMM1 leaves per-token int8 intermediates their amax in pieces (see _amax_pieces_shape): up to
# this many tokens, and past them where act_quant would cut rows into more than this many chunks
AMAX_PIECES = True
AMAX_PIECES_MAX_TOKENS = 64
AMAX_PIECES_MIN_CHUNKS = 8
# a tuned entry stands for token counts up to this factor away from its own (tables are tuned at
# 1, 8, 64, 512, 4096: every count lands on one); farther counts take the defaults
TUNED_REACH = 4.0


# ---------------------------------------------------------------------------------------------
# what the kernel needs to know about the keys


@dataclass(frozen=True)
class Scheme:
    """The weight and activation keys, read as the kernel's constexpr choices."""

    weight_type: str  # float | uint4 | uint4b8 | int4 | uint8 | uint8b128 | int8 | fp8e4m3
    weight_scale: str  # none | group | channel (also per-tensor, stored [E, N, 1]) | block | mx
    weight_group: int  # input columns sharing a weight scale (group, block, mx); 0 otherwise
    weight_group_n: int  # output rows sharing a weight scale (block); 1 otherwise
    act_quant: str  # none | int8_token | int8_static | fp8_group | mxfp8 (triton_ops.QUANT_MODES)
    act_group: int  # input columns sharing an activation scale (fp8_group, mxfp8); 0 otherwise

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per byte."""
        return self.weight_type in ("uint4", "uint4b8", "int4")

    @property
    def zero_code(self) -> int:
        """The code of 0 for types with a fixed bias (signed int4 nibbles and int8 bytes are read as
        offset binary: xor-ed with 8 and 0x80 first)."""
        return {"uint4b8": 8, "int4": 8, "uint8b128": 128, "int8": 128}.get(self.weight_type, 0)

    @property
    def paired_dequant(self) -> bool:
        """Whether the dequantisation has a paired 16-bit PTX form (_nibble_asm, _byte_asm): 4-bit
        codes, or 8-bit integer codes whose scales are 16-bit (group) or applied to the dot's
        result (channel); float32 block scales would be rounded by it."""
        return self.packed or (self.weight_type in ("uint8", "uint8b128", "int8")
                               and self.weight_scale in ("group", "channel"))

    @property
    def dot(self) -> str:
        """The tensor-core dot: int8, fp8, or float (16-bit, after dequantising in registers)."""
        if self.act_quant.startswith("int8"):
            return "int8"
        return "fp8" if self.act_quant == "fp8_group" else "float"


def _weight_scale(key: QuantKey) -> tuple[str, int, int]:
    if not key.quantized:
        return "none", 0, 1
    group = key.scale.group
    if key.scale.dtype.name == "e8m0":
        return "mx", group.cols, 1
    if group.rows not in (1, -1):
        return "block", group.cols, group.rows
    if group.cols == -1:
        return "channel", 0, 1
    return "group", group.cols, 1


def _act_quant(key: QuantKey) -> tuple[str, int]:
    if not key.quantized:
        return "none", 0
    spec, name = key.scale, key.dtype.name
    if name == "int8" and spec.dynamic and spec.group.cols == -1 and spec.group.rows == 1:
        return "int8_token", 0
    if name == "int8" and not spec.dynamic and spec.group.rows == -1:
        return "int8_static", 0
    if name == "fp8e4m3" and spec.dtype.name == "e8m0" and spec.dynamic and spec.group.cols == 32:
        return "mxfp8", 32
    if name == "fp8e4m3" and spec.dtype.name == "float32" and spec.dynamic and spec.group.rows == 1 \
            and spec.group.cols > 0:
        return "fp8_group", spec.group.cols
    raise ValueError(f"the Triton MoE kernel has no activation quantisation for key {key}")


@functools.cache
def scheme_from_keys(weight_key: str, activation_key: str) -> Scheme:
    """Read the keys (string form) as kernel choices; ValueError naming the key it cannot run."""
    wk, ak = parse_quant_key(weight_key), parse_quant_key(activation_key)
    wtype = wk.dtype.name if wk.quantized else "float"
    wscale, wgroup, wgroup_n = _weight_scale(wk)
    aquant, agroup = _act_quant(ak)
    scheme = Scheme(wtype, wscale, wgroup, wgroup_n, aquant, agroup)
    for name, value in (("weight", wgroup), ("activation", agroup)):
        if value and value & (value - 1):
            raise ValueError(f"{name} group {value} is not a power of two (keys {weight_key!r}, {activation_key!r})")
    if scheme.dot == "int8" and (wtype != "int8" or wscale != "channel"):
        raise ValueError(f"int8 activations need int8 weights with per-channel/tensor scales, got {weight_key!r}")
    if scheme.dot == "fp8" and (wtype != "fp8e4m3" or wscale != "block" or wgroup % agroup):
        raise ValueError(f"fp8 group activations need fp8 weights with block scales, got {weight_key!r}")
    if wtype == "fp8e4m3" and wscale not in ("mx", "block"):
        raise ValueError(f"fp8 weights need e8m0 per-32 or 128x128 block scales here, got {weight_key!r}")
    if wtype in ("uint4", "uint8") and wk.zero_point != "group":
        raise ValueError(f"{wtype} weights need zero points (zp:group), got {weight_key!r}")
    return scheme


# ---------------------------------------------------------------------------------------------
# tile configurations


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def config_file(weight_key: QuantKey | str, activation_key: QuantKey | str, device_name: str) -> Path:
    """Where tuned configs for a scheme on a device live: configs/<device>__<weight>__<act>.json
    (the activation key is part of it: int8 and fp8 dots are tuned apart from 16-bit ones)."""
    return CONFIG_DIR / f"{_slug(device_name)}__{_slug(str(weight_key))}__{_slug(str(activation_key))}.json"


def shape_key(num_experts: int, top_k: int, n: int, k: int) -> str:
    """A tuned table's shape class: one GEMM (N outputs, K inputs) of a layer with E experts, top-k."""
    return f"E{num_experts}_top{top_k}_N{n}_K{k}"


@functools.cache
def _load_config_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with path.open() as f:
        return json.load(f)


def _pow2_floor(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def default_config(tokens: int, top_k: int, num_experts: int, n: int, k: int, weight_key: QuantKey | str,
                   num_sms: int = 132) -> dict:
    """Untuned tile config. Decode (few rows per expert): BLOCK_M 16 and 64-wide N tiles for more
    programs, and split-K when the tiles alone leave most of the ``num_sms`` idle; prefill: 64/128
    rows. Sub-16-bit weights take longer K tiles (a 4-bit tile of 128 is 64 bytes)."""
    qk = parse_quant_key(weight_key) if isinstance(weight_key, str) else weight_key
    narrow = qk.quantized and qk.dtype.bits <= 8
    pairs = max(tokens * top_k, 1)
    rows = triton.cdiv(pairs, num_experts)
    if rows <= 8:  # random routing: an expert often gets twice the mean, and a second block rereads it
        bm, gm = 16, 1
    elif rows <= 32:
        bm, gm = 32, 4
    elif rows <= 96:
        bm, gm = 64, 8
    else:
        bm, gm = 128, 8
    bk = 128 if narrow else 64
    if bm <= 32:
        config = {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": 4, "num_stages": 4}
    else:
        config = {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": bk, "GROUP_M": gm,
                  "num_warps": 8 if bm == 128 else 4, "num_stages": 3}
    blocks = min(pairs, num_experts) + pairs // bm  # row blocks: about one per expert hit, + full ones
    tiles = blocks * triton.cdiv(n, config["BLOCK_N"])
    split = 1
    if tiles < num_sms:  # too few programs to keep every SM streaming weights: cut K into pieces
        split = min(_pow2_floor(2 * num_sms // tiles), _pow2_floor(k // (4 * bk)), 8)
    config["SPLIT_K"] = max(split, 1)
    return config


def get_config(tokens: int, top_k: int, num_experts: int, n: int, k: int, weight_key: QuantKey | str,
               activation_key: QuantKey | str, device_name: str, num_sms: int = 132) -> dict:
    """Tile config (BLOCK_M/N/K, GROUP_M, SPLIT_K, num_warps, num_stages) for one MoE GEMM of
    ``tokens`` tokens, top-k routing over ``num_experts``, projection ``n``×``k``.

    A tuned file (:func:`config_file`) maps :func:`shape_key` to ``{"<tokens>": config}``; the
    entry with the nearest token count (by ratio, within TUNED_REACH) wins and its keys override
    :func:`default_config`. Shapes and token counts nobody tuned get the defaults.
    """
    config = default_config(tokens, top_k, num_experts, n, k, weight_key, num_sms)
    path = config_file(weight_key, activation_key, device_name)
    table = _load_config_file(path)
    shape = shape_key(num_experts, top_k, n, k)
    by_tokens = (table or {}).get(shape)
    if not by_tokens:
        why = f"{path.name} has no {shape} table" if table else f"no tuned config file {path}"
        _warn_default(device_name, str(weight_key), str(activation_key), shape, why)
        return config
    distance = {t: abs(math.log(int(t) / max(tokens, 1))) for t in by_tokens}
    nearest = min(distance, key=distance.__getitem__)
    if distance[nearest] <= math.log(TUNED_REACH):  # a decode entry says nothing about prefill
        config.update(by_tokens[nearest])
    else:
        why = f"{path.name}'s {shape} table is tuned at {', '.join(by_tokens)} tokens, none near {tokens}"
        _warn_default(device_name, str(weight_key), str(activation_key), shape, why)
    return config


_WARNED_DEFAULT: set[tuple[str, str, str, str]] = set()


def _warn_default(device_name: str, weight_key: str, activation_key: str, shape: str, why: str) -> None:
    """Say once per (device, keys, shape) that a GEMM runs on untuned tiles (as vLLM's "Using
    default MoE config"): a shape nobody tuned is often several times slower than a tuned one."""
    seen = (device_name, weight_key, activation_key, shape)
    if seen in _WARNED_DEFAULT:
        return
    _WARNED_DEFAULT.add(seen)
    log.warning("Using default MoE config for %s on %s (weight %s, activation %s): %s; performance might be "
                "sub-optimal (tools/tune.py tunes it)", shape, device_name, weight_key, activation_key, why)


_OVERRIDE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("moe_config_override", default=None)


@contextlib.contextmanager
def config_override(gemm1: dict | None = None, gemm2: dict | None = None):
    """Run the layers called inside with these tile configs (keys as in :func:`get_config`; GEMM2
    takes GEMM1's BLOCK_M, since both walk the same aligned blocks). For the tuner and for tests
    that run tuned configs through the conformance cases."""
    token = _OVERRIDE.set({"gemm1": gemm1, "gemm2": gemm2})
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def swappable(scheme: Scheme) -> bool:
    """Whether the swapped-operand kernel runs the scheme: weights dequantised to the 16-bit
    activation dtype in registers (no int8/fp8 dot, no 128x128 blocks, activations unquantized)."""
    return scheme.dot == "float" and scheme.act_quant == "none" and scheme.weight_scale != "block"


def _fit_config(config: dict, scheme: Scheme, *, can_split: bool, can_swap: bool = True) -> dict:
    """A config made legal for the scheme: BLOCK_K no wider than a weight block or an fp8
    activation group (their scales change inside the tile otherwise), at least 32 for 4-bit
    weights (each nibble half-dot needs K >= 16); SPLIT_K 1 where the launch cannot split;
    SWAP_AB (the swapped-operand kernel) only where it runs the scheme."""
    config = dict(config)
    config["SWAP_AB"] = bool(config.get("SWAP_AB", False)) and can_swap and swappable(scheme)
    bk = config["BLOCK_K"]
    if scheme.weight_scale == "block":
        bk = min(bk, scheme.weight_group)
    if scheme.act_quant == "fp8_group":
        bk = min(bk, scheme.act_group)
    if scheme.packed:
        bk = max(bk, 32)
    config["BLOCK_K"] = bk
    config["BLOCK_N"] = max(config["BLOCK_N"], 32)
    if not can_split:
        config["SPLIT_K"] = 1
    config.setdefault("SPLIT_K", 1)
    return config


def _layer_configs(tokens: int, top_k: int, num_experts: int, w13: "_Proj", w2: "_Proj", weight_key: str,
                   activation_key: str, scheme: Scheme, device: torch.device, *,
                   split_gemm2: bool) -> tuple[dict, dict]:
    """GEMM1 and GEMM2 configs (overridden, tuned or default), fitted; GEMM2 shares BLOCK_M."""
    name, sms = _device_name(device), _num_sms(device)
    override = _OVERRIDE.get() or {}
    config1 = override.get("gemm1") or get_config(tokens, top_k, num_experts, w13.n, w13.k, weight_key,
                                                  activation_key, name, sms)
    config2 = override.get("gemm2") or get_config(tokens, top_k, num_experts, w2.n, w2.k, weight_key,
                                                  activation_key, name, sms)
    # GEMM1 applies the activation: no split; the batched format has no swapped kernel
    config1 = _fit_config(config1, scheme, can_split=False, can_swap=split_gemm2)
    config2 = _fit_config({**config2, "BLOCK_M": config1["BLOCK_M"]}, scheme, can_split=split_gemm2,
                          can_swap=split_gemm2)
    return config1, config2


@functools.cache
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.cache
def _paired_halves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the PTX dequantisation (_nibble_asm, _byte_asm) runs: compiled for a GPU (not the
    interpreter) that converts float32 pairs to 16 bits (sm_80 and later) and, for bfloat16,
    has paired bf16 subtract/multiply (sm_90 and later)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip:
        return False
    capability = torch.cuda.get_device_capability(device)
    if dtype == torch.float16:
        return capability >= (8, 0)
    return dtype == torch.bfloat16 and capability >= (9, 0)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: behave as an H100 would, so CPU tests cover split-K


# ---------------------------------------------------------------------------------------------
# the kernel


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering (Triton matmul tutorial): GROUP_M row blocks share the same weight columns
    while they are hot in L2."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _repeat_rows(x, ROWS: tl.constexpr):
    """Per-group values [G, BN] -> [ROWS, BN], each repeated over ROWS // G consecutive rows
    (G == 1 is left to broadcasting)."""
    if x.shape[0] == 1:
        out = x
    else:
        parts = tl.broadcast_to(x[:, None, :], (x.shape[0], ROWS // x.shape[0], x.shape[1]))
        out = tl.reshape(parts, (ROWS, x.shape[1]))
    return out


@triton.jit
def _repeat_cols(x, COLS: tl.constexpr):
    """Per-group values [BM, G] -> [BM, COLS], each repeated over COLS // G consecutive columns."""
    if x.shape[1] == 1:
        out = x
    else:
        parts = tl.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], COLS // x.shape[1]))
        out = tl.reshape(parts, (x.shape[0], COLS))
    return out


@triton.jit
def _e8m0(e):
    """Raw e8m0 exponent bytes -> 2^(e-127) as float32 (byte 0 is the subnormal 2^-127)."""
    e = e.to(tl.int32)
    return tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b; float32 operands use exact fp32 products (no TF32)."""
    return tl.dot(a, b, acc, input_precision="ieee") if a.dtype == tl.float32 else tl.dot(a, b, acc)


@triton.constexpr_function
def _nibble_asm(half: str, signed: bool, scaled: bool = True) -> str:
    """PTX turning 4 packed bytes (8 4-bit codes) into (code - zero) * scale for the low and the
    high nibbles, two at a time in 16-bit pairs: bytes are spread into the halves of a word
    (prmt), each nibble OR-ed into the mantissa of the pair's magic number (lop3; 128 + code in
    bf16, 1024 + code in fp16), then one paired subtract of the offset zero and one paired
    multiply by the scale. Operands: $0 $1 low pairs, $2 $3 high pairs, $4 the bytes, $5 $6 offset
    zeros, $7 $8 scales (Triton's pack=4 register order). Not ``scaled``: code - zero only (no
    scale operands), for kernels that apply the scale to the dot's result."""
    magic = "0x43004300" if half == "bf16" else "0x64006400"
    flip = "xor.b32 w, $4, 0x88888888;" if signed else "mov.b32 w, $4;"
    lines = ["{", ".reg .b32 w, z, t0, t1, u0, u1;", flip, "mov.b32 z, 0;",
             "prmt.b32 t0, w, z, 0x4140;", "prmt.b32 t1, w, z, 0x4342;"]
    for out, shift in ((0, False), (2, True)):
        if shift:
            lines += ["shr.b32 t0, t0, 4;", "shr.b32 t1, t1, 4;"]
        lines += [f"lop3.b32 u0, t0, 0x000F000F, {magic}, 0xEA;", f"lop3.b32 u1, t1, 0x000F000F, {magic}, 0xEA;"]
        if scaled:
            lines += [f"sub.rn.{half}x2 u0, u0, $5;", f"sub.rn.{half}x2 u1, u1, $6;",
                      f"mul.rn.{half}x2 ${out}, u0, $7;", f"mul.rn.{half}x2 ${out + 1}, u1, $8;"]
        else:
            lines += [f"sub.rn.{half}x2 ${out}, u0, $5;", f"sub.rn.{half}x2 ${out + 1}, u1, $6;"]
    return "\n".join([*lines, "}"])


@triton.constexpr_function
def _asm_constraints(pack: int, outputs: int, operand_bits: tuple) -> str:
    """Inline-asm constraints for ``outputs`` 16-bit results and operands of these bit widths,
    ``pack`` elements per call: one 32-bit register per 32 bits of each."""
    regs = [max(1, pack * bits // 32) for bits in (16,) * outputs + tuple(operand_bits)]
    return ",".join(["=r"] * sum(regs[:outputs]) + ["r"] * sum(regs[outputs:]))


@triton.constexpr_function
def _asm_result_dtype(dtype, outputs: int):
    """inline_asm_elementwise's ``dtype``: one dtype, or a tuple of ``outputs`` of them."""
    return dtype if outputs == 1 else (dtype,) * outputs


@triton.jit
def _dequant_asm(program: tl.constexpr, codes, tile_zero, scale, dtype, OUTPUTS: tl.constexpr,
                 SCALED: tl.constexpr, PACK: tl.constexpr):
    """Run a dequantising PTX ``program`` (_nibble_asm, _byte_asm) on ``codes`` with the offset
    zero and, when SCALED, the scale (in ``dtype``) broadcast to them: OUTPUTS results in
    ``dtype``, PACK elements per call."""
    zero_t = tl.broadcast_to(tile_zero, codes.shape)
    result: tl.constexpr = _asm_result_dtype(dtype, OUTPUTS)
    if SCALED:
        scale_t = tl.broadcast_to(scale, codes.shape).to(dtype)
        bits: tl.constexpr = (codes.dtype.primitive_bitwidth, zero_t.dtype.primitive_bitwidth,
                              scale_t.dtype.primitive_bitwidth)
        out = tl.inline_asm_elementwise(program, _asm_constraints(PACK, OUTPUTS, bits), [codes, zero_t, scale_t],
                                        dtype=result.value, is_pure=True, pack=PACK)
    else:
        bits: tl.constexpr = (codes.dtype.primitive_bitwidth, zero_t.dtype.primitive_bitwidth)
        out = tl.inline_asm_elementwise(program, _asm_constraints(PACK, OUTPUTS, bits), [codes, zero_t],
                                        dtype=result.value, is_pure=True, pack=PACK)
    return out


@triton.jit
def _dequant_nibbles(packed, tile_zero, scale, dtype, SIGNED: tl.constexpr, ASM: tl.constexpr,
                     SCALED: tl.constexpr = True):
    """(low, high): the dequantised even- and odd-column weights of a packed 4-bit tile, in the
    16-bit ``dtype``. ``tile_zero`` (zero code + offset, as _offset_zero gives it) and ``scale``
    broadcast to the tile; not SCALED: code - zero only (exact; ``scale`` unused), for tiles
    whose scale multiplies the dot's result. ASM: the paired PTX of _nibble_asm (GPU); else plain
    Triton (the same values: every step is exact but the multiply, which both round once)."""
    if ASM:
        program: tl.constexpr = _nibble_asm("bf16" if dtype == tl.bfloat16 else "f16", SIGNED, SCALED)
        low, high = _dequant_asm(program, packed, tile_zero, scale, dtype, 2, SCALED, 4)
    else:
        if SIGNED:  # two's complement nibbles -> offset binary around 8
            packed = packed ^ 0x88
        low = _offset_codes(packed & 0xF, dtype, True) - tile_zero
        high = _offset_codes(packed >> 4, dtype, True) - tile_zero
        if SCALED:
            low, high = low * scale, high * scale
        low, high = low.to(dtype), high.to(dtype)
    return low, high


@triton.constexpr_function
def _byte_asm(half: str, signed: bool, scaled: bool, word_pairs: bool = False) -> str:
    """PTX turning 4 packed 8-bit integer codes into (code - zero) [* scale]: each byte is placed
    into the mantissa of float32 2^23 by one prmt (2^23 + code, exact), one float32 subtract of
    the offset zero leaves code - zero (exact), one convert packs two of them into 16-bit halves
    (exact: |code - zero| < 256), and one paired 16-bit multiply applies the scale, rounding once
    as the float32 product would. ``signed``: two's complement bytes, read as offset binary (xor
    0x80) first. Operands: $0 $1 the result pairs, $2 the 4 bytes, then the float32 offset zeros
    and the 16-bit scale pairs:
    - bytes in order (pack=4): $0 = codes 0, 1 and $1 = codes 2, 3; zeros $3-$6, scales $7 $8;
    - ``word_pairs`` (two 16-bit words of an even and an odd code each, pack=2): $0 = the even
      codes, $1 = the odd ones; one zero ($3 $4) and one scale ($5, a pair) per word."""
    flip = "xor.b32 w, $2, 0x80808080;" if signed else "mov.b32 w, $2;"
    lines = ["{", ".reg .b32 w, m, f0, f1, f2, f3;", flip, "mov.b32 m, 0x4B000000;"]
    for i in range(4):
        zero = 3 + i // 2 if word_pairs else 3 + i
        lines += [f"prmt.b32 f{i}, w, m, 0x765{i};", f"sub.rn.f32 f{i}, f{i}, ${zero};"]
    pairs = (("f2", "f0"), ("f3", "f1")) if word_pairs else (("f1", "f0"), ("f3", "f2"))
    scales = ("$5", "$5") if word_pairs else ("$7", "$8")
    for out in range(2):  # (no tuple targets: Triton 3.6 reads this source for its cache key)
        high, low = pairs[out]
        lines.append(f"cvt.rn.{half}x2.f32 ${out}, {high}, {low};")
        if scaled:
            lines.append(f"mul.rn.{half}x2 ${out}, ${out}, {scales[out]};")
    return "\n".join([*lines, "}"])


@triton.jit
def _dequant_byte_pairs(words, tile_zero, scale, dtype, SIGNED: tl.constexpr, SCALED: tl.constexpr):
    """(even, odd): the dequantised codes of 16-bit words holding two 8-bit integer codes each
    (low byte: the even column), with _byte_asm; ``tile_zero`` (float32, offset) and ``scale``
    (in ``dtype``) broadcast to the words. GPU only (PTX)."""
    program: tl.constexpr = _byte_asm("bf16" if dtype == tl.bfloat16 else "f16", SIGNED, SCALED, True)
    return _dequant_asm(program, words, tile_zero, scale, dtype, 2, SCALED, 2)


@triton.jit
def _dequant_byte(codes, tile_zero, scale, dtype, W_TYPE: tl.constexpr, ASM: tl.constexpr = False,
                  SCALED: tl.constexpr = True):
    """8-bit weight codes (uint8 bits) -> (code - zero) * scale, or the e4m3 value * scale,
    rounded once to ``dtype``; not SCALED: ``scale`` is 1 (unused). ASM (integer codes, scales
    already in ``dtype``): the PTX of _byte_asm, which gives the same values in fewer
    instructions than Triton's byte extraction and float32 multiply."""
    if ASM and W_TYPE != "fp8e4m3":
        program: tl.constexpr = _byte_asm("bf16" if dtype == tl.bfloat16 else "f16", W_TYPE == "int8", SCALED)
        out = _dequant_asm(program, codes, tile_zero, scale, dtype, 1, SCALED, 4)
    else:
        if W_TYPE == "fp8e4m3":
            out = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            if W_TYPE == "int8":  # two's complement -> offset binary around 128
                codes = codes ^ 0x80
            out = _offset_codes(codes, dtype, False) - tile_zero
        if SCALED:
            out = out * scale
        out = out.to(dtype)
    return out


@triton.jit
def _offset_codes(codes, dtype, NARROW: tl.constexpr):
    """Unsigned integer codes as floats OFFSET + code, without an integer-to-float conversion: the
    code is OR-ed into the mantissa of a power of two whose unit in the last place is 1 (fp16
    1024 and bf16 128 for 4-bit codes when NARROW, else float32 2^23). Subtracting
    :func:`_offset_zero` then gives code - zero exactly."""
    if NARROW and dtype == tl.float16:
        v = (codes.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    elif NARROW and dtype == tl.bfloat16:
        v = (codes.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True)
    else:
        v = (codes.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _offset_zero(zero, dtype, NARROW: tl.constexpr):
    """float32 zero codes + the OFFSET of :func:`_offset_codes`, in the type it returns (exact)."""
    if NARROW and dtype == tl.float16:
        z = (zero + 1024.0).to(tl.float16)
    elif NARROW and dtype == tl.bfloat16:
        z = (zero + 128.0).to(tl.bfloat16)
    else:
        z = zero + 8388608.0
    return z


@triton.jit
def _block_pairs(pid_m, offs_m, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, num_valid, num_experts,
                 BLOCK_M: tl.constexpr, ONE_PAIR_BLOCKS: tl.constexpr):
    """(pairs [BLOCK_M], expert) of row block pid_m; expert -1: the block has no rows (past the
    aligned pairs, or a foreign expert). Aligned: the block's slice of sorted_ids (padding holds
    the sentinel num_valid). ONE_PAIR_BLOCKS: block b holds pair b alone and expert_ids are the
    router's ids (one token: its top-k experts are distinct, so no alignment is needed)."""
    if ONE_PAIR_BLOCKS:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        expert = tl.where((expert >= 0) & (expert < num_experts), expert, -1)
        pairs = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_valid)
    else:
        num_post_padded = tl.load(num_post_padded_ptr)  # a multiple of BLOCK_M
        pairs = tl.load(sorted_ids_ptr + offs_m, mask=offs_m < num_post_padded, other=num_valid)
        expert = tl.where(pid_m * BLOCK_M < num_post_padded, tl.load(expert_ids_ptr + pid_m).to(tl.int64), -1)
    return pairs, expert


# token counts vary per call: not specialising on them keeps one compiled kernel for every M
@triton.jit(do_not_specialize=["num_valid", "rows_per_expert"])
def _fused_moe_kernel(
        # tensors
        a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, b_zero_ptr, perm_ptr, bias_ptr, c_ptr,
        topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr, expert_num_tokens_ptr,
        amax_ptr,
        # sizes: C is [rows, N] = A [rows, K] @ B[e]^T; K_PACKED = K / 2 (its own argument so
        # Triton sees its divisibility and vectorises the byte loads); rows_per_expert is the
        # padded length of sorted_ids (standard) or the per-expert capacity T (batched);
        # amax_parts: columns of the row-amax pieces [rows, amax_parts] (see AMAX_OUT)
        N, K, K_PACKED, num_valid, rows_per_expert, num_experts, amax_parts,
        # strides (last dimensions are contiguous; zero points share the scales' strides);
        # stride_cs steps between split-K partial outputs
        stride_am, stride_as_m, stride_as_k, stride_be, stride_bn, stride_se, stride_sn, stride_sk,
        stride_cm, stride_cs,
        # what the weights and activations are (see Scheme); COMPUTE is the 16-bit (or float32)
        # activation dtype the float dot runs in
        W_TYPE: tl.constexpr, PACKED: tl.constexpr, W_ZERO: tl.constexpr, HAS_ZERO: tl.constexpr,
        W_SCALE: tl.constexpr, W_GROUP: tl.constexpr, W_GROUP_N: tl.constexpr, W_GROUPS: tl.constexpr,
        A_QUANT: tl.constexpr, A_GROUP: tl.constexpr, DOT: tl.constexpr, COMPUTE: tl.constexpr,
        ASM_DEQUANT: tl.constexpr,
        # layer options; FUSE_ACT: C = act(gate) * up of this GEMM's [gate | up] outputs (N / 2
        # columns); SPLIT_K: program_id(2) sums its share of K into partial output number pid 2;
        # AMAX_OUT (with FUSE_ACT): also each stored row's max |C| over this tile, into
        # amax_ptr[row, pid_n]
        ACT_ORDER: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTED_WEIGHT: tl.constexpr,
        TOP_K: tl.constexpr, BATCHED: tl.constexpr, ONE_PAIR_BLOCKS: tl.constexpr, WRITE_EMPTY: tl.constexpr,
        FUSE_ACT: tl.constexpr, SPLIT_K: tl.constexpr, AMAX_OUT: tl.constexpr,
        # tiles
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PDL: tl.constexpr):
    """C[rows of one expert block] = A[rows] @ dequant(B[expert])^T, with the epilogue of the
    layer: scales, + bias, × router weight (before bias on the input side, after on the output),
    and the gated activation when fused."""
    triton_ops.grid_wait(PDL)
    # with FUSE_ACT a tile holds BLOCK_N / 2 gate rows interleaved with their up rows
    num_pid_n = tl.cdiv(N // 2, BLOCK_N // 2) if FUSE_ACT != "none" else tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(rows_per_expert, BLOCK_M), num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_end = K
    if BATCHED:  # rows e·T .. e·T + expert_num_tokens[e] of A and C belong to expert e
        expert = tl.program_id(1).to(tl.int64)
        num_rows = tl.load(expert_num_tokens_ptr + expert)
        empty = pid_m * BLOCK_M >= num_rows
        if WRITE_EMPTY:
            k_end = tl.where(empty, 0, K)  # an empty block skips the loop and writes zeros
        elif empty:
            return
        row_mask = offs_m < num_rows
        a_rows = expert * rows_per_expert + offs_m
        c_rows = a_rows
        store_rows = offs_m < rows_per_expert
    else:  # rows come from the aligned (token, k) pairs; padding holds the sentinel num_valid
        pairs, expert = _block_pairs(pid_m, offs_m, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                                     num_valid, num_experts, BLOCK_M, ONE_PAIR_BLOCKS)
        if expert < 0:
            return
        row_mask = pairs < num_valid
        a_rows = pairs // TOP_K
        c_rows = pairs
        store_rows = row_mask

    split = tl.program_id(2)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_end, k_lo + k_per_split)

    if FUSE_ACT != "none":  # tile column 2i: gate row c_i, column 2i + 1: up row N/2 + c_i
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        offs_bn = cols % (N // 2) + (tl.arange(0, BLOCK_N) % 2) * (N // 2)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_bn = offs_n % N  # wrapped, so weight loads need no column mask; the store masks
    a_row_ptrs = a_ptr + a_rows.to(tl.int64) * stride_am
    b_cols = b_ptr + expert * stride_be + offs_bn[None, :] * stride_bn  # [1, BN]
    scale_cols = b_scale_ptr + expert * stride_se + offs_bn[None, :] * stride_sn
    zero_cols = b_zero_ptr + expert * stride_se + offs_bn[None, :] * stride_sn
    dtype = COMPUTE
    W_ROWS: tl.constexpr = BLOCK_K // 2 if PACKED else BLOCK_K  # K rows of one weight tile

    # the code of 0 (the type's bias, or per-column zero points) + the offset of _offset_codes
    NARROW: tl.constexpr = PACKED  # 4-bit codes: the offset trick works in 16 bits
    zero = _offset_zero(tl.full((1, BLOCK_N), W_ZERO, tl.float32), dtype, NARROW)
    if HAS_ZERO and W_SCALE == "channel":
        zero = _offset_zero(tl.load(zero_cols).to(tl.float32), dtype, NARROW)

    # decode tiles with per-group scales and no zero points, whose K tiles each lie in one group:
    # the tile's dot runs on code - zero (exact in 16 bits) and its result takes the group's scale,
    # so no weight is multiplied by a scale and each column's scale is loaded once per tile, not
    # once per weight. (Measured on an H100: faster at M <= 64 for GPTQ int4 and int8. With zero
    # points it was no faster (zeros subtracted per weight) or slower (corrected with the input's
    # row sums); on 64+ row tiles it breaks the wgmma chain every step.)
    PER_WEIGHT_SCALE: tl.constexpr = W_SCALE == "group" or W_SCALE == "mx" or W_SCALE == "block"
    FACTORED: tl.constexpr = (W_SCALE == "group" and DOT == "float" and W_GROUP % BLOCK_K == 0
                              and not HAS_ZERO and BLOCK_M <= 32)
    if DOT == "int8":
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(k_lo, k_hi, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_cols = offs_k
        if ACT_ORDER:  # stored weight column j multiplies input column perm[j]
            a_cols = tl.load(perm_ptr + expert * K + offs_k, mask=k_mask, other=0)
        a = tl.load(a_row_ptrs[:, None] + a_cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if A_QUANT == "mxfp8":
            a_groups = k_start // A_GROUP + tl.arange(0, BLOCK_K // A_GROUP)
            a_exp = tl.load(a_scale_ptr + a_rows[:, None] * stride_as_m + a_groups[None, :] * stride_as_k,
                            mask=row_mask[:, None] & (a_groups[None, :] < tl.cdiv(K, A_GROUP)), other=127)
            a = (a.to(tl.float32) * _repeat_cols(_e8m0(a_exp), BLOCK_K)).to(dtype)

        # the weight tile's scale (and zero) groups: one load per group and column
        tile_zero = zero
        if FACTORED:
            group = k_start // W_GROUP
            scale = tl.load(scale_cols + group * stride_sk).to(tl.float32)  # [1, BN]
        elif W_SCALE == "group" or W_SCALE == "mx":
            w_groups = k_start // W_GROUP + tl.arange(0, W_GROUPS)
            g_mask = w_groups[:, None] < tl.cdiv(K, W_GROUP)
            scale = tl.load(scale_cols + w_groups[:, None] * stride_sk, mask=g_mask, other=0)
            scale = _e8m0(scale) if W_SCALE == "mx" else scale.to(dtype)
            scale = _repeat_rows(scale, W_ROWS)
            if HAS_ZERO:
                group_zero = tl.load(zero_cols + w_groups[:, None] * stride_sk, mask=g_mask, other=0)
                tile_zero = _repeat_rows(_offset_zero(group_zero.to(tl.float32), dtype, NARROW), W_ROWS)
        elif W_SCALE == "block":  # one [W_GROUP_N x W_GROUP] block per scale; BLOCK_K <= W_GROUP
            scale = tl.load(b_scale_ptr + expert * stride_se + (offs_bn[None, :] // W_GROUP_N) * stride_sn
                            + (k_start // W_GROUP) * stride_sk)
        else:
            scale = 1.0  # none, or per channel: applied after the loop

        if PACKED:  # each byte loaded and unpacked once: low nibble column 2i, high 2i + 1
            offs_kp = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(b_cols + offs_kp[:, None], mask=offs_kp[:, None] < K_PACKED, other=0)
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            if FACTORED:
                low, high = _dequant_nibbles(packed, zero, 1.0, dtype, W_TYPE == "int4", ASM_DEQUANT, False)
                part = _dot(a_even, low, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
                part = _dot(a_odd, high, part)
            else:
                low, high = _dequant_nibbles(packed, tile_zero, scale, dtype, W_TYPE == "int4", ASM_DEQUANT)
                acc = _dot(a_even, low, acc)
                acc = _dot(a_odd, high, acc)
        else:
            b = tl.load(b_cols + offs_k[:, None], mask=k_mask[:, None], other=0.0)
            if DOT == "int8":
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            elif DOT == "fp8":
                a_scale = tl.load(a_scale_ptr + a_rows * stride_as_m + (k_start // A_GROUP) * stride_as_k,
                                  mask=row_mask, other=0.0)
                acc += tl.dot(a, b) * a_scale[:, None] * scale
            else:
                if W_TYPE != "float":  # 8-bit codes; FACTORED: the scale goes on the dot's result
                    codes = b.to(tl.uint8, bitcast=True)
                    if FACTORED:
                        b = _dequant_byte(codes, zero, 1.0, dtype, W_TYPE, ASM_DEQUANT, False)
                    else:
                        b = _dequant_byte(codes, tile_zero, scale, dtype, W_TYPE, ASM_DEQUANT, PER_WEIGHT_SCALE)
                if FACTORED:
                    part = _dot(a.to(dtype), b.to(dtype), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
                else:
                    acc = _dot(a.to(dtype), b.to(dtype), acc)
        if FACTORED:
            acc += part * scale

    triton_ops.grid_release(PDL)  # the main loop is done: the next kernel may be scheduled
    # epilogue
    acc = acc.to(tl.float32)
    if A_QUANT == "int8":  # per token (or static: stride 0)
        acc *= tl.load(a_scale_ptr + a_rows * stride_as_m, mask=row_mask, other=0.0)[:, None]
    _finish_tile(acc, expert, c_rows, row_mask, store_rows, offs_bn, pid_n, split, N, scale_cols, bias_ptr,
                 topk_weights_ptr, c_ptr, stride_cm, stride_cs, W_SCALE, ROUTED_WEIGHT, HAS_BIAS, WRITE_EMPTY,
                 FUSE_ACT, BLOCK_M, BLOCK_N, amax_ptr, amax_parts, AMAX_OUT)


@triton.jit
def _finish_tile(acc, expert, c_rows, row_mask, store_rows, offs_bn, pid_n, split, N, scale_cols, bias_ptr,
                 topk_weights_ptr, c_ptr, stride_cm, stride_cs, W_SCALE: tl.constexpr, ROUTED_WEIGHT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, WRITE_EMPTY: tl.constexpr, FUSE_ACT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, amax_ptr, amax_parts, AMAX_OUT: tl.constexpr):
    """The epilogue on a float32 [BLOCK_M rows, BLOCK_N weight rows] tile: per-channel scale,
    router weight, bias (first split only), the gated activation when fused, and the store; with
    AMAX_OUT (fused activation only) also each stored row's max |value| over the tile, as stored:
    a piece of the row's amax, so the per-token quantisation after this GEMM need not find it."""
    if W_SCALE == "channel":
        acc *= tl.load(scale_cols).to(tl.float32)
    if ROUTED_WEIGHT != "none":
        router = tl.load(topk_weights_ptr + c_rows, mask=row_mask, other=0.0).to(tl.float32)
    if ROUTED_WEIGHT == "input":  # W (w·x) + b = w·(W x) + b
        acc *= router[:, None]
    if HAS_BIAS:  # added by the first split only
        bias = tl.load(bias_ptr + expert * N + offs_bn).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    if ROUTED_WEIGHT == "output":  # w·(W x + b)
        acc *= router[:, None]
    if WRITE_EMPTY:
        acc = tl.where(row_mask[:, None], acc, 0.0)
    c_row_ptrs = c_ptr + split * stride_cs + c_rows.to(tl.int64)[:, None] * stride_cm
    if FUSE_ACT != "none":
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        out = triton_ops.gated_act(gate, up, FUSE_ACT)
        offs_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        stored = out.to(c_ptr.dtype.element_ty)
        tl.store(c_row_ptrs + offs_out[None, :], stored, mask=store_rows[:, None] & (offs_out[None, :] < N // 2))
        if AMAX_OUT:
            magnitude = tl.where(offs_out[None, :] < N // 2, tl.abs(stored.to(tl.float32)), 0.0)
            tl.store(amax_ptr + c_rows.to(tl.int64) * amax_parts + pid_n, tl.max(magnitude, axis=1),
                     mask=store_rows)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(c_row_ptrs + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=store_rows[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["num_valid", "rows_per_expert"])
def _fused_moe_swap_kernel(
        a_ptr, b_ptr, b_scale_ptr, b_zero_ptr, perm_ptr, bias_ptr, c_ptr, topk_weights_ptr,
        sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
        N, K, K_PACKED, num_valid, rows_per_expert, num_experts,
        stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_sk, stride_cm, stride_cs,
        W_TYPE: tl.constexpr, PACKED: tl.constexpr, W_ZERO: tl.constexpr, HAS_ZERO: tl.constexpr,
        W_SCALE: tl.constexpr, W_GROUP: tl.constexpr, W_GROUPS: tl.constexpr, COMPUTE: tl.constexpr,
        ASM_DEQUANT: tl.constexpr, BYTE_PAIRS: tl.constexpr, ACT_ORDER: tl.constexpr,
        HAS_BIAS: tl.constexpr, ROUTED_WEIGHT: tl.constexpr, TOP_K: tl.constexpr, ONE_PAIR_BLOCKS: tl.constexpr,
        FUSE_ACT: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PDL: tl.constexpr):
    """_fused_moe_kernel with the operands swapped, for weights dequantised in registers (16-bit
    activations, standard format): each step computes dequant(W tile) [BLOCK_N, K] @ A^T [K,
    BLOCK_M], so the dequantised weights are the left operand of the dot, which the matrix unit
    reads from registers, instead of the right one it reads through shared memory (on Hopper the
    dot then runs asynchronously while the next tile is dequantised, where the right operand
    would wait for it); the token rows become the dot's N side. 4-bit tiles are interleaved back
    into K order after unpacking, so the activations load as one contiguous, pipelined tile.
    BYTE_PAIRS: 8-bit weights take the same route, two columns per 16-bit word (loaded whole
    into the dot's operand layout, ptxas serialises the matrix unit on sm_90: warning C7515). Same
    arguments and results as _fused_moe_kernel (the tile is transposed back before the epilogue)."""
    triton_ops.grid_wait(PDL)
    num_pid_n = tl.cdiv(N // 2, BLOCK_N // 2) if FUSE_ACT != "none" else tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(tl.program_id(0), tl.cdiv(rows_per_expert, BLOCK_M), num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs, expert = _block_pairs(pid_m, offs_m, sorted_ids_ptr, expert_ids_ptr, num_post_padded_ptr,
                                 num_valid, num_experts, BLOCK_M, ONE_PAIR_BLOCKS)
    if expert < 0:
        return
    row_mask = pairs < num_valid
    a_rows = pairs // TOP_K

    split = tl.program_id(2)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)

    if FUSE_ACT != "none":
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) // 2
        offs_bn = cols % (N // 2) + (tl.arange(0, BLOCK_N) % 2) * (N // 2)
    else:
        offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_col_ptrs = a_ptr + a_rows.to(tl.int64)[None, :] * stride_am  # [1, BM]: A^T's columns
    w_rows = b_ptr + expert * stride_be + offs_bn[:, None] * stride_bn  # [BN, 1]
    scale_rows = b_scale_ptr + expert * stride_se + offs_bn[:, None] * stride_sn
    zero_rows = b_zero_ptr + expert * stride_se + offs_bn[:, None] * stride_sn
    dtype = COMPUTE
    W_COLS: tl.constexpr = BLOCK_K // 2 if PACKED or BYTE_PAIRS else BLOCK_K  # weight columns per load
    PER_WEIGHT_SCALE: tl.constexpr = W_SCALE == "group" or W_SCALE == "mx"
    NARROW: tl.constexpr = PACKED
    zero = _offset_zero(tl.full((BLOCK_N, 1), W_ZERO, tl.float32), dtype, NARROW)
    if HAS_ZERO and W_SCALE == "channel":
        zero = _offset_zero(tl.load(zero_rows).to(tl.float32), dtype, NARROW)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k_start in range(k_lo, k_hi, BLOCK_K):
        tile_zero = zero
        if W_SCALE == "group" or W_SCALE == "mx":
            w_groups = k_start // W_GROUP + tl.arange(0, W_GROUPS)
            g_mask = w_groups[None, :] < tl.cdiv(K, W_GROUP)
            scale = tl.load(scale_rows + w_groups[None, :] * stride_sk, mask=g_mask, other=0)
            scale = _e8m0(scale) if W_SCALE == "mx" else scale.to(dtype)
            scale = _repeat_cols(scale, W_COLS)
            if HAS_ZERO:
                group_zero = tl.load(zero_rows + w_groups[None, :] * stride_sk, mask=g_mask, other=0)
                tile_zero = _repeat_cols(_offset_zero(group_zero.to(tl.float32), dtype, NARROW), W_COLS)
        else:
            scale = 1.0  # none, or per channel: applied after the loop

        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if PACKED:  # low nibbles hold even input columns, high nibbles odd ones: interleaved back
            offs_kp = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + offs_kp[None, :], mask=offs_kp[None, :] < K_PACKED, other=0)
            low, high = _dequant_nibbles(packed, tile_zero, scale, dtype, W_TYPE == "int4", ASM_DEQUANT)
            b = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))
        elif BYTE_PAIRS:  # 8-bit weights read as 16-bit words of two columns, split like nibbles
            offs_kp = k_start // 2 + tl.arange(0, BLOCK_K // 2)
            words = tl.load(w_rows.to(tl.pointer_type(tl.uint16)) + offs_kp[None, :],
                            mask=offs_kp[None, :] < K // 2, other=0)
            if ASM_DEQUANT and W_TYPE != "fp8e4m3":
                even, odd = _dequant_byte_pairs(words, tile_zero, scale, dtype, W_TYPE == "int8", PER_WEIGHT_SCALE)
            else:
                even = _dequant_byte((words & 0xFF).to(tl.uint8), tile_zero, scale, dtype, W_TYPE, False,
                                     PER_WEIGHT_SCALE)
                odd = _dequant_byte((words >> 8).to(tl.uint8), tile_zero, scale, dtype, W_TYPE, False,
                                    PER_WEIGHT_SCALE)
            b = tl.reshape(tl.join(even, odd), (BLOCK_N, BLOCK_K))
        else:
            b = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            if W_TYPE != "float":
                b = _dequant_byte(b.to(tl.uint8, bitcast=True), tile_zero, scale, dtype, W_TYPE, ASM_DEQUANT,
                                  PER_WEIGHT_SCALE)
        a_cols = offs_k
        if ACT_ORDER:
            a_cols = tl.load(perm_ptr + expert * K + offs_k, mask=k_mask, other=0)
        a_t = tl.load(a_col_ptrs + a_cols[:, None], mask=row_mask[None, :] & k_mask[:, None], other=0.0)
        acc = _dot(b.to(dtype), a_t.to(dtype), acc)

    triton_ops.grid_release(PDL)
    scale_cols = b_scale_ptr + expert * stride_se + offs_bn[None, :] * stride_sn
    _finish_tile(tl.trans(acc), expert, pairs, row_mask, row_mask, offs_bn, pid_n, split, N, scale_cols,
                 bias_ptr, topk_weights_ptr, c_ptr, stride_cm, stride_cs, W_SCALE, ROUTED_WEIGHT, HAS_BIAS,
                 False, FUSE_ACT, BLOCK_M, BLOCK_N, c_ptr, 0, False)


# ---------------------------------------------------------------------------------------------
# launching


@dataclass(frozen=True)
class _Proj:
    """One projection's tensors and its logical GEMM shape (N outputs, K inputs)."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    perm: torch.Tensor | None
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None
    n: int
    k: int


@dataclass(frozen=True)
class _Rows:
    """Which rows of A and C each expert owns: aligned pairs (standard) or per-expert slabs."""

    sorted_ids: torch.Tensor | None = None
    expert_ids: torch.Tensor | None = None
    num_post_padded: torch.Tensor | None = None
    num_valid: int = 0
    expert_num_tokens: torch.Tensor | None = None
    capacity: int = 0
    one_pair_blocks: bool = False  # expert_ids are the router's ids, a block per pair (one token)

    @property
    def batched(self) -> bool:
        return self.expert_num_tokens is not None


_A_QUANT = {"none": "none", "int8_token": "int8", "int8_static": "int8", "fp8_group": "fp8_group",
            "mxfp8": "mxfp8"}


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _byte_pairs(weight: torch.Tensor) -> bool:
    """Whether 8-bit weights [E, N, K] can be read as 16-bit words of two columns (even K and
    row strides, 2-byte aligned): the swapped kernel's route for them."""
    return (weight.element_size() == 1 and weight.shape[-1] % 2 == 0 and weight.data_ptr() % 2 == 0
            and weight.stride(-1) == 1 and all(s % 2 == 0 for s in weight.stride()[:-1]))


def _column_tiles(n: int, block_n: int, fuse_act: str) -> int:
    """Column tiles of a GEMM with N outputs (with a fused activation a tile holds BLOCK_N / 2
    gate rows and their up rows, so N / 2 columns come out)."""
    return triton.cdiv(n // 2, block_n // 2) if fuse_act != "none" else triton.cdiv(n, block_n)


def _gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: _Proj, scheme: Scheme, c: torch.Tensor,
          rows: _Rows, config: dict, *, compute_dtype: torch.dtype, top_k: int = 1,
          routed_weight: str = "none", topk_weights: torch.Tensor | None = None, write_empty: bool = False,
          fuse_act: str = "none", amax_pieces: torch.Tensor | None = None, pdl: bool = False) -> None:
    """Launch one fused MoE GEMM writing C (see _fused_moe_kernel): [rows, N], [rows, N / 2] with
    ``fuse_act``, or [SPLIT_K, rows, N] float32 partial sums when the config splits K.
    ``amax_pieces`` [rows, column tiles] (fused activation only): also write each row's max |C|
    per column tile there (see _amax_pieces_shape); ``pdl``: as part of a
    programmatic-dependent-launch chain."""
    if w.perm is not None and scheme.act_quant in ("fp8_group", "mxfp8"):
        raise ValueError("act-order weights cannot take group-quantised activations (their groups "
                         "follow the original column order)")
    bm, bn, split_k = config["BLOCK_M"], config["BLOCK_N"], config["SPLIT_K"]
    dummy = w.weight
    scale = w.scale if w.scale is not None else dummy
    s_strides = (scale.stride(0), scale.stride(1), scale.stride(2)) if w.scale is not None else (0, 0, 0)
    if a_scale is None or a_scale.numel() == 1:
        as_strides = (0, 0)
    else:
        as_strides = (a_scale.stride(0), a_scale.stride(1) if a_scale.dim() == 2 else 0)
    n_tiles = _column_tiles(w.n, bn, fuse_act)
    if amax_pieces is not None and (fuse_act == "none" or config["SWAP_AB"] or amax_pieces.shape[1] != n_tiles):
        raise ValueError("row-amax pieces come from the fused-activation kernel, one per column tile")
    if rows.batched:
        rows_per_expert, expert_grid = rows.capacity, w.weight.shape[0]
    elif rows.one_pair_blocks:
        rows_per_expert, expert_grid = rows.expert_ids.numel() * bm, 1
    else:
        rows_per_expert, expert_grid = rows.sorted_ids.numel(), 1
    grid = (triton.cdiv(rows_per_expert, bm) * n_tiles, expert_grid, split_k)
    sorted_ids = rows.sorted_ids if rows.sorted_ids is not None else dummy
    num_post_padded = rows.num_post_padded if rows.num_post_padded is not None else dummy
    asm = scheme.paired_dequant and _paired_halves(a.device, compute_dtype)
    if config["SWAP_AB"]:
        _fused_moe_swap_kernel[grid](
            a, w.weight, scale, w.zero if w.zero is not None else dummy, w.perm if w.perm is not None else dummy,
            w.bias if w.bias is not None else dummy, c, topk_weights if topk_weights is not None else dummy,
            sorted_ids, rows.expert_ids, num_post_padded,
            w.n, w.k, w.k // 2, rows.num_valid, rows_per_expert, w.weight.shape[0],
            a.stride(0), w.weight.stride(0), w.weight.stride(1), *s_strides, c.stride(-2),
            c.stride(0) if split_k > 1 else 0,
            W_TYPE=scheme.weight_type, PACKED=scheme.packed, W_ZERO=scheme.zero_code, HAS_ZERO=w.zero is not None,
            W_SCALE=scheme.weight_scale, W_GROUP=scheme.weight_group,
            W_GROUPS=max(config["BLOCK_K"] // max(scheme.weight_group, 1), 1), COMPUTE=_TL_DTYPE[compute_dtype],
            ASM_DEQUANT=asm, BYTE_PAIRS=_byte_pairs(w.weight), ACT_ORDER=w.perm is not None,
            HAS_BIAS=w.bias is not None, ROUTED_WEIGHT=routed_weight, TOP_K=top_k,
            ONE_PAIR_BLOCKS=rows.one_pair_blocks, FUSE_ACT=fuse_act, SPLIT_K=split_k,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"],
            GROUP_M=config["GROUP_M"], PDL=pdl, num_warps=config["num_warps"], num_stages=config["num_stages"],
            **triton_ops.pdl_launch(pdl))
        return
    _fused_moe_kernel[grid](
        a, a_scale if a_scale is not None else dummy, w.weight, scale,
        w.zero if w.zero is not None else dummy, w.perm if w.perm is not None else dummy,
        w.bias if w.bias is not None else dummy, c,
        topk_weights if topk_weights is not None else dummy,
        sorted_ids, rows.expert_ids if rows.expert_ids is not None else dummy, num_post_padded,
        rows.expert_num_tokens if rows.expert_num_tokens is not None else dummy,
        amax_pieces if amax_pieces is not None else dummy,
        w.n, w.k, w.k // 2, rows.num_valid, rows_per_expert, w.weight.shape[0],
        amax_pieces.shape[1] if amax_pieces is not None else 0,
        a.stride(0), *as_strides, w.weight.stride(0), w.weight.stride(1), *s_strides, c.stride(-2),
        c.stride(0) if split_k > 1 else 0,
        W_TYPE=scheme.weight_type, PACKED=scheme.packed, W_ZERO=scheme.zero_code, HAS_ZERO=w.zero is not None,
        W_SCALE=scheme.weight_scale, W_GROUP=scheme.weight_group, W_GROUP_N=scheme.weight_group_n,
        W_GROUPS=max(config["BLOCK_K"] // max(scheme.weight_group, 1), 1),
        A_QUANT=_A_QUANT[scheme.act_quant], A_GROUP=max(scheme.act_group, 1), DOT=scheme.dot,
        COMPUTE=_TL_DTYPE[compute_dtype], ASM_DEQUANT=asm,
        ACT_ORDER=w.perm is not None, HAS_BIAS=w.bias is not None, ROUTED_WEIGHT=routed_weight,
        TOP_K=top_k, BATCHED=rows.batched, ONE_PAIR_BLOCKS=rows.one_pair_blocks, WRITE_EMPTY=write_empty,
        FUSE_ACT=fuse_act, SPLIT_K=split_k, AMAX_OUT=amax_pieces is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["BLOCK_K"], GROUP_M=config["GROUP_M"], PDL=pdl,
        num_warps=config["num_warps"], num_stages=config["num_stages"], **triton_ops.pdl_launch(pdl))


def _amax_pieces_shape(scheme: Scheme, tokens: int, top_k: int, config1: dict, w13: _Proj,
                       activation: str) -> tuple[int, int] | None:
    """The shape [rows, column tiles] of the amax pieces GEMM1 leaves, or None: per-token int8
    intermediates (AMAX_PIECES). Their quantisation then cuts rows into chunks like the group
    modes and reads each value once: at decode, instead of one program reading a whole row
    (14336 columns on Mixtral); at prefill, only instead of an amax pass and a codes pass over
    many chunks (1408 columns in 11 on DeepSeek-V2-Lite: the layer 2-3% faster on an H100; on
    Qwen3's 768 in 3 and Mixtral's 14336 in 7, 1% slower: the epilogue's row max costs more)."""
    if scheme.act_quant != "int8_token" or not AMAX_PIECES or config1["SWAP_AB"]:
        return None
    width = w13.n // 2 if activation != "none" else w13.n
    if tokens > AMAX_PIECES_MAX_TOKENS and triton_ops.prefill_row_chunks(width) <= AMAX_PIECES_MIN_CHUNKS:
        return None
    return tokens * top_k, _column_tiles(w13.n, config1["BLOCK_N"], activation)


def _quantize(x: torch.Tensor, scheme: Scheme, input_scale: torch.Tensor | None, **kwargs
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM input as the activation key wants it (x itself when unquantized); kwargs go to
    triton_ops.act_quant."""
    if scheme.act_quant == "none":
        return x, None
    return triton_ops.act_quant(x, "none", scheme.act_quant, static_scale=input_scale,
                                group=scheme.act_group or 128, **kwargs)


def _projections(hidden_size: int, w13: torch.Tensor, w13_scale, w13_zero, w13_perm, w13_bias,
                 w13_input_scale, w2: torch.Tensor, w2_scale, w2_zero, w2_perm, w2_bias,
                 w2_input_scale) -> tuple[_Proj, _Proj]:
    n13 = w13.shape[1]
    return (_Proj(w13, w13_scale, w13_zero, w13_perm, w13_bias, w13_input_scale, n13, hidden_size),
            _Proj(w2, w2_scale, w2_zero, w2_perm, w2_bias, w2_input_scale, w2.shape[1], n13 // 2))


def _fused_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   w13: _Proj, w2: _Proj, weight_key: str, activation_key: str, activation: str,
                   router_weight_on_input: bool) -> torch.Tensor:
    """align (+ quantise(hidden); one token: quantise only) -> GEMM1 + act -> quantise? -> GEMM2
    (split-K) -> sum (top-k, splits)."""
    scheme = scheme_from_keys(weight_key, activation_key)
    m, top_k = topk_ids.shape
    # top-1 layers may write GEMM2 straight into out, where the row of a foreign pair (expert
    # parallelism: id outside [0, E), never computed) must read zero; the top-k sum skips them.
    # Zeroed here, ahead of the launch chain, not between its kernels.
    out = torch.zeros_like(hidden) if top_k == 1 else torch.empty_like(hidden)
    if m == 0:
        return out
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    num_experts = w13.weight.shape[0]
    on_input = router_weight_on_input
    if on_input and top_k != 1:
        raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got {top_k}")
    config1, config2 = _layer_configs(m, top_k, num_experts, w13, w2, weight_key, activation_key, scheme,
                                      hidden.device, split_gemm2=True)
    weights = topk_weights.reshape(-1).to(torch.float32)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    dev, dt = hidden.device, hidden.dtype

    # quantised activations take the router weight before quantising (as the reference does);
    # 16-bit ones take it in GEMM1's epilogue, before the bias. Alignment and the input's
    # quantisation share one launch at decode.
    row_scale = weights if on_input and scheme.act_quant != "none" else None
    # the layer's launches form one programmatic-dependent-launch chain where the GPU has it: each
    # kernel is scheduled while the one before drains, and waits for its writes before starting
    pdl = triton_ops.pdl_supported(hidden.device)
    if m == 1:  # one token: a row block per expert it picked, straight from the router's ids
        a1, a1_scale = _quantize(hidden, scheme, w13.input_scale, row_scale=row_scale, pdl=pdl)
        rows = _Rows(expert_ids=topk_ids.reshape(-1).contiguous(), num_valid=top_k, one_pair_blocks=True)
    else:
        sorted_ids, expert_ids, num_post, a1, a1_scale = triton_ops.align_quant(
            topk_ids, num_experts, config1["BLOCK_M"], hidden, scheme.act_quant, static_scale=w13.input_scale,
            row_scale=row_scale, group=scheme.act_group or 128, pdl=pdl)
        rows = _Rows(sorted_ids, expert_ids, num_post, num_valid=m * top_k)
    gemm1_weight = "input" if on_input and scheme.act_quant == "none" else "none"
    inter = torch.empty(m * top_k, w13.n // 2, dtype=dt, device=dev)
    pieces = _amax_pieces_shape(scheme, m, top_k, config1, w13, activation)
    amax = torch.empty(pieces, dtype=torch.float32, device=dev) if pieces else None
    _gemm(a1, a1_scale, w13, scheme, inter, rows, config1, compute_dtype=dt, top_k=top_k,
          routed_weight=gemm1_weight, topk_weights=weights, fuse_act=activation, amax_pieces=amax, pdl=pdl)

    a2, a2_scale = _quantize(inter, scheme, w2.input_scale, amax_pieces=amax, pdl=pdl)
    split = config2["SPLIT_K"]
    if split > 1:
        partial = torch.empty(split, m * top_k, w2.n, dtype=torch.float32, device=dev)
    else:
        partial = out if top_k == 1 else torch.empty(m * top_k, w2.n, dtype=dt, device=dev)
    _gemm(a2, a2_scale, w2, scheme, partial, rows, config2, compute_dtype=dt,
          routed_weight="none" if on_input else "output", topk_weights=weights, pdl=pdl)
    if partial is not out:
        triton_ops.sum_topk(partial.view(split, m, top_k, w2.n), out=out, pdl=pdl, topk_ids=topk_ids,
                            num_experts=num_experts)
    return out


def _fused_experts_batched(x: torch.Tensor, expert_num_tokens: torch.Tensor, w13: _Proj, w2: _Proj,
                           weight_key: str, activation_key: str, activation: str) -> torch.Tensor:
    scheme = scheme_from_keys(weight_key, activation_key)
    num_experts, capacity, hidden_size = x.shape
    out = torch.empty_like(x)
    if capacity == 0:
        return out
    # the capacity as rows per expert: tokens = capacity, top-k 1 over one expert's slab
    config1, config2 = _layer_configs(capacity, 1, 1, w13, w2, weight_key, activation_key, scheme, x.device,
                                      split_gemm2=False)
    rows = _Rows(expert_num_tokens=expert_num_tokens, capacity=capacity)
    # rows past an expert's count are skipped (left unwritten) until GEMM2 writes them as zeros
    counts = {"expert_num_tokens": expert_num_tokens, "capacity": capacity}
    a1, a1_scale = _quantize(x.reshape(num_experts * capacity, hidden_size), scheme, w13.input_scale, **counts)
    inter = torch.empty(num_experts * capacity, w13.n // 2, dtype=x.dtype, device=x.device)
    _gemm(a1, a1_scale, w13, scheme, inter, rows, config1, compute_dtype=x.dtype, fuse_act=activation)
    a2, a2_scale = _quantize(inter, scheme, w2.input_scale, **counts)
    _gemm(a2, a2_scale, w2, scheme, out.view(num_experts * capacity, hidden_size), rows, config2,
          compute_dtype=x.dtype, write_empty=True)
    return out


# ---------------------------------------------------------------------------------------------
# custom ops: the whole layer is one opaque op for torch.compile


@torch.library.custom_op("moe_registry::fused_experts", mutates_args=())
def fused_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13: torch.Tensor, w13_scale: torch.Tensor | None, w13_zero: torch.Tensor | None,
                  w13_perm: torch.Tensor | None, w13_bias: torch.Tensor | None,
                  w13_input_scale: torch.Tensor | None,
                  w2: torch.Tensor, w2_scale: torch.Tensor | None, w2_zero: torch.Tensor | None,
                  w2_perm: torch.Tensor | None, w2_bias: torch.Tensor | None,
                  w2_input_scale: torch.Tensor | None,
                  weight_key: str, activation_key: str, activation: str,
                  router_weight_on_input: bool) -> torch.Tensor:
    """The standard-format MoE layer [M, H] -> [M, H] on ``nk``-layout weights (ProjectionWeights
    fields, flattened); the keys are QuantKey strings."""
    p13, p2 = _projections(hidden.shape[1], w13, w13_scale, w13_zero, w13_perm, w13_bias, w13_input_scale,
                           w2, w2_scale, w2_zero, w2_perm, w2_bias, w2_input_scale)
    return _fused_experts(hidden, topk_weights, topk_ids, p13, p2, weight_key, activation_key, activation,
                          router_weight_on_input)


@fused_experts.register_fake
def _(hidden, *args):
    return torch.empty_like(hidden)


@torch.library.custom_op("moe_registry::fused_experts_batched", mutates_args=())
def fused_experts_batched(x: torch.Tensor, expert_num_tokens: torch.Tensor,
                          w13: torch.Tensor, w13_scale: torch.Tensor | None, w13_zero: torch.Tensor | None,
                          w13_perm: torch.Tensor | None, w13_bias: torch.Tensor | None,
                          w13_input_scale: torch.Tensor | None,
                          w2: torch.Tensor, w2_scale: torch.Tensor | None, w2_zero: torch.Tensor | None,
                          w2_perm: torch.Tensor | None, w2_bias: torch.Tensor | None,
                          w2_input_scale: torch.Tensor | None,
                          weight_key: str, activation_key: str, activation: str) -> torch.Tensor:
    """The batched-format layer: x [E, T, H] with expert_num_tokens [E] -> [E, T, H] (rows past a
    count are zero; no router weights)."""
    p13, p2 = _projections(x.shape[2], w13, w13_scale, w13_zero, w13_perm, w13_bias, w13_input_scale,
                           w2, w2_scale, w2_zero, w2_perm, w2_bias, w2_input_scale)
    return _fused_experts_batched(x, expert_num_tokens, p13, p2, weight_key, activation_key, activation)


@fused_experts_batched.register_fake
def _(x, *args):
    return torch.empty_like(x)


# ---------------------------------------------------------------------------------------------
# Experts


def _kernel_tensors(p: ProjectionWeights) -> list[torch.Tensor | None]:
    """The projection's tensors in custom-op order, contiguous, router-side dtypes fixed once."""
    def ready(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t if dtype is None else t.to(dtype)
        return t.contiguous()

    return [ready(p.weight), ready(p.scale), ready(p.zero), ready(p.perm, torch.int32),
            ready(p.bias, torch.float32), ready(p.input_scale, torch.float32)]


class _TritonBase(Experts):
    def __init__(self, weights: ExpertWeights, config: ExpertsConfig) -> None:
        super().__init__(weights, config)
        if weights.layout != "nk":
            raise ValueError(f"the Triton MoE kernel reads layout 'nk', got {weights.layout!r}")
        self.weight_key = str(weights.weight_key)
        self.activation_key = str(weights.activation_key)
        self.scheme = scheme_from_keys(self.weight_key, self.activation_key)  # raises early if unsupported
        self._tensors = _kernel_tensors(weights.w13) + _kernel_tensors(weights.w2)


class TritonExperts(_TritonBase):
    """Standard activation format: hidden [M, H] with top-k routing."""

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.moe_registry.fused_experts(
            hidden, topk_weights, topk_ids, *self._tensors, self.weight_key, self.activation_key,
            self.config.activation, self.config.apply_router_weight_on_input)


class TritonBatchedExperts(_TritonBase):
    """Batched activation format (expert parallelism): x [E, T, H] and expert_num_tokens [E]."""

    def apply_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor) -> torch.Tensor:
        """[E, T, H] -> [E, T, H]: the first expert_num_tokens[e] rows of x[e] through expert e,
        rows past the count zero. No router weights (finalize applies them)."""
        return torch.ops.moe_registry.fused_experts_batched(
            x, expert_num_tokens.to(torch.int32), *self._tensors, self.weight_key, self.activation_key,
            self.config.activation)

    def apply(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """The standard format through the same weights (for callers that hold both formats)."""
        return torch.ops.moe_registry.fused_experts(
            hidden, topk_weights, topk_ids, *self._tensors, self.weight_key, self.activation_key,
            self.config.activation, self.config.apply_router_weight_on_input)
