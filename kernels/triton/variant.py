"""The weight and activation keys read as the Triton MoE kernels' choices.

:class:`KernelVariant` is what the GEMM kernels (:mod:`moe_registry_kernels.triton.gemm`) are specialised
on: the weight code type, how weights are scaled (none, per channel, per group, per 128x128
block, MX e8m0) and how activations are quantised. :func:`variant_from_keys` reads QuantKey
strings into one and refuses keys the kernels cannot run; :func:`swappable` says which variants the
swapped-operand kernel takes. The few facts that follow from the weight type or the activation
quantisation alone (:func:`packed`, :func:`zero_code`, :func:`dot_kind`) are constexpr functions:
the host reads them through KernelVariant, the kernels derive their constexprs with the same functions.
"""



import functools
from dataclasses import dataclass

import triton

from moe_registry.core.keys import QuantKey, parse_quant_key

__all__ = ["KernelVariant", "variant_from_keys", "swappable", "packed", "zero_code", "dot_kind", "float_w4a8"]

# 4-bit code types, two codes per byte (low nibble: the even input column); e2m1 is FP4
PACKED_TYPES = ("uint4", "uint4b8", "int4", "e2m1")
# the code of 0 of types with a fixed bias; signed int4 nibbles and int8 bytes are read as offset
# binary (xor-ed with 8 and 0x80 first), so they share the unsigned types' bias
ZERO_CODES = {"uint4b8": 8, "int4": 8, "uint8b128": 128, "int8": 128}
# fp8 activations with one scale per token or per tensor (static, or dynamic: fp8_tensor is one
# amax over the whole GEMM input, as vLLM's fp8 MoE quantises it): an fp8 x fp8 dot accumulating in
# float32 over all of K, the token and channel scales applied once after the loop
FP8_OUTER_QUANTS = ("fp8_static", "fp8_token", "fp8_tensor")
# W4A8 tiles of at most this many rows run a 16-bit dot of the codes (see float_w4a8)
W4A8_FLOAT_MAX_ROWS = 32


@triton.constexpr_function
def packed(weight_type: str) -> bool:
    """Whether codes of this type come two to a byte."""
    return weight_type in PACKED_TYPES


@triton.constexpr_function
def zero_code(weight_type: str) -> int:
    """The code of 0 for types with a fixed bias (0 for the others: no bias, or zero points)."""
    # (no ZERO_CODES.get: Triton reads this source for its cache key, and refuses method references)
    return ZERO_CODES[weight_type] if weight_type in ZERO_CODES else 0  # noqa: SIM401


@triton.constexpr_function
def dot_kind(act_quant: str) -> str:
    """The tensor-core dot for an activation quantisation: int8, fp8 (128-column groups), fp8_outer
    (per-token or per-tensor fp8: scales applied after the K loop, as int8), or float (16-bit
    activations, weights dequantised in registers; MXFP8 activations too)."""
    if act_quant.startswith("int8"):
        return "int8"
    if act_quant in FP8_OUTER_QUANTS:
        return "fp8_outer"
    return "fp8" if act_quant == "fp8_group" else "float"


@triton.constexpr_function
def float_w4a8(act_quant: str, weight_type: str, block_m: int) -> bool:
    """W4A8 on few rows: int8 activation codes and int4 weight codes are exact in 16 bits and so is
    their float32 dot while |sum| < 2^24 (127 * 8 * K: K <= 16512), so the nibbles' paired
    dequantisation and a 16-bit dot give the int32 dot's value without widening the nibbles to
    int8 in K order (a register shuffle per weight); on 64+ row tiles the int8 dot's rate wins.
    Such a GEMM takes its activation codes as 16-bit floats, converted once by the quantisation
    kernel (activation_quant.INT8_CODE_DTYPES) rather than in the dot's layout by every program."""
    return dot_kind(act_quant) == "int8" and packed(weight_type) and block_m <= W4A8_FLOAT_MAX_ROWS


@dataclass(frozen=True)
class KernelVariant:
    """The weight and activation keys, read as the kernel's constexpr choices."""

    weight_type: str  # float | uint4 | uint4b8 | int4 | uint8 | uint8b128 | int8 | fp8e4m3
    weight_scale: str  # none | group | channel (also per-tensor, stored [E, N, 1]) | block | mx
    weight_group: int  # input columns sharing a weight scale (group, block, mx); 0 otherwise
    weight_group_n: int  # output rows sharing a weight scale (block); 1 otherwise
    act_quant: str  # none | int8_token | int8_static | fp8_group | mxfp8 (activation_quant.QUANT_MODES) | fp8_token |
    #                 fp8_tensor (fp8_act) | fp8_static
    act_group: int  # input columns sharing an activation scale (fp8_group, mxfp8); 0 otherwise
    weight_scale2: bool = False  # a per-expert global weight scale (NVFP4), applied to the dot's result

    @property
    def packed(self) -> bool:
        """Two 4-bit codes per byte."""
        return packed(self.weight_type)

    @property
    def zero_code(self) -> int:
        """See :func:`zero_code`."""
        return zero_code(self.weight_type)

    @property
    def paired_dequant(self) -> bool:
        """Whether the dequantisation has a paired 16-bit PTX form (see
        :mod:`moe_registry_kernels.triton.dequant_ptx`): 4-bit codes, or 8-bit integer codes whose scales
        are 16-bit (group) or applied to the dot's result (channel), or MX fp8 codes (whose
        power-of-two scales it folds, where exact: launch._e4m3_folded); float32 block scales
        would be rounded by it."""
        return self.packed or (self.weight_type in ("uint8", "uint8b128", "int8")
                               and self.weight_scale in ("group", "channel")) or (
            self.weight_type == "fp8e4m3" and self.weight_scale == "mx")

    @property
    def dot(self) -> str:
        """See :func:`dot_kind`."""
        return dot_kind(self.act_quant)

    def float_w4a8(self, block_m: int) -> bool:
        """See :func:`float_w4a8`: whether tiles of ``block_m`` rows run the codes' 16-bit dot."""
        return _float_w4a8_on_host(self.act_quant, self.weight_type, block_m)


