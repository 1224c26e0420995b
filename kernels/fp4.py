"""FP4 (e2m1) codes in torch: the one definition of what a 4-bit float code means, and the
round-to-nearest encoder quant_ref uses for the conformance weights.

A code is 1 sign bit (bit 3), 2 exponent bits and 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2,
3, 4, 6 (OCP MX v1.0, the table transformers' ``integrations/mxfp4.py`` calls FP4_VALUES). Packed
two per byte, the low nibble is the even input column (gpt-oss blocks, ModelOpt and
compressed-tensors NVFP4 alike), the ``nk`` layout of every 4-bit type here.
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "E2M1_MAX", "e2m1_to_float", "float_to_e2m1"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
# midpoints between consecutive magnitudes; a tie goes to the even code (mantissa bit 0)
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_to_float(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integer codes 0..15 (any integer dtype) -> their e2m1 values in ``dtype`` (exact)."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return table[codes.to(torch.int64)]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Values already divided by their scale -> uint8 codes 0..15, round to nearest (ties to the
    even code), saturating at +-6 (what the quantizers write)."""
    mag = x.abs().to(torch.float32)
    bounds = torch.tensor(_BOUNDS, dtype=torch.float32, device=x.device)
    idx = torch.bucketize(mag, bounds, right=False)  # mag == bound -> lower index
    # ties: bucketize(right=False) sends a value equal to a bound to the lower code; round half to
    # even wants the upper one where the upper code is even (its mantissa bit is 0)
    tie = (idx < len(_BOUNDS)) & (mag == bounds[idx.clamp(max=len(_BOUNDS) - 1)])
    idx = torch.where(tie & ((idx + 1) % 2 == 0), idx + 1, idx)
    sign = (x < 0) & (idx > 0)
    return (idx + 8 * sign.to(idx.dtype)).to(torch.uint8)
