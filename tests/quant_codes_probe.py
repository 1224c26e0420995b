"""A probe of gemm_common._codes_by_reciprocal for the interpreter and GPU tests: the codes it gives
for values that stress its rounding, and the codes quant_ref's division gives for them."""

import torch
import triton
import triton.language as tl
from moe_registry_kernels.triton.gemm_common import _codes_by_reciprocal

# the codes' values (non-negative; a midpoint between neighbours is a tie of the final rounding)
GRIDS = {"fp8_outer": torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float(),
         "int8": torch.arange(0, 128).float()}
MAX = {"fp8_outer": 448.0, "int8": 127.0}


@triton.jit
def _probe_kernel(x_ptr, out_ptr, scale_ptr, n, DOT: tl.constexpr, HW_FP8_CAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    scale = tl.load(scale_ptr)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    codes = _codes_by_reciprocal(v, scale, tl.math.div_rn(1.0, scale), DOT, HW_FP8_CAST)
    tl.store(out_ptr + offs, codes.to(tl.uint8, bitcast=True), mask=offs < n)


def hard_values(scale: float, dot: str, seed: int) -> torch.Tensor:
    """float32 values at this scale: every code and midpoint (and one float32 step either side),
    past the saturation, tiny, zero, and random over many binades, of both signs."""
    s = torch.tensor(scale, dtype=torch.float32)
    codes = GRIDS[dot]
    top = MAX[dot]
    grid = torch.cat([codes, (codes[1:] + codes[:-1]) / 2,
                      torch.tensor([top, top + 0.5, top * 1.03, top * 1.05, 1e4, 2.0 ** -10, 2.0 ** -11])])
    exact = grid * s
    near = torch.cat([torch.nextafter(exact, torch.tensor(float("inf"))),
                      torch.nextafter(exact, torch.tensor(float("-inf")))])
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-30, 10, (4096,), generator=g).float()) * s * 64
    values = torch.cat([exact, near, rand, torch.zeros(1)])
    return torch.cat([values, -values]).float()


def probe(values: torch.Tensor, scale: float, dot: str, hw_cast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the probe's codes, quant_ref's: (v / scale) rounded half to even and saturated), as bytes,
    the sign of zero dropped (-0 and +0 codes add the same to a dot, and the GEMM may lose it)."""
    s = torch.tensor([scale], dtype=torch.float32, device=values.device)
    out = torch.empty(values.numel(), dtype=torch.uint8, device=values.device)
    _probe_kernel[(triton.cdiv(values.numel(), 1024),)](values, out, s, values.numel(), DOT=dot, HW_FP8_CAST=hw_cast,
                                                        BLOCK=1024)
    q = values.cpu() / s.cpu()
    if dot == "int8":
        want = q.round().clamp(-128.0, 127.0).to(torch.int8).view(torch.uint8)
    else:
        want = q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return _unsigned_zero(out.cpu(), dot), _unsigned_zero(want, dot)


def _unsigned_zero(codes: torch.Tensor, dot: str) -> torch.Tensor:
    return torch.where(codes == 0x80, torch.zeros_like(codes), codes) if dot == "fp8_outer" else codes


def codes_at_scale_of(amax: float, dot: str, device: str, hw_cast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`probe` on :func:`hard_values` at the scale an amax gives (floored at 1e-10)."""
    scale = float(torch.tensor(max(amax, 1e-10), dtype=torch.float32) / MAX[dot])
    return probe(hard_values(scale, dot, seed=3).to(device), scale, dot, hw_cast)
