"""The Triton kernels' public surface for tools (benchmarks, the tuner, profilers, SASS reports): the
Experts classes, the glue ops, tile tables and config fitting, the launch chain switch, and the
layer's GEMM launches as they would be made for given sizes and tile configs
(:func:`gemm_launches`). Tools import these names only, never a module's private ones, so the
package can be rearranged without breaking them.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from moe_registry.formats.weights import ExpertWeights

from . import activation_quant, dequant_ptx, launch, layout, plan, tile_config
from .activation_quant import act_quant
from .align import align, align_quant, align_sizes
from .chain import plain_launches
from .decode_gemv import _decode_gemv_kernel
from .experts import TritonBatchedExperts, TritonExperts
from .gemm import _fused_moe_kernel, _fused_moe_swap_kernel
from .layer import _projections
from .reduce import sum_topk
from .tile_config import (
    CONFIG_DIR,
    config_file,
    config_override,
    default_config,
    get_config,
    group_dot_width,
    nearest_shape_config,
    shape_key,
    takes_zero_sums,
    zero_sums_fit,
)
from .variant import KernelVariant, swappable, variant_from_keys

__all__ = [
    "TritonExperts", "TritonBatchedExperts", "KernelVariant", "variant_from_keys", "swappable",
    "act_quant", "align", "align_quant", "align_sizes", "sum_topk", "plain_launches",
    "CONFIG_DIR", "config_file", "config_override", "default_config", "get_config", "nearest_shape_config",
    "group_dot_width", "shape_key",
    "takes_zero_sums", "zero_sums_fit", "fit_config", "fit_pair", "load_config_file", "device_name", "num_sms",
    "GEMM_KERNEL_NAMES", "GemmLaunch", "gemm_launches", "recorded_gemm_launches",
]

# the names the GEMM kernels carry in profiles and in the launcher module (the tile kernels, the swapped-operand
# one, the decode GEMV)
GEMM_KERNEL_NAMES = tuple(k.fn.__name__ for k in (_fused_moe_kernel, _fused_moe_swap_kernel, _decode_gemv_kernel))


def fit_config(config: dict, variant: KernelVariant, *, can_split: bool, can_swap: bool = True) -> dict:
    """A tile config made legal for the variant (what the kernels' static asserts check)."""
    return tile_config._fit_config(config, variant, can_split=can_split, can_swap=can_swap)


def fit_pair(config1: dict, config2: dict, variant: KernelVariant, *, split_gemm2: bool = True) -> tuple[dict, dict]:
    """A layer's GEMM1 and GEMM2 configs made legal together (GEMM2 on GEMM1's BLOCK_M)."""
    return tile_config._fit_pair(config1, config2, variant, split_gemm2=split_gemm2)


def load_config_file(path: Path) -> dict | None:
    """A tuned table as the layer reads it (cached; None where there is no file)."""
    return tile_config._load_config_file(path)


def device_name(device: torch.device) -> str:
    """The name tuned tables are filed under for ``device``."""
    return tile_config._device_name(device)


def num_sms(device: torch.device) -> int:
    """The multiprocessors the default tile configs aim to keep busy on ``device``."""
    return tile_config._num_sms(device)


@dataclass(frozen=True)
class GemmLaunch:
    """One GEMM launch of a layer call, recorded (not run): the Triton kernel, its arguments and the
    tile it runs (its tile config, or the decode GEMV's own)."""

    kernel: object
    args: tuple
    kwargs: dict
    tile: dict


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the launch as (kernel, grid,
    args, kwargs) and, ``run``, makes it."""

    def __init__(self, fn, launches: list, run: bool = False) -> None:
        self.fn, self.launches, self.run = fn, launches, run

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append((self.fn, grid, args, kwargs))
            if self.run:
                self.fn[grid](*args, **kwargs)
        return record


@contextlib.contextmanager
def recorded_gemm_launches(launches: list, *, run: bool = True):
    """Within it, each GEMM launch a layer makes (the kernels of GEMM_KERNEL_NAMES) is appended to ``launches`` as
    (kernel, grid, args, kwargs) and, ``run``, made: the arguments hold the very buffers the call used, so the
    launches can be made again on their own (tools/bench.py times the GEMMs alone so)."""
    with contextlib.ExitStack() as stack:
        for name in GEMM_KERNEL_NAMES:
            stack.enter_context(mock.patch.object(launch, name, _Recorder(getattr(launch, name), launches, run)))
        yield launches


def _meta(t: torch.Tensor | None, experts: int) -> torch.Tensor | None:
    """A meta-device tensor laid out as ``t`` (a transposed scale stays transposed) with ``experts`` on
    its first dimension, each expert right after the one before."""
    if t is None:
        return None
    expert_span = max((n * s for n, s in zip(t.shape[1:], t.stride()[1:], strict=True)), default=1)
    return torch.empty_strided((experts, *t.shape[1:]), (expert_span, *t.stride()[1:]), dtype=t.dtype,
                               device="meta")


def gemm_launches(one_expert: ExpertWeights, num_experts: int, top_k: int, m: int, *, device_name: str,
                  sms: int, overrides: dict | None = None, activation: str = "silu",
                  capability: tuple[int, int] = (9, 0)) -> list[GemmLaunch]:
    """The layer's two GEMM launches for ``m`` tokens on a GPU of ``capability`` (default sm_90) named
    ``device_name`` with ``sms`` multiprocessors (paired PTX dequantisation and dependent launch where that
    GPU has them, the GPU's fp8 cast), on the meta
    device: weights laid out as ``one_expert``'s (converted, nk) over ``num_experts`` experts, MX scale
    codes as that expert's; tile configs the layer's (tuned for ``device_name``, or the defaults) with
    ``overrides``. Decided as :mod:`.layer` decides a call (one token's GEMMs quantising their own
    input, the decode GEMV, amax and row-sum pieces), in bfloat16."""
    weight_key, activation_key = str(one_expert.weight_key), str(one_expert.activation_key)
    variant = variant_from_keys(weight_key, activation_key)
    packing = layout.TritonWeightLayout(variant)
    e, dt, meta = num_experts, torch.bfloat16, torch.device("meta")

    def projection(p) -> list:
        tensors = [_meta(t, e) for t in packing.pack(p)]
        scale2 = None if p.scale2 is None else torch.empty(e, p.scale2.reshape(1, -1).shape[1], device="meta")
        return [*tensors, scale2]

    t13, t2 = projection(one_expert.w13), projection(one_expert.w2)
    hidden = one_expert.hidden_size
    w13, w2 = _projections(hidden, *t13[:6], *t2[:6], t13[6], t2[6], layout.mx_scale_codes(one_expert, variant))
    launches: list = []
    with contextlib.ExitStack() as stack:
        patches = [(tile_config, "_device_name", lambda device: device_name),
                   (tile_config, "_num_sms", lambda device: sms),
                   (launch, "_paired_halves", lambda device, dtype: dequant_ptx.paired_halves_on(capability, dtype)),
                   (launch, "fp8_pair_convert", lambda device: dequant_ptx.fp8_pair_convert_on(capability)),
                   (launch, "_hardware_fp8_cast", lambda device: True),
                   (launch, "compiles_ptx", lambda device: True),
                   # the decode GEMV's input quantisation: not a GEMM, not run (its outputs on the meta device)
                   (launch, "act_quant", lambda x, activation, quant, *, static_scale=None, **_:
                    activation_quant._fake_quant(x.shape[0], x.shape[1], quant, x, static_scale))]
        for module, name, value in patches:
            stack.enter_context(mock.patch.object(module, name, value))
        stack.enter_context(recorded_gemm_launches(launches, run=False))
        own = plan._quantised_in_gemm(variant, m, top_k, w13, w2, None)
        config1, config2 = tile_config._layer_configs(m, top_k, e, w13, w2, weight_key, activation_key, variant,
                                                      meta, split_gemm2=True,
                                                      tiles_read=(not own.gemv1, not own.gemv2))
        if overrides:
            config1, config2 = tile_config._fit_pair({**config1, **overrides}, {**config2, **overrides}, variant)
        pairs = m * top_k
        pdl = capability >= (9, 0)  # (as chain.pdl_supported decides on such a GPU)
        block_m = launch.GEMV_BLOCK_M if own.gemv1 else config1["BLOCK_M"]  # the decode GEMV's blocks
        def ids(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=torch.int32, device="meta")

        if m == 1:
            rows = launch._Rows(expert_ids=ids(top_k), num_valid=top_k, one_pair_blocks=True)
        else:  # alignment's buffers, sized as align sizes them
            padded, blocks = align_sizes(pairs, e, block_m)
            rows = launch._Rows(ids(padded), ids(blocks), ids(1), num_valid=pairs)
        static = variant.act_quant in launch.STATIC_QUANTS
        a1, a1_scale = _activations(variant, config1, m, hidden, own.gemm1)
        inter = torch.empty(pairs, w13.n // 2, dtype=dt, device="meta")
        weights = torch.empty(pairs, device="meta")
        # (a decode GEMV leaves no pieces and reads none)
        pieces = None if own.gemv1 or own.gemv2 else plan._amax_pieces_shape(variant, m, top_k, config1, w13,
                                                                              activation)
        amax = torch.empty(pieces, device="meta") if pieces else None
        # a ZERO_SUMS GEMM2's input sums: GEMM1's per-tile pieces where it leaves them
        pieces2 = plan._gemm1_sum_pieces(rows, pairs, config1, config2, w13, w2, variant, activation, meta)
        halves = plan._input_halves(config2, w2, activation)
        launch._gemm(a1, a1_scale, w13, variant, inter, rows, config1, compute_dtype=dt, top_k=top_k,
                     topk_weights=weights, fuse_act=activation, amax_pieces=amax, pdl=pdl,
                     input_scale=launch._InputScale(rows=1, static=static, gemv=own.gemv1) if own.gemm1 else None,
                     row_sums=_row_sums(a1, config1, w13, variant, rows),
                     sums_out=pieces2.sums if pieces2 else None, halves_out=halves)
        a2, a2_scale = _activations(variant, config2, pairs, w2.k, own.gemm2)
        scale2 = None
        if own.gemv2:
            scale2 = launch._InputScale(rows=pairs, pair_ids=ids(pairs), static=static, gemv=True)
        elif own.gemm2 and (static or amax is not None):
            scale2 = launch._InputScale(rows=pairs, pieces=amax, pair_ids=ids(pairs), static=static)
        elif own.gemm2:  # GEMM2's input quantised by its own launch after all
            a2, a2_scale = _activations(variant, config2, pairs, w2.k)
        split = 1 if own.gemv2 else config2["SPLIT_K"]
        out = (torch.empty(split, pairs, w2.n, device="meta") if split > 1
               else torch.empty(pairs, w2.n, dtype=dt, device="meta"))
        launch._gemm(a2, a2_scale, w2, variant, out, rows, config2, compute_dtype=dt, routed_weight="output",
                     topk_weights=weights, pdl=pdl, input_scale=scale2,
                     row_sums=pieces2 or _row_sums(a2, config2, w2, variant, rows), input_halves=halves)
    return [GemmLaunch(fn, args, kwargs, _launch_tile(fn, kwargs, cfg))
            for (fn, _, args, kwargs), cfg in zip(launches, (config1, config2), strict=True)]


def _launch_tile(fn, kwargs: dict, config: dict) -> dict:
    """The tile a launch runs: its tile config, or the decode GEMV's own (BLOCK_K: the columns of a
    K step), which reads no tile config."""
    if fn is not _decode_gemv_kernel:
        return config
    return {"BLOCK_M": kwargs["BLOCK_M"], "BLOCK_N": kwargs["BLOCK_N"],
            "BLOCK_K": kwargs["STEP_WORDS"] * (8 if kwargs["PACKED"] else 4), "num_warps": kwargs["num_warps"]}


def _row_sums(a: torch.Tensor, config: dict, w, variant: KernelVariant, rows):
    """The per-group input sums a ZERO_SUMS GEMM reads where GEMM1 left none, as plan._input_row_sums
    gives them: none on one-pair blocks (the kernel sums its row), else row_group_sums' output."""
    from .align import row_sums_output

    if not launch._zero_sums(config, w):
        return None
    if rows.one_pair_blocks:
        return launch._RowSums(None)
    return launch._RowSums(row_sums_output(a, variant.weight_group))


def _activations(variant: KernelVariant, config: dict, rows: int, k: int, own: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes or 16-bit activations, scales) a GEMM with tile ``config`` reads, on the meta device, shaped
    and typed as the layer's quantisation writes them; ``own``: the 16-bit input a GEMM quantises itself
    (and the static scale, if any)."""
    from .fp8_act import FP8_DYNAMIC_MODES

    x = torch.empty(rows, k, dtype=torch.bfloat16, device="meta")
    quant = variant.act_quant
    if quant == "none":
        return x, None
    if own:
        return x, x.new_empty(1, dtype=torch.float32) if quant in launch.STATIC_QUANTS else None
    if quant in FP8_DYNAMIC_MODES:  # per token [T, 1], per tensor [1]
        return (x.new_empty(rows, k, dtype=torch.float8_e4m3fn),
                x.new_empty((rows, 1) if quant == "fp8_token" else (1,), dtype=torch.float32))
    codes, scale = activation_quant._fake_quant(rows, k, quant, x, x.new_empty(1, dtype=torch.float32))
    codes_dtype = plan._codes_dtype(variant, config, torch.bfloat16).get("out_dtype", codes.dtype)
    return codes.new_empty(codes.shape, dtype=codes_dtype), scale