# float_w4a8 as the host asks it every layer call: a constexpr function's call costs ~6 us
_float_w4a8_on_host = functools.cache(float_w4a8)


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
    fp8_scaled = name == "fp8e4m3" and spec.dtype.name == "float32" and spec.group.cols == -1
    if fp8_scaled and not spec.dynamic and spec.group.rows == -1:
        return "fp8_static", 0
    if fp8_scaled and spec.dynamic and spec.group.rows in (1, -1):  # per token / per tensor
        return ("fp8_token" if spec.group.rows == 1 else "fp8_tensor"), 0
    if name == "fp8e4m3" and spec.dtype.name == "e8m0" and spec.dynamic and spec.group.cols == 32:
        return "mxfp8", 32
    if name == "fp8e4m3" and spec.dtype.name == "float32" and spec.dynamic and spec.group.rows == 1 \
            and spec.group.cols > 0:
        return "fp8_group", spec.group.cols
    raise ValueError(f"the Triton MoE kernel has no activation quantisation for key {key}")


@functools.cache
def variant_from_keys(weight_key: str, activation_key: str) -> KernelVariant:
    """Read the keys (string form) as kernel choices; ValueError naming the key it cannot run."""
    wk, ak = parse_quant_key(weight_key), parse_quant_key(activation_key)
    wtype = wk.dtype.name if wk.quantized else "float"
    wscale, wgroup, wgroup_n = _weight_scale(wk)
    aquant, agroup = _act_quant(ak)
    variant = KernelVariant(wtype, wscale, wgroup, wgroup_n, aquant, agroup, wk.scale2 is not None)
    for name, value in (("weight", wgroup), ("activation", agroup)):
        if value and value & (value - 1):
            raise ValueError(f"{name} group {value} is not a power of two (keys {weight_key!r}, {activation_key!r})")
    if variant.dot == "int8" and (wtype != "int8" or wscale != "channel") and not _w4a8(variant):
        raise ValueError(f"int8 activations need int8 weights with per-channel/tensor scales (or uint4b8 with "
                         f"group or channel scales), got {weight_key!r}")
    if variant.dot == "fp8" and (wtype != "fp8e4m3" or wscale != "block" or wgroup % agroup):
        raise ValueError(f"fp8 group activations need fp8 weights with block scales, got {weight_key!r}")
    if variant.dot == "fp8_outer" and (wtype != "fp8e4m3" or wscale != "channel"):
        raise ValueError(f"per-token/per-tensor fp8 activations need fp8 weights with per-channel/tensor scales, "
                         f"got {weight_key!r}")
    if wtype == "fp8e4m3" and wscale not in ("mx", "block", "channel"):
        raise ValueError(f"fp8 weights need e8m0 per-32, 128x128 block or per-channel/tensor scales here, "
                         f"got {weight_key!r}")
    if wtype == "e2m1" and (wscale not in ("mx", "group") or aquant != "none"):
        raise ValueError(f"e2m1 weights need e8m0 or e4m3 group scales and 16-bit activations, got "
                         f"{weight_key!r}, {activation_key!r}")
    if wk.scale2 is not None and (wtype != "e2m1" or wk.scale2.group.cols != -1 or wk.scale2.group.rows != -1):
        raise ValueError(f"a second-level weight scale is run here for e2m1 per tensor only, got {weight_key!r}")
    if wtype in ("uint4", "uint8") and wk.zero_point != "group":
        raise ValueError(f"{wtype} weights need zero points (zp:group), got {weight_key!r}")
    return variant


def _w4a8(variant: KernelVariant) -> bool:
    """int4 weights on the int8 dot: symmetric codes (uint4b8), per-channel or per-group scales."""
    return variant.weight_type == "uint4b8" and variant.weight_scale in ("channel", "group")


def swappable(variant: KernelVariant) -> bool:
    """Whether the swapped-operand kernel runs the variant: weights dequantised to the 16-bit
    activation dtype in registers (activations unquantized, no 128x128 blocks), or fp8 weights on
    the fp8 dot (per-channel with per-token or per-tensor activations, or 128x128 blocks with
    128-column groups); not the int8 dot."""
    if variant.dot in ("fp8", "fp8_outer"):
        return True
    return variant.dot == "float" and variant.act_quant == "none" and variant.weight_scale != "block"
