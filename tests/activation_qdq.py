"""Activation quantise-dequantise in float64, by name: the schemes' (as the kernels quantise a GEMM's input) and
what each producer's own quantized linear does to its 2-D input, written from the producers' code. Shared by the
producer suites (tests/test_producers*.py).

The schemes: ``static`` (fp8, x / s with the given scale), ``token`` (fp8, amax / 448 per row), ``group128``
(fp8, per 128 columns of a row), ``tensor`` (fp8, one amax over x), ``int8_token`` (amax / 127.5 per row, codes
-128..127), ``int8_tensor`` (static int8 with the stored scale), ``mxfp8`` (ModelOpt's MXFP8: exponent
ceil(log2(amax / 448)) per 32 inputs). The producers' linears: compressed-tensors divides and multiplies in
bfloat16 with bfloat16 scales (``ct_static``); its 'token' strategy keeps dims 0 and 1, so a 2-D input gets ONE
scale (``ct_whole``, ``int8_whole_bf16``); ``ct_group128`` per 128 columns of a row; ModelOpt in float32 with its
float32 input_scale (``modelopt_static``); Quark per token with the scale rounded to bfloat16
(``int8_token_bf16_scale``). None: no quantisation.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16, in float64."""
    return t.to(torch.bfloat16).double()


def fp8(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float8 e4m3 (saturating), in float64."""
    return t.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).double()


def int8_token(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True) / 127.5
    return torch.round(x / s).clamp(-128, 127) * s


def int8_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.double()
    return torch.round(x / s).clamp(-128, 127) * s


def mxfp8(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 448.0)), torch.full_like(amax, -127.0)).clamp(-127, 127)
    q = (blocks / torch.exp2(e)).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (q * torch.exp2(e)).reshape(x.shape)


def qdq(how: str | None, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` quantised and dequantised the way ``how`` names (see the module docstring), in float64."""
    x = x.double()
    if how is None:
        return x
    if how in ("static", "ct_static", "modelopt_static", "int8_tensor"):
        assert scale is not None, f"{how} needs the stored input scale"
    if how == "static":
        return fp8(x / scale.double()) * scale.double()
    if how in ("token", "group128"):
        s = x.reshape(x.shape[0], -1, x.shape[1] if how == "token" else 128).abs().amax(-1, keepdim=True)
        s = s.clamp(min=1e-10) / FP8_MAX
        return (fp8(x.reshape(*s.shape[:2], -1) / s) * s).reshape(x.shape)
    if how == "tensor":
        s = x.abs().max().clamp(min=1e-10) / FP8_MAX
        return fp8(x / s) * s
    if how == "ct_static":
        s = bf16(scale)
        return bf16(fp8(bf16(x / s)) * s)
    if how in ("ct_whole", "ct_group128"):
        groups = x.reshape(1, -1) if how == "ct_whole" else x.reshape(x.shape[0], -1, 128)
        s = bf16(groups.abs().amax(-1, keepdim=True) / FP8_MAX)
        return bf16(fp8(bf16(groups / s)) * s).reshape(x.shape)
    if how == "modelopt_static":
        s = scale.float()
        return fp8((x.float() / s).double()) * s.double()
    if how == "int8_token":
        return int8_token(x)
    if how == "int8_token_bf16_scale":
        s = bf16(bf16(x.abs().amax(-1, keepdim=True)) / 127.5)
        return torch.round(x / s).clamp(-128, 127) * s
    if how == "int8_whole_bf16":
        s = bf16(x.abs().amax() / 127.5)
        return torch.round(bf16(x / s)).clamp(-128, 127) * s
    if how == "int8_tensor":
        return int8_tensor(x, scale)
    if how == "mxfp8":
        return mxfp8(x)
    raise AssertionError(how)
