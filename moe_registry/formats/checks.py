"""Value checks shared by the converters. A bad scale would not fail loudly at run time (it turns
whole experts into NaN or zero), so converters reject it at load, naming the tensor, what was
found and what was wanted."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moe_registry.checkpoint.values import describe_bad
from moe_registry.core.errors import CheckpointError

__all__ = ["require", "check_scales", "check_finite", "check_e8m0_codes", "cast_scales", "E8M0_NAN"]

E8M0_NAN = 255  # the E8M0 exponent byte that encodes NaN (OCP MX v1.0)


def require(tensors: Mapping[str, torch.Tensor], tensor: str, full_name: str) -> torch.Tensor:
    """``tensors[tensor]``, or a CheckpointError naming the missing checkpoint tensor."""
    try:
        return tensors[tensor]
    except KeyError:
        have = ", ".join(sorted(tensors)) or "none"
        raise CheckpointError(f"missing checkpoint tensor {full_name} (this projection has: {have})") from None


def check_finite(t: torch.Tensor, full_name: str) -> None:
    """Reject NaN or infinite values (biases, unquantized tensors)."""
    if not t.is_floating_point():
        return
    v = t.float()
    for mask, what in ((torch.isnan(v), "NaN"), (torch.isinf(v), "infinite")):
        if bool(mask.any()):
            raise CheckpointError(f"{full_name}: {describe_bad(v, mask, what)}; expected finite values")


def check_e8m0_codes(t: torch.Tensor, full_name: str) -> None:
    """MX scales stored as raw uint8 exponent bytes (the load guard sees only uint8): 255 is E8M0's NaN."""
    nan = t == E8M0_NAN
    if bool(nan.any()):
        raise CheckpointError(f"{full_name}: {describe_bad(t, nan, '255, the E8M0 NaN encoding')}; "
                              "expected exponents 0..254")


def check_scales(t: torch.Tensor, full_name: str, *, signed: bool = False) -> None:
    """Scales must be finite and strictly positive: NaN/inf poison every output, zero silences a
    group, a negative scale flips its sign — none occurs in a well-formed checkpoint, except where the
    scheme binds ``signed_scales`` (AutoRound's symmetric int4 maps each group's largest-magnitude value to
    -8, so the scale carries that value's sign): then only zero, NaN and infinity are refused."""
    v = t.float()
    # one pass and one host sync for the well-formed checkpoint (a converter checks every expert's scales); the
    # message's pass only where something is wrong
    ok = (v != 0) & torch.isfinite(v) if signed else (v > 0) & ~torch.isinf(v)  # (v > 0) is False for NaN
    if bool(ok.all()):
        return
    for mask, what in (
        (torch.isnan(v), "NaN"),
        (torch.isinf(v), "infinite"),
        (v == 0, "zero"),
        (v < 0 if not signed else torch.zeros_like(v, dtype=torch.bool), "negative"),
    ):
        if bool(mask.any()):
            raise CheckpointError(
                f"{full_name}: {describe_bad(v, mask, what)}; expected finite scales "
                + ("other than 0" if signed else "> 0")
            )


def cast_scales(t: torch.Tensor, dtype: torch.dtype, full_name: str) -> torch.Tensor:
    """``t`` (already checked) in ``dtype``; a value the cast turns to inf or zero is an error,
    not a silent change of the model."""
    out = t.to(dtype)
    if out.dtype == t.dtype or not out.is_floating_point():
        return out
    v = out.float()
    mask = torch.isinf(v) | (v == 0)
    if bool(mask.any()):
        raise CheckpointError(
            f"{full_name}: {describe_bad(t.float(), mask, f'not representable in {dtype}')}, "
            f"which becomes {v[mask][0].item()}; expected scales within {dtype}'s range"
        )
    return out
