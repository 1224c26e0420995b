"""The layer's launch chain: programmatic dependent launch (PDL).

Inside the fused layer the kernels run as one chain: on Hopper each is launched with programmatic
dependent launch and starts with :func:`grid_dependency` (the GEMMs with :func:`grid_wait`, and
:func:`grid_release` after their main loop), so the next kernel is scheduled while the previous
one drains (see :func:`pdl_supported`).
"""

import contextlib
import contextvars
import functools
import os

import torch
import triton
import triton.language as tl

from .dequant_ptx import compiles_ptx

try:  # grid dependency control (programmatic dependent launch), Triton builds that have it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover (then pdl_supported() is False and the names are never compiled)
    gdc_launch_dependents = gdc_wait = None


_PLAIN_LAUNCHES: contextvars.ContextVar[bool] = contextvars.ContextVar("moe_plain_launches", default=False)


def pdl_supported(device: torch.device) -> bool:
    """Whether the layer's kernels launch with programmatic dependent launch: a CUDA GPU of
    compute capability 9.0 or later, a Triton that has grid dependency control, not the
    interpreter, not inside :func:`plain_launches`; MOE_REGISTRY_PDL=0 turns it off."""
    return not _PLAIN_LAUNCHES.get() and _pdl_capable(device)


@contextlib.contextmanager
def plain_launches():
    """Layers called inside launch their kernels one after another, without programmatic
    dependent launch: for profiles, where a chained kernel's duration would include its wait
    for the previous one."""
    token = _PLAIN_LAUNCHES.set(True)
    try:
        yield
    finally:
        _PLAIN_LAUNCHES.reset(token)


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    if not compiles_ptx(device):
        return False
    if os.environ.get("MOE_REGISTRY_PDL", "1") == "0" or gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_launch(pdl: bool) -> dict:
    """Launch options of a kernel in the layer's chain (each one passes PDL=pdl too)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """First statement of every small kernel in the layer's chain. Under programmatic dependent
    launch a kernel's programs may be scheduled while the previous kernel drains: each waits here
    until the previous kernel's writes are visible (before reading or writing anything), then lets
    the next kernel be scheduled in turn. So the chain loses its launch gaps and nothing else
    changes."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def grid_wait(PDL: tl.constexpr):
    """First statement of a GEMM in the chain: wait for the previous kernel's writes. The GEMM
    lets the next kernel be scheduled only after its main loop (:func:`grid_release`): released
    at the start, the next GEMM's programs would take the slots of whichever multiprocessors free
    up first and pile onto a few of them, and a small weight-streaming grid then reads memory
    from too few multiprocessors."""
    if PDL:
        gdc_wait()


@triton.jit
def grid_release(PDL: tl.constexpr):
    """Let the next kernel of the chain be scheduled (see :func:`grid_wait`)."""
    if PDL:
        gdc_launch_dependents()
