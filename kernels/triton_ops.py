"""Triton ops around the fused MoE GEMMs: token alignment, gated activations (fused with activation
quantisation), the top-k sum, and the activation quantisers.

Inside the fused layer the kernels run as one chain: on Hopper each is launched with programmatic
dependent launch and starts with :func:`grid_dependency` (the GEMMs with :func:`grid_wait`, and
:func:`grid_release` after their main loop), so the next kernel is scheduled while the previous
one drains (see :func:`pdl_supported`).

Each op is a torch custom op (``torch.ops.moe_registry.<name>``) with a fake implementation, so
torch.compile traces through it without a graph break and CUDA graphs can capture it. None of
them reads a device value on the host: every output is sized from shapes alone.

Quantisation reproduces :mod:`moe_registry_kernels.quant_ref` bit for bit: a true division
(``div_rn``), round half to even, and fp8 rounding done in float32 arithmetic before the final
(then exact) cast, because the Triton interpreter's own float8 cast rounds differently.
"""

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch), Triton builds that have it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover (then pdl_supported() is False and the names are never compiled)
    gdc_launch_dependents = gdc_wait = None

__all__ = [
    "align_sizes",
    "moe_align_block_size",
    "act_and_mul",
    "act_and_mul_quant",
    "moe_sum",
    "quant_int8_per_token",
    "quant_fp8_per_group",
    "quant_mxfp8",
    "act_quant",
    "align",
    "align_quant",
    "align_row_sums",
    "row_group_sums",
    "sum_topk",
    "gated_act",
    "grid_dependency",
    "grid_release",
    "grid_wait",
    "pdl_supported",
    "pdl_launch",
    "plain_launches",
]

MX_GROUP = 32  # MXFP8 block size
# numerics of quant_ref and activations (constexpr so the kernels can read them)
SWIGLUOAI_ALPHA = tl.constexpr(1.702)
SWIGLUOAI_LIMIT = tl.constexpr(7.0)
FP8_MAX = tl.constexpr(448.0)
INT8_MAX = tl.constexpr(127.0)
AMAX_FLOOR = tl.constexpr(1e-10)
# 1.5·2^23: float32 values this large have no fraction bits, so adding and subtracting it rounds
# to an integer (half to even) for |x| < 2^22
RINT_SHIFT = tl.constexpr(12582912.0)

# Up to this many (token, k) pairs, alignment is one launch of one program per ALIGN_PART_PAIRS
# pairs, each recounting all of them (decode); above it, three launches that count chunks once
# (prefill). ALIGN_WARPS: warps of the one-launch alignment.
ALIGN_ONE_LAUNCH_MAX = 1024
ALIGN_PART_PAIRS = 32
ALIGN_WARPS = 4
# sentinel slots stored per step by the alignment kernels
SENTINEL_FILL = 256

# act_quant: columns per program (rows are cut into chunks that run side by side), and the widest
# int8_token row read once (its amax and its codes from the same registers; wider rows are read twice)
ROW_CHUNK = 2048
ROW_BLOCK_MAX = 16384
# act_quant at prefill (this many rows or more): values per program, at most this many rows,
# values per thread (see _act_quant_tile_shape), and the narrowest chunk a row is cut into
# (see _act_quant_launch)
ROW_TILE_MIN_ROWS = 1024
ROW_TILE_ELEMS = 4096
ROW_TILE_MAX_ROWS = 16
ROW_TILE_PER_THREAD = 16
ROW_TILE_MIN_CHUNK = 64
# amax pieces of an int8_token row read per step (a GEMM epilogue leaves one per column tile)
PIECES_STEP = 128

# act_quant modes: how the rows are quantised after the (optional) activation.
QUANT_MODES = ("none", "int8_token", "int8_static", "fp8_static", "fp8_group", "mxfp8")
# int8 codes as act_quant stores them: int8 (None), or their values in a 16-bit float type (exact),
# for GEMM tiles that take them as 16-bit operands (moe_gemm's W4A8_FLOAT)
INT8_CODE_DTYPES = (None, torch.int8, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# programmatic dependent launch


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
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or torch.version.hip:
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


# ---------------------------------------------------------------------------------------------
# alignment: group the (token, k) pairs by expert, each expert padded to a multiple of BLOCK_M


def align_sizes(numel: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """Worst-case (length of sorted_token_ids, number of blocks): every expert that can receive a
    pair (at most min(numel, E) of them) adds at most block_m - 1 padding slots."""
    max_padded = numel + min(numel, num_experts) * (block_m - 1)
    num_blocks = triton.cdiv(max_padded, block_m)
    return num_blocks * block_m, num_blocks


@triton.jit
def _one_hot_chunk(ids_ptr, start, numel, num_experts, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pair indices [CHUNK] and their expert one-hot [CHUNK, BLOCK_E] for pairs start..start+CHUNK.
    Ids outside [0, E) (expert parallelism marks foreign experts -1) match no expert."""
    offs = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    ids = tl.where((ids >= 0) & (ids < num_experts), ids, -1)
    one_hot = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    return offs, one_hot


@triton.jit
def _expert_ranges(counts, BLOCK_M: tl.constexpr):
    """Per-expert [start, end) in the padded order, and the padded total."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    return ends - padded, ends, tl.sum(padded, 0)


@triton.jit
def _fill_expert_ids(expert_ids_ptr, ends, total, first_block, last_block,
                     BLOCK_M: tl.constexpr, TILE_B: tl.constexpr):
    """expert_ids[b] for b in [first_block, last_block): the expert whose range holds the block's
    first slot (= number of experts ending at or before it), or -1 past the padded total."""
    for b in range(first_block, last_block, TILE_B):
        blocks = b + tl.arange(0, TILE_B)
        block_start = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= block_start[:, None]).to(tl.int32), axis=1)
        expert = tl.where(block_start < total, expert, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < last_block)


@triton.jit
def _fill_sentinel(sorted_ptr, first, last, sentinel, FILL: tl.constexpr):
    for p in range(first, last, FILL):
        offs = p + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, tl.zeros([FILL], dtype=tl.int32) + sentinel, mask=offs < last)


@triton.jit
def _expert_of(ids_ptr, offs, numel, num_experts):
    """Expert ids of pairs ``offs``; ids outside [0, E) (expert parallelism marks foreign experts
    -1) and offsets past numel read E, which holds no range."""
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    return tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)


@triton.jit
def _align_part(part, parts, ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_padded,
                num_blocks, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
                EXPERT_TILE: tl.constexpr, FILL: tl.constexpr, TILE_B: tl.constexpr):
    """Program ``part`` of the ``parts`` that align the pairs together in one launch (decode).
    Each counts all pairs per expert and lays out the padded expert ranges (a few hundred pairs:
    cheaper to repeat than to wait for), then writes its own share: the slots of pairs part·CHUNK
    .. +CHUNK (a pair's slot is its expert's start plus the pairs of that expert before it, so an
    expert's pairs keep their order), the padding of its share of the experts, its share of the
    slots past the padded total, and its share of expert_ids. The shares are disjoint: no program
    waits for another, and nothing is written twice."""
    offs = tl.arange(0, PAIRS)
    experts = _expert_of(ids_ptr, offs, numel, num_experts)
    counts = tl.histogram(experts, BINS)
    counts = tl.where(tl.arange(0, BINS) < num_experts, counts, 0)  # bin E held the dropped pairs
    starts, ends, total = _expert_ranges(counts, BLOCK_M)
    if part == 0:
        tl.store(num_post_ptr, total)

    # this part's pairs: slot = expert start + that expert's pairs in earlier parts + in this one
    lo = part * CHUNK
    before = tl.histogram(tl.where(offs < lo, experts, num_experts), BINS)
    mine = tl.arange(0, CHUNK)
    mine_expert = _expert_of(ids_ptr, lo + mine, numel, num_experts)
    same = (mine_expert[None, :] == mine_expert[:, None]) & (mine[None, :] < mine[:, None])
    expert_index = tl.minimum(mine_expert, BINS - 1)
    slot = tl.gather(starts + before, expert_index, 0) + tl.sum(same.to(tl.int32), axis=1)
    tl.store(sorted_ptr + slot, lo + mine, mask=mine_expert < num_experts)

    experts_per_part = tl.cdiv(num_experts, parts)  # padding: an expert's slots after its pairs
    last_expert = tl.minimum(part * experts_per_part + experts_per_part, num_experts)
    for e0 in range(part * experts_per_part, last_expert, EXPERT_TILE):
        e = tl.minimum(e0 + tl.arange(0, EXPERT_TILE), BINS - 1)
        slots = (tl.gather(starts, e, 0) + tl.gather(counts, e, 0))[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + slots, tl.zeros([EXPERT_TILE, BLOCK_M], dtype=tl.int32) + numel,
                 mask=((e0 + tl.arange(0, EXPERT_TILE)) < last_expert)[:, None]
                 & (slots < tl.gather(ends, e, 0)[:, None]))

    tail_per_part = tl.cdiv(max_padded - total, parts)  # slots past the padded total
    tail = total + part * tail_per_part
    _fill_sentinel(sorted_ptr, tail, tl.minimum(tail + tail_per_part, max_padded), numel, FILL)
    blocks_per_part = tl.cdiv(num_blocks, parts)
    first_block = part * blocks_per_part
    _fill_expert_ids(expert_ids_ptr, ends, total, first_block, tl.minimum(first_block + blocks_per_part, num_blocks),
                     BLOCK_M, TILE_B)


@triton.jit
def _align_one_launch_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                             numel, num_experts, max_padded, num_blocks,
                             BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
                             EXPERT_TILE: tl.constexpr, FILL: tl.constexpr, TILE_B: tl.constexpr,
                             PDL: tl.constexpr):
    grid_dependency(PDL)
    _align_part(tl.program_id(0), tl.num_programs(0), ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel,
                num_experts, max_padded, num_blocks, BLOCK_M, PAIRS, BINS, CHUNK, EXPERT_TILE, FILL, TILE_B)


@triton.jit
def _align_count_kernel(ids_ptr, chunk_counts_ptr, rank_ptr, sorted_ptr,
                        numel, num_experts, max_padded, fill_per_program,
                        CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):
    """Chunked path, step 1: per-chunk expert counts, each pair's rank inside its chunk, and this
    program's share of the sentinel fill."""
    grid_dependency(PDL)
    chunk = tl.program_id(0)
    offs, one_hot = _one_hot_chunk(ids_ptr, chunk * CHUNK, numel, num_experts, CHUNK, BLOCK_E)
    tl.store(chunk_counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(one_hot, axis=0))
    rank = tl.sum((tl.cumsum(one_hot, 0) - 1) * one_hot, axis=1)
    tl.store(rank_ptr + offs, rank, mask=offs < numel)
    first = chunk * fill_per_program
    _fill_sentinel(sorted_ptr, first, tl.minimum(first + fill_per_program, max_padded), numel, FILL)


@triton.jit
def _align_prefix_kernel(chunk_counts_ptr, counts_ptr, num_chunks,
                         BLOCK_E: tl.constexpr, E_TILE: tl.constexpr, C_TILE: tl.constexpr, PDL: tl.constexpr):
    """Chunked path, step 2: turn per-chunk counts into the exclusive prefix over chunks (in
    place), one program per E_TILE experts, and store each expert's total."""
    grid_dependency(PDL)
    experts = tl.program_id(0) * E_TILE + tl.arange(0, E_TILE)
    running = tl.zeros([E_TILE], dtype=tl.int32)
    for c in range(0, num_chunks, C_TILE):
        chunks = c + tl.arange(0, C_TILE)
        ptrs = chunk_counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :]
        mask = chunks[:, None] < num_chunks
        x = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(x, 0) - x + running[None, :], mask=mask)
        running += tl.sum(x, axis=0)
    tl.store(counts_ptr + experts, running)


@triton.jit
def _align_scatter_kernel(ids_ptr, chunk_prefix_ptr, rank_ptr, counts_ptr, sorted_ptr, expert_ids_ptr,
                          num_post_ptr, numel, num_experts, num_blocks, blocks_per_program,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
                          TILE_B: tl.constexpr, PDL: tl.constexpr):
    """Chunked path, step 3: every program recomputes the (small) expert ranges, scatters its
    chunk and writes its share of expert_ids."""
    grid_dependency(PDL)
    chunk = tl.program_id(0)
    counts = tl.load(counts_ptr + tl.arange(0, BLOCK_E))
    starts, ends, total = _expert_ranges(counts, BLOCK_M)
    if chunk == 0:
        tl.store(num_post_ptr, total)
    offs, one_hot = _one_hot_chunk(ids_ptr, chunk * CHUNK, numel, num_experts, CHUNK, BLOCK_E)
    base = tl.load(chunk_prefix_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E)) + starts
    valid = tl.sum(one_hot, axis=1) > 0
    dest = tl.sum(one_hot * base[None, :], axis=1) + tl.load(rank_ptr + offs, mask=valid, other=0)
    tl.store(sorted_ptr + dest, offs, mask=valid)
    first = chunk * blocks_per_program
    last = tl.minimum(first + blocks_per_program, num_blocks)
    _fill_expert_ids(expert_ids_ptr, ends, total, first, last, BLOCK_M, TILE_B)


def _expert_id_tile(bins: int) -> int:
    """Blocks per step of _fill_expert_ids: [TILE_B, bins] comparisons, at most 8192 at a time."""
    return max(16, min(256, 8192 // bins))


def _one_launch_grid(numel: int, num_experts: int, block_m: int) -> tuple[int, dict]:
    """(programs, meta) of the one-launch alignment: one program per ALIGN_PART_PAIRS pairs, at
    least one (no pairs still writes num_tokens_post_padded = 0)."""
    bins = max(triton.next_power_of_2(num_experts + 1), 16)  # bin E collects the dropped pairs
    meta = {"BLOCK_M": block_m, "PAIRS": max(triton.next_power_of_2(numel), 16), "BINS": bins,
            "CHUNK": ALIGN_PART_PAIRS, "EXPERT_TILE": min(bins, max(1, 4096 // block_m)), "FILL": SENTINEL_FILL,
            "TILE_B": _expert_id_tile(bins)}
    return max(1, triton.cdiv(numel, ALIGN_PART_PAIRS)), meta


def _alignment_outputs(ids: torch.Tensor, num_experts: int,
                       block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (sorted_token_ids, expert_ids, num_tokens_post_padded) sized for the worst case."""
    max_padded, num_blocks = align_sizes(ids.numel(), num_experts, block_m)
    new = functools.partial(torch.empty, dtype=torch.int32, device=ids.device)
    return new(max_padded), new(num_blocks), new(1)


@dataclass(frozen=True)
class _OneLaunchAlignment:
    """The one-launch alignment of a decode's pairs: its outputs, and what every decode prologue
    kernel passes to :func:`_align_part` (``args``, then ``meta``) over its first ``parts`` programs."""

    ids: torch.Tensor
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_post: torch.Tensor
    num_experts: int
    max_padded: int
    num_blocks: int
    parts: int
    meta: dict

    @property
    def args(self) -> tuple:
        return (self.ids, self.sorted_ids, self.expert_ids, self.num_post, self.ids.numel(), self.num_experts,
                self.max_padded, self.num_blocks)

    @property
    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sorted_token_ids, expert_ids, num_tokens_post_padded)"""
        return self.sorted_ids, self.expert_ids, self.num_post


def _one_launch_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> _OneLaunchAlignment:
    """Outputs and grid of the one-launch alignment (the launch is the caller's, with its row work)."""
    max_padded, num_blocks = align_sizes(ids.numel(), num_experts, block_m)
    parts, meta = _one_launch_grid(ids.numel(), num_experts, block_m)
    return _OneLaunchAlignment(ids, *_alignment_outputs(ids, num_experts, block_m), num_experts, max_padded,
                               num_blocks, parts, meta)


def _flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    ids = topk_ids.reshape(-1)
    return ids if ids.is_contiguous() else ids.contiguous()


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int, one_launch_max: int | None = None,
          pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`moe_align_block_size`; ``one_launch_max`` (default ALIGN_ONE_LAUNCH_MAX) picks
    the path (tests use it); ``pdl``: launch as part of a programmatic-dependent-launch chain."""
    if one_launch_max is None:
        one_launch_max = ALIGN_ONE_LAUNCH_MAX
    ids = _flat_ids(topk_ids)
    numel = ids.numel()
    if numel <= one_launch_max:
        one = _one_launch_alignment(ids, num_experts, block_m)
        _align_one_launch_kernel[(one.parts,)](*one.args, **one.meta, PDL=pdl, num_warps=ALIGN_WARPS,
                                               **pdl_launch(pdl))
        return one.outputs
    max_padded, num_blocks = align_sizes(numel, num_experts, block_m)
    dev = ids.device
    sorted_ids, expert_ids, num_post = _alignment_outputs(ids, num_experts, block_m)

    block_e = max(triton.next_power_of_2(num_experts), 16)
    chunk = max(16, min(256, 16384 // block_e))
    num_chunks = triton.cdiv(numel, chunk)
    chunk_counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=dev)
    rank = torch.empty(numel, dtype=torch.int32, device=dev)
    counts = torch.empty(block_e, dtype=torch.int32, device=dev)
    _align_count_kernel[(num_chunks,)](
        ids, chunk_counts, rank, sorted_ids, numel, num_experts, max_padded,
        triton.cdiv(max_padded, num_chunks), CHUNK=chunk, BLOCK_E=block_e, FILL=SENTINEL_FILL, PDL=pdl, num_warps=8,
        **pdl_launch(pdl))
    e_tile = 16
    _align_prefix_kernel[(block_e // e_tile,)](
        chunk_counts, counts, num_chunks, BLOCK_E=block_e, E_TILE=e_tile, C_TILE=64, PDL=pdl, **pdl_launch(pdl))
    _align_scatter_kernel[(num_chunks,)](
        ids, chunk_counts, rank, counts, sorted_ids, expert_ids, num_post, numel, num_experts,
        num_blocks, triton.cdiv(num_blocks, num_chunks),
        BLOCK_M=block_m, CHUNK=chunk, BLOCK_E=block_e, TILE_B=_expert_id_tile(block_e), PDL=pdl, num_warps=8,
        **pdl_launch(pdl))
    return sorted_ids, expert_ids, num_post


@triton.jit
def _align_quant_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_padded,
                        num_blocks, x_ptr, out_ptr, scale_ptr, static_scale_ptr,
                        row_scale_ptr, counts_ptr, pieces_ptr,
                        D, stride_x, stride_out, stride_scale, capacity, num_pieces, num_rows,
                        parts, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BINS: tl.constexpr,
                        CHUNK: tl.constexpr, EXPERT_TILE: tl.constexpr, FILL: tl.constexpr,
                        TILE_B: tl.constexpr, ACTIVATION: tl.constexpr, QUANT: tl.constexpr,
                        GROUP: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, HAS_COUNTS: tl.constexpr,
                        BLOCK: tl.constexpr, ONE_READ: tl.constexpr, PIECES: tl.constexpr, PDL: tl.constexpr):
    """Decode prologue in one launch: programs 0 .. parts - 1 align the pairs, program parts + r
    quantises input row r. One launch instead of two is a few microseconds of a layer that takes
    tens."""
    grid_dependency(PDL)
    pid = tl.program_id(0)
    if pid < parts:
        _align_part(pid, parts, ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_padded,
                    num_blocks, BLOCK_M, PAIRS, BINS, CHUNK, EXPERT_TILE, FILL, TILE_B)
    else:
        _act_quant_tile((pid - parts).to(tl.int64), x_ptr, out_ptr, scale_ptr, static_scale_ptr, row_scale_ptr,
                        counts_ptr, pieces_ptr, D, stride_x, stride_out, stride_scale, capacity, num_pieces, num_rows,
                        0, D, ACTIVATION, QUANT, GROUP, HAS_ROW_SCALE, HAS_COUNTS, BLOCK, ONE_READ, PIECES, 1)


def align_quant(topk_ids: torch.Tensor, num_experts: int, block_m: int, x: torch.Tensor, quant: str, *,
                static_scale: torch.Tensor | None = None, row_scale: torch.Tensor | None = None,
                group: int = 128, one_launch_max: int | None = None, out_dtype: torch.dtype | None = None,
                pdl: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`align` and ``act_quant(x, "none", quant, ...)`` together: (sorted_token_ids,
    expert_ids, num_tokens_post_padded, codes, scale); x itself and None when ``quant`` is "none".
    ``out_dtype``: as act_quant's (int8 codes stored as 16-bit floats).
    With few pairs (decode) both run in one launch; otherwise they are the two launches they
    always were."""
    if one_launch_max is None:
        one_launch_max = ALIGN_ONE_LAUNCH_MAX
    ids = _flat_ids(topk_ids)
    numel = ids.numel()
    if quant == "none":
        return (*align(ids, num_experts, block_m, one_launch_max, pdl), x, None)
    if numel > one_launch_max:
        aligned = align(ids, num_experts, block_m, one_launch_max, pdl)
        return (*aligned, *act_quant(x, "none", quant, static_scale=static_scale, row_scale=row_scale,
                                     group=group, out_dtype=out_dtype, pdl=pdl))
    one = _one_launch_alignment(ids, num_experts, block_m)
    out, scale, args, meta = _act_quant_launch(x, "none", quant, static_scale, row_scale, group, out_dtype, None,
                                               1, None)
    _align_quant_kernel[(one.parts + x.shape[0],)](
        *one.args, *args, x.shape[0], one.parts, **one.meta, **meta, PDL=pdl, num_warps=8, **pdl_launch(pdl))
    return *one.outputs, out, scale


@torch.library.custom_op("moe_registry::moe_align_block_size", mutates_args=())
def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the M·k (token, k) pairs of ``topk_ids`` [M, k] by expert for block-wise GEMMs.

    Returns ``sorted_token_ids`` int32 [P] (flat pair indices token·k + j, each expert's run padded
    to a multiple of ``block_m`` with the sentinel M·k; pairs keep their order within an expert),
    ``expert_ids`` int32 [P / block_m] (the expert of each block, -1 past the end) and
    ``num_tokens_post_padded`` int32 [1], on the device. P = :func:`align_sizes`' worst case, so
    nothing is read back to the host; kernels skip blocks at or past num_tokens_post_padded.
    Ids outside [0, num_experts) are dropped (their pairs appear nowhere).
    """
    return align(topk_ids, num_experts, block_m)


@moe_align_block_size.register_fake
def _(topk_ids, num_experts, block_m):
    max_padded, num_blocks = align_sizes(topk_ids.numel(), num_experts, block_m)
    new = functools.partial(topk_ids.new_empty, dtype=torch.int32)
    return new(max_padded), new(num_blocks), new(1)


# ---------------------------------------------------------------------------------------------
# each row's sums over groups of columns (ZERO_SUMS GEMMs' inputs; see moe_gemm.FACTORED)

# groups a step of _row_group_sums reads
ROW_SUM_GROUPS = 8


@triton.jit
def _row_group_sums(row, x_ptr, sums_ptr, D, stride_x, groups, GROUP: tl.constexpr, GROUPS_BLOCK: tl.constexpr):
    """Row ``row`` of x [rows, D]: its float32 sums over consecutive groups of GROUP columns (the
    last one short where D is not a multiple), into sums_ptr[row, :groups]."""
    for g0 in range(0, groups, GROUPS_BLOCK):
        g = g0 + tl.arange(0, GROUPS_BLOCK)
        cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        v = tl.load(x_ptr + row * stride_x + cols, mask=(g[:, None] < groups) & (cols < D), other=0.0)
        tl.store(sums_ptr + row * groups + g, tl.sum(v.to(tl.float32), axis=1), mask=g < groups)


@triton.jit
def _row_group_sums_kernel(x_ptr, sums_ptr, D, stride_x, groups, GROUP: tl.constexpr, GROUPS_BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    grid_dependency(PDL)
    _row_group_sums(tl.program_id(0).to(tl.int64), x_ptr, sums_ptr, D, stride_x, groups, GROUP, GROUPS_BLOCK)


@triton.jit
def _align_row_sums_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_padded,
                           num_blocks, x_ptr, sums_ptr, D, stride_x, groups, parts, BLOCK_M: tl.constexpr,
                           PAIRS: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, EXPERT_TILE: tl.constexpr,
                           FILL: tl.constexpr, TILE_B: tl.constexpr, GROUP: tl.constexpr,
                           GROUPS_BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Decode prologue of a ZERO_SUMS GEMM1 in one launch: programs 0 .. parts - 1 align the pairs,
    program parts + r sums input row r's groups."""
    grid_dependency(PDL)
    pid = tl.program_id(0)
    if pid < parts:
        _align_part(pid, parts, ids_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, numel, num_experts, max_padded,
                    num_blocks, BLOCK_M, PAIRS, BINS, CHUNK, EXPERT_TILE, FILL, TILE_B)
    else:
        _row_group_sums((pid - parts).to(tl.int64), x_ptr, sums_ptr, D, stride_x, groups, GROUP, GROUPS_BLOCK)


def row_group_sums(x: torch.Tensor, group: int, pdl: bool = False) -> torch.Tensor:
    """Each row's float32 sums of ``x`` [rows, D] (last dimension contiguous) over consecutive
    groups of ``group`` columns, the last one short where D is not a multiple: [rows, ceil(D / group)]."""
    sums = row_sums_output(x, group)
    if x.shape[0]:
        _row_group_sums_kernel[(x.shape[0],)](x, sums, x.shape[1], x.stride(0), sums.shape[1], GROUP=group,
                                              GROUPS_BLOCK=ROW_SUM_GROUPS, PDL=pdl, **pdl_launch(pdl))
    return sums


def row_sums_output(x: torch.Tensor, group: int) -> torch.Tensor:
    """The (empty) float32 [rows, ceil(D / group)] that :func:`row_group_sums` of ``x`` fills."""
    return torch.empty(x.shape[0], triton.cdiv(x.shape[1], group), dtype=torch.float32, device=x.device)


def align_row_sums(topk_ids: torch.Tensor, num_experts: int, block_m: int, x: torch.Tensor, group: int, *,
                   one_launch_max: int | None = None, pdl: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align` and :func:`row_group_sums` of ``x`` together: (sorted_token_ids, expert_ids,
    num_tokens_post_padded, sums); with few pairs (decode) in one launch, as align_quant's."""
    if one_launch_max is None:
        one_launch_max = ALIGN_ONE_LAUNCH_MAX
    ids = _flat_ids(topk_ids)
    numel = ids.numel()
    if numel > one_launch_max:
        return (*align(ids, num_experts, block_m, one_launch_max, pdl), row_group_sums(x, group, pdl))
    one = _one_launch_alignment(ids, num_experts, block_m)
    sums = row_sums_output(x, group)
    _align_row_sums_kernel[(one.parts + x.shape[0],)](
        *one.args, x, sums, x.shape[1], x.stride(0), sums.shape[1], one.parts, **one.meta, GROUP=group,
        GROUPS_BLOCK=ROW_SUM_GROUPS, PDL=pdl, num_warps=ALIGN_WARPS, **pdl_launch(pdl))
    return *one.outputs, sums


# ---------------------------------------------------------------------------------------------
# activation + quantisation: tiles of rows (one row at decode)


@triton.jit
def _rint(x):
    """Round half to even for |x| < 2^22 (adding 1.5·2^23 leaves no fraction bits); larger values
    stay large, which the callers' clamps handle."""
    return (x + RINT_SHIFT) - RINT_SHIFT


@triton.jit
def _pow2(e):
    """2^e as float32 for integer e in [-127, 127] (2^-127 is the one subnormal)."""
    bits = tl.where(e > -127, (e + 127) << 23, 0x400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v):
    """float32 -> float8e4m3fn, saturating at ±448, round half to even (subnormals included),
    keeping the sign of zero. The code is built with integer arithmetic (e4m3 code = 8 per binade
    plus the rounded steps inside it), so it is exact on every backend: the interpreter's fp8 cast
    rounds differently, and a float cast on the GPU drops the sign of a rounded-away zero."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.minimum(tl.abs(v), FP8_MAX)
    biased = tl.maximum((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # below 2^-6: subnormal spacing
    steps = _rint(mag * ((257 - biased) << 23).to(tl.float32, bitcast=True))  # mag / 2^(biased-130): 0..16
    code = (biased - 121) * 8 + steps.to(tl.int32) + ((bits >> 31) & 1) * 128
    return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _to_int8(v):
    return tl.minimum(tl.maximum(_rint(v), -128.0), 127.0).to(tl.int8)


@triton.jit
def _mx_exponent(amax):
    """floor(log2(amax)) - 8 from the float32 exponent bits, clamped to [-127, 127]; zero and
    subnormal amax land on -127, as in quant_ref."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(tl.maximum(biased - 127 - 8, -127), 127)


@triton.jit
def _as_stored(codes, out_ptr):
    """int8 codes in the type ``out_ptr`` holds (INT8_CODE_DTYPES): themselves, or their values as
    16-bit floats (exact; through float32, which the interpreter's int8 -> bfloat16 cast skips)."""
    if out_ptr.dtype.element_ty != tl.int8:
        codes = codes.to(tl.float32).to(out_ptr.dtype.element_ty)
    return codes


@triton.jit
def _int8_codes(v, scale):
    """float32 values -> int8 codes at this scale, as quant_ref rounds them (correctly rounded
    division, then round half to even and saturate)."""
    return _to_int8(tl.math.div_rn(v, scale))


@triton.jit
def _fp8_codes(v, scale):
    """float32 values -> e4m3 codes at this scale, as quant_ref rounds them."""
    return _to_e4m3(tl.math.div_rn(v, scale))


@triton.jit
def _group_scale(amax, QUANT: tl.constexpr):
    """(scale, stored form) of fp8 groups from their amax: fp8_group float32 amax / 448 (floored),
    mxfp8 the e8m0 power of two (stored as its biased exponent byte)."""
    if QUANT == "fp8_group":
        scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
        stored = scale
    else:
        e = _mx_exponent(amax)
        scale = _pow2(e)
        stored = (e + 127).to(tl.uint8)
    return scale, stored


@triton.jit
def _rows_amax(ptr, rows, row_ok, stride, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Each row's max |value| over its first ``width`` columns (float32 [ROWS]; rows not ok: 0),
    COLS columns a step (one wide load each: a step is a round trip to L2)."""
    amax = tl.zeros([ROWS, COLS], dtype=tl.float32)
    for c in range(0, width, COLS):
        cols = c + tl.arange(0, COLS)
        v = tl.load(ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :],
                    mask=row_ok[:, None] & (cols < width)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    return tl.max(amax, axis=1)


@triton.jit
def _holds_data(pair_ids_ptr, rows, num_experts, mask):
    """Whether each row holds data: its pair routes to one of this rank's ``num_experts`` (expert
    parallelism marks a pair routed elsewhere -1; its rows were never written). Read from the ids
    themselves, so no mask tensor (elementwise launches ahead of the kernel) is built first."""
    ids = tl.load(pair_ids_ptr + rows, mask=mask, other=-1)
    return (ids >= 0) & (ids < num_experts)


@triton.jit
def _span_amax(ptr, stride, width, row_lo, row_hi, ids_ptr, num_experts, SKIP_FOREIGN: tl.constexpr,
               ROWS: tl.constexpr, COLS: tl.constexpr):
    """max |value| (float32) over rows [row_lo, row_hi) and their first ``width`` columns, a
    [ROWS, COLS] tile a step; SKIP_FOREIGN: only rows whose pair ``ids_ptr`` routes to one of
    this rank's ``num_experts`` (rows of pairs routed elsewhere were never written)."""
    amax = tl.zeros([ROWS], dtype=tl.float32)
    for r in range(row_lo, row_hi, ROWS):
        rows = r + tl.arange(0, ROWS)
        ok = rows < row_hi
        if SKIP_FOREIGN:
            ok = ok & _holds_data(ids_ptr, rows, num_experts, ok)
        amax = tl.maximum(amax, _rows_amax(ptr, rows, ok, stride, width, ROWS, COLS))
    return tl.max(amax, axis=0)


@triton.jit
def _int8_token_scale(amax):
    """A row's int8 scale from its amax (floored so an all-zero row divides by a positive)."""
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), INT8_MAX)


@triton.jit
def gated_act(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in float32 (silu, gelu with erf, or gpt-oss's clamped swigluoai); shared by
    this module's row kernel and the GEMM1 epilogue of the fused MoE kernel."""
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    if ACTIVATION == "silu":
        out = gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == "gelu":
        out = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up
    else:  # swigluoai (gpt-oss)
        gate = tl.minimum(gate, SWIGLUOAI_LIMIT)
        up = tl.minimum(tl.maximum(up, -SWIGLUOAI_LIMIT), SWIGLUOAI_LIMIT)
        out = (up + 1.0) * gate / (1.0 + tl.exp(gate * -SWIGLUOAI_ALPHA))
    return out


@triton.jit
def _act_quant_kernel(x_ptr, out_ptr, scale_ptr, static_scale_ptr, row_scale_ptr, counts_ptr, pieces_ptr,
                      D, stride_x, stride_out, stride_scale, capacity, num_pieces, num_rows,
                      ACTIVATION: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                      HAS_ROW_SCALE: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr,
                      ONE_READ: tl.constexpr, PIECES: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
                      pair_experts_ptr=None, num_experts=0, NIBBLE_HALVES: tl.constexpr = False,
                      PAIR_ROWS: tl.constexpr = False):
    """Program (r, c): rows [r * ROWS, (r + 1) * ROWS), columns [c * BLOCK, (c + 1) * BLOCK) (the
    whole row for int8_token, whose scale needs it, unless its amax comes in pieces)."""
    grid_dependency(PDL)
    col_lo = tl.program_id(1) * BLOCK
    col_hi = D if QUANT == "int8_token" and PIECES == 0 else tl.minimum(D, col_lo + BLOCK)
    _act_quant_tile(tl.program_id(0).to(tl.int64) * ROWS, x_ptr, out_ptr, scale_ptr, static_scale_ptr,
                    row_scale_ptr, counts_ptr, pieces_ptr, D, stride_x, stride_out, stride_scale, capacity,
                    num_pieces, num_rows, col_lo, col_hi, ACTIVATION, QUANT, GROUP, HAS_ROW_SCALE, HAS_COUNTS, BLOCK,
                    ONE_READ, PIECES, ROWS, pair_experts_ptr, num_experts, NIBBLE_HALVES, PAIR_ROWS)


@triton.jit
def _store_int8_codes(out_ptr, rows, row_ok, stride_out, col_lo, codes, D, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      NIBBLE_HALVES: tl.constexpr):
    """Store a [ROWS, BLOCK] tile of int8 codes (columns from ``col_lo``, even) in place, or
    (NIBBLE_HALVES) its even columns in the row's first half and its odd ones in the second: split
    in registers, two contiguous stores (each code scattered to its place took a byte store apiece)."""
    codes = _as_stored(codes, out_ptr)
    row_base = out_ptr + rows[:, None] * stride_out
    if NIBBLE_HALVES:
        even, odd = tl.split(tl.reshape(codes, (ROWS, BLOCK // 2, 2)))
        half = col_lo // 2 + tl.arange(0, BLOCK // 2)
        mask = row_ok[:, None] & (half[None, :] < D // 2)
        tl.store(row_base + half[None, :], even, mask=mask)
        tl.store(row_base + D // 2 + half[None, :], odd, mask=mask)
    else:
        cols = col_lo + tl.arange(0, BLOCK)
        tl.store(row_base + cols[None, :], codes, mask=row_ok[:, None] & (cols[None, :] < D))


@triton.jit
def _tile_values(x_ptr, rows, row_ok, cols, D, stride_x, row_factor, ACTIVATION: tl.constexpr):
    """float32 values of a [rows, cols] tile (masked off: 0): act(gate) * up or x, times each
    row's factor."""
    mask = row_ok[:, None] & (cols[None, :] < D)
    x_tile = x_ptr + rows[:, None] * stride_x + cols[None, :]
    if ACTIVATION == "none":
        v = tl.load(x_tile, mask=mask, other=0.0).to(tl.float32)
    else:
        v = gated_act(tl.load(x_tile, mask=mask, other=0.0), tl.load(x_tile + D, mask=mask, other=0.0), ACTIVATION)
    return v * row_factor[:, None]


@triton.jit
def _act_quant_tile(row_lo, x_ptr, out_ptr, scale_ptr, static_scale_ptr, row_scale_ptr, counts_ptr, pieces_ptr,
                    D, stride_x, stride_out, stride_scale, capacity, num_pieces, num_rows, col_lo, col_hi,
                    ACTIVATION: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                    HAS_ROW_SCALE: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr,
                    ONE_READ: tl.constexpr, PIECES: tl.constexpr, ROWS: tl.constexpr, pair_experts_ptr=None,
                    num_experts=0, NIBBLE_HALVES: tl.constexpr = False, PAIR_ROWS: tl.constexpr = False):
    """Rows [row_lo, row_lo + ROWS) (those below num_rows; with counts, the batched format, rows
    past their expert's count are skipped; PAIR_ROWS, rows that are (token, expert) pairs, the rows
    of pairs whose expert in pair_experts_ptr lies outside [0, num_experts) are skipped: another
    rank's, never written), columns [col_lo, col_hi), BLOCK at a time: optional gated activation
    ([2D] -> [D]), optional row factor (router weight on the input), then store as the activation
    dtype or quantise (see QUANT_MODES). NIBBLE_HALVES (int8 codes): each row's even columns are
    stored first, then its odd ones, as the low and high nibbles of int4 weight words take them
    (decode_gemv).

    int8_token needs each row's amax first: with PIECES > 0 the largest of its num_pieces pieces
    (read PIECES at a time; any column range can then be quantised alone, and the chunk at
    column 0 stores the scale); otherwise the kernel passes the whole row, read once when
    ONE_READ (BLOCK >= D: its values stay in registers between the amax and the codes), else an
    amax pass, then the codes. Decode runs one row per program (ROWS 1); prefill a few rows of
    chunks that tile them (see _act_quant_launch), so no lanes sit masked off."""
    rows = row_lo + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    if HAS_COUNTS:
        row_ok &= rows % capacity < tl.load(counts_ptr + rows // capacity, mask=row_ok, other=0)
    if PAIR_ROWS:
        expert = tl.load(pair_experts_ptr + rows, mask=row_ok, other=-1)
        row_ok &= (expert >= 0) & (expert < num_experts)
    row_factor = tl.full([ROWS], 1.0, tl.float32)
    if HAS_ROW_SCALE:
        row_factor = tl.load(row_scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if QUANT == "int8_token":  # each row's amax: from its pieces, one read, or a first pass
        if PIECES > 0:
            parts = tl.arange(0, PIECES)
            amax = tl.zeros([ROWS, PIECES], dtype=tl.float32)
            for first in range(0, num_pieces, PIECES):
                amax = tl.maximum(amax, tl.load(pieces_ptr + rows[:, None] * num_pieces + first + parts[None, :],
                                                mask=row_ok[:, None] & (first + parts[None, :] < num_pieces),
                                                other=0.0))
        elif ONE_READ:
            v = _tile_values(x_ptr, rows, row_ok, tl.arange(0, BLOCK), D, stride_x, row_factor, ACTIVATION)
            amax = tl.abs(v)
        else:
            amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for d in range(0, D, BLOCK):
                v = _tile_values(x_ptr, rows, row_ok, d + tl.arange(0, BLOCK), D, stride_x, row_factor, ACTIVATION)
                amax = tl.maximum(amax, tl.abs(v))
        row_scale = _int8_token_scale(tl.max(amax, axis=1))
        if col_lo == 0:  # with pieces, the row's first chunk stores it
            tl.store(scale_ptr + rows * stride_scale, row_scale, mask=row_ok)
        scale = row_scale[:, None]
        if ONE_READ and PIECES == 0:  # the values are still in registers: the codes now
            _store_int8_codes(out_ptr, rows, row_ok, stride_out, 0, _int8_codes(v, scale), D, ROWS, BLOCK,
                              NIBBLE_HALVES)
            col_hi = 0  # done: the loop below runs no step
    elif QUANT == "int8_static" or QUANT == "fp8_static":
        scale = tl.load(static_scale_ptr).to(tl.float32)

    for d in range(col_lo, col_hi, BLOCK):
        cols = d + tl.arange(0, BLOCK)
        v = _tile_values(x_ptr, rows, row_ok, cols, D, stride_x, row_factor, ACTIVATION)
        out_tile = out_ptr + rows[:, None] * stride_out + cols[None, :]
        mask = row_ok[:, None] & (cols[None, :] < D)
        if QUANT == "none":
            tl.store(out_tile, v.to(out_ptr.dtype.element_ty), mask=mask)
        elif QUANT == "int8_token" or QUANT == "int8_static":
            _store_int8_codes(out_ptr, rows, row_ok, stride_out, d, _int8_codes(v, scale), D, ROWS, BLOCK,
                              NIBBLE_HALVES)
        elif QUANT == "fp8_static":
            tl.store(out_tile, _fp8_codes(v, scale), mask=mask)
        else:  # a scale per GROUP columns: fp8_group (float32 amax / 448) or mxfp8 (e8m0)
            v = tl.reshape(v, (ROWS, BLOCK // GROUP, GROUP))
            group_scale, stored = _group_scale(tl.max(tl.abs(v), axis=2), QUANT)
            tl.store(out_tile, tl.reshape(_fp8_codes(v, group_scale[:, :, None]), (ROWS, BLOCK)), mask=mask)
            groups = d // GROUP + tl.arange(0, BLOCK // GROUP)
            tl.store(scale_ptr + rows[:, None] * stride_scale + groups[None, :], stored,
                     mask=row_ok[:, None] & (groups[None, :] < tl.cdiv(D, GROUP)))


def act_quant(x: torch.Tensor, activation: str, quant: str, *, static_scale: torch.Tensor | None = None,
              row_scale: torch.Tensor | None = None, group: int = 128,
              out_dtype: torch.dtype | None = None, expert_num_tokens: torch.Tensor | None = None,
              capacity: int = 1, amax_pieces: torch.Tensor | None = None,
              pdl: bool = False, nibble_halves: bool = False, pair_experts: torch.Tensor | None = None,
              num_experts: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of x [T, D_in] -> (values [T, D], scale or None): ``activation`` "none" or one of
    core.vocab.ACTIVATION_FNS (then D = D_in / 2), ``quant`` one of QUANT_MODES. Scales: int8_token float32
    [T, 1]; static modes return ``static_scale``; fp8_group float32 [T, ceil(D/group)]; mxfp8 uint8
    [T, ceil(D/32)]. ``out_dtype``: quant "none": the values' dtype (default x's); int8 modes: the
    codes' (INT8_CODE_DTYPES; a 16-bit float holds each code's value exactly). ``row_scale`` [T]
    multiplies each row before quantising. With
    ``expert_num_tokens`` [E] (batched rows, T = E·capacity) rows past a count are left unwritten.
    ``amax_pieces`` [T, P] (int8_token, no activation or row factor): each row's amax is the
    largest of its P pieces (a GEMM epilogue left them), so rows are cut into chunks like the
    group modes. ``pdl``: launch as part of a programmatic-dependent-launch chain.
    ``nibble_halves`` (int8 modes, even D): each row's codes of even columns first, then of odd
    ones (the decode GEMV's int4 words). ``pair_experts`` [T]: the rows are (token, expert) pairs,
    these their experts; a pair's row whose expert lies outside [0, ``num_experts``) (another
    rank's: GEMM1 never wrote it) is neither read nor written, nor is its scale. Plain
    implementation behind the custom ops (no dispatcher hop inside the fused layer)."""
    if nibble_halves and not (quant.startswith("int8") and x.shape[1] % 2 == 0 and activation == "none"):
        raise ValueError(f"codes in nibble halves are int8 codes of rows of even width, no activation; got {quant} "
                         f"rows of {x.shape[1]}, activation {activation}")
    if pair_experts is not None and pair_experts.shape != (x.shape[0],):
        raise ValueError(f"pair_experts holds one expert per row: [{x.shape[0]}], got {list(pair_experts.shape)}")
    out, scale, args, meta = _act_quant_launch(x, activation, quant, static_scale, row_scale, group, out_dtype,
                                               expert_num_tokens, capacity, amax_pieces)
    if nibble_halves:
        meta["NIBBLE_HALVES"] = True
    if pair_experts is not None:
        meta |= {"PAIR_ROWS": True, "pair_experts_ptr": pair_experts, "num_experts": num_experts}
    if x.shape[0]:
        whole_rows = quant == "int8_token" and amax_pieces is None
        chunks = 1 if whole_rows else triton.cdiv(out.shape[1], meta["BLOCK"])
        rows, warps = _act_quant_tile_shape(x.shape[0], out.shape[1], meta)
        _act_quant_kernel[(triton.cdiv(x.shape[0], rows), chunks)](
            *args, x.shape[0], **meta, ROWS=rows, PDL=pdl, num_warps=warps, **pdl_launch(pdl))
    return out, scale


def _act_quant_tile_shape(num_rows: int, width: int, meta: dict) -> tuple[int, int]:
    """(rows per program, warps) of one act_quant launch of rows ``width`` values wide. Decode: a
    row per program, 16 warps from 2048-column blocks up (on an H100 they beat 8 by 0.1-0.7 us).
    Prefill (ROW_TILE_MIN_ROWS rows or more): blocks of several rows,
    ROW_TILE_ELEMS values and ROW_TILE_PER_THREAD per thread (measured on an H100 against 2k and
    8k values, 8 per thread), except int8_token rows wider than that, read twice: one a program
    (14336 columns: 145 us against 195 for two)."""
    block = meta["BLOCK"]
    one_row = 1, 4 if block <= 512 else 8 if block <= 1024 else 16
    if num_rows < ROW_TILE_MIN_ROWS:
        return one_row
    if meta["QUANT"] == "int8_token" and not meta["ONE_READ"] and not meta["PIECES"] and width > ROW_TILE_ELEMS:
        return one_row
    rows = max(1, min(ROW_TILE_MAX_ROWS, ROW_TILE_ELEMS // block))
    if rows == 1:
        return one_row
    return rows, max(1, min(8, rows * block // (32 * ROW_TILE_PER_THREAD)))


def prefill_row_chunks(width: int) -> int:
    """The chunks act_quant cuts a row ``width`` values wide into at prefill (1: one block).
    A width that is no power of two is tiled by chunks of its largest power-of-two factor, so
    no lanes sit masked off (on an H100, 1408 columns went 2x faster); int8_token rows without
    amax pieces are then read twice (an amax pass, then the codes)."""
    low = width & -width
    if low == width or low < ROW_TILE_MIN_CHUNK:
        return 1
    return width // min(low, ROW_CHUNK)


def _act_quant_launch(x, activation, quant, static_scale, row_scale, group, out_dtype, expert_num_tokens,
                      capacity, amax_pieces):
    """Outputs, kernel arguments and constexprs of one act_quant launch (shared with the launch
    that fuses it with alignment)."""
    if amax_pieces is not None and (quant != "int8_token" or activation != "none" or row_scale is not None
                                    or amax_pieces.shape[0] != x.shape[0] or not amax_pieces.is_contiguous()):
        raise ValueError("amax pieces are a contiguous [rows, P] amax of the rows as given (int8_token, no "
                         "activation or row factor)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, d_in = x.shape
    d = d_in if activation == "none" else d_in // 2
    dev = x.device
    if quant == "mxfp8":
        group = MX_GROUP
    scale: torch.Tensor | None = None
    if quant == "none":
        out = torch.empty(t, d, dtype=out_dtype or x.dtype, device=dev)
    elif quant.startswith("int8"):
        if out_dtype not in INT8_CODE_DTYPES:
            raise ValueError(f"int8 codes are stored as one of {INT8_CODE_DTYPES}, got {out_dtype}")
        out = torch.empty(t, d, dtype=out_dtype or torch.int8, device=dev)
        scale = torch.empty(t, 1, dtype=torch.float32, device=dev) if quant == "int8_token" else static_scale
    else:
        out = torch.empty(t, d, dtype=torch.float8_e4m3fn, device=dev)
        if quant == "fp8_static":
            scale = static_scale
        else:
            sdt = torch.uint8 if quant == "mxfp8" else torch.float32
            scale = torch.empty(t, triton.cdiv(d, group), dtype=sdt, device=dev)
    widest = ROW_BLOCK_MAX if quant == "int8_token" and amax_pieces is None else ROW_CHUNK
    block = max(min(triton.next_power_of_2(d), widest), group if quant in ("fp8_group", "mxfp8") else 16)
    if t >= ROW_TILE_MIN_ROWS and prefill_row_chunks(d) > 1:
        block = max(d // prefill_row_chunks(d), group if quant in ("fp8_group", "mxfp8") else 16)
    dummy = out
    scale_arg = scale if scale is not None else dummy
    args = (x, out, scale_arg, static_scale if static_scale is not None else dummy,
            row_scale if row_scale is not None else dummy,
            expert_num_tokens if expert_num_tokens is not None else dummy,
            amax_pieces if amax_pieces is not None else dummy,
            d, x.stride(0), out.stride(0), scale_arg.stride(0) if scale_arg.dim() == 2 else 0, capacity,
            amax_pieces.shape[1] if amax_pieces is not None else 0)
    pieces = min(triton.next_power_of_2(amax_pieces.shape[1]), PIECES_STEP) if amax_pieces is not None else 0
    meta = {"ACTIVATION": activation, "QUANT": quant, "GROUP": group, "HAS_ROW_SCALE": row_scale is not None,
            "HAS_COUNTS": expert_num_tokens is not None, "BLOCK": block, "ONE_READ": block >= d, "PIECES": pieces}
    return out, scale, args, meta


@torch.library.custom_op("moe_registry::act_and_mul", mutates_args=())
def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2I] -> [T, I] in x's dtype: act(gate) * up, gate = first half, up = second half;
    activation is silu, gelu (erf) or swigluoai. Computed in float32."""
    return act_quant(x, activation, "none")[0]


@act_and_mul.register_fake
def _(x, activation):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.custom_op("moe_registry::act_and_mul_quant", mutates_args=())
def act_and_mul_quant(x: torch.Tensor, activation: str, quant: str,
                      static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """act_and_mul fused with activation quantisation (``quant`` in QUANT_MODES except "none"),
    quantising the float32 activation directly (no rounding to 16 bits in between)."""
    q, s = act_quant(x, activation, quant, static_scale=static_scale)
    return q, s.clone() if s is static_scale else s


@act_and_mul_quant.register_fake
def _(x, activation, quant, static_scale=None):
    return _fake_quant(x.shape[0], x.shape[1] // 2, quant, x, static_scale)


def _fake_quant(t, d, quant, like, static_scale):
    qdt = torch.int8 if quant.startswith("int8") else torch.float8_e4m3fn
    if quant == "int8_token":
        s = like.new_empty(t, 1, dtype=torch.float32)
    elif quant in ("int8_static", "fp8_static"):
        s = static_scale.new_empty(static_scale.shape)
    elif quant == "mxfp8":
        s = like.new_empty(t, triton.cdiv(d, MX_GROUP), dtype=torch.uint8)
    else:
        s = like.new_empty(t, triton.cdiv(d, 128), dtype=torch.float32)
    return like.new_empty(t, d, dtype=qdt), s


@torch.library.custom_op("moe_registry::quant_int8_per_token", mutates_args=())
def quant_int8_per_token(x: torch.Tensor,
                         static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> int8 codes and float32 scales [T, 1] (amax / 127 per row), or with a static
    per-tensor ``static_scale`` [1], codes against it (returned scale: a copy of it)."""
    q, s = act_quant(x, "none", "int8_token" if static_scale is None else "int8_static",
                     static_scale=static_scale)
    return q, s.clone() if s is static_scale else s


@quant_int8_per_token.register_fake
def _(x, static_scale=None):
    return _fake_quant(x.shape[0], x.shape[1], "int8_token" if static_scale is None else "int8_static",
                       x, static_scale)


@torch.library.custom_op("moe_registry::quant_fp8_per_group", mutates_args=())
def quant_fp8_per_group(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> float8_e4m3fn codes and float32 scales [T, ceil(K/group)] (amax / 448 per group;
    group_size a power of two)."""
    return act_quant(x, "none", "fp8_group", group=group_size)


@quant_fp8_per_group.register_fake
def _(x, group_size=128):
    t, k = x.shape
    return x.new_empty(t, k, dtype=torch.float8_e4m3fn), x.new_empty(t, triton.cdiv(k, group_size),
                                                                       dtype=torch.float32)


@torch.library.custom_op("moe_registry::quant_mxfp8", mutates_args=())
def quant_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> MXFP8: float8_e4m3fn codes and raw e8m0 exponents uint8 [T, ceil(K/32)]."""
    return act_quant(x, "none", "mxfp8")


@quant_mxfp8.register_fake
def _(x):
    return _fake_quant(x.shape[0], x.shape[1], "mxfp8", x, None)


# ---------------------------------------------------------------------------------------------
# top-k reduction


@triton.jit
def _moe_sum_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, H, num_experts, stride_xs, stride_xm, stride_xk, stride_om,
                    SPLITS: tl.constexpr, TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                    HAS_IDS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """out[row] = sum over splits s and top-k j of x[s, row, j] (× w[row, j]), in float32. With
    ids, pairs whose expert is outside [0, E) (foreign: never computed, x unwritten) add nothing."""
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        width = H
        if HAS_IDS:  # a foreign pair reads no columns
            expert = tl.load(ids_ptr + row * TOP_K + j)
            width = tl.where((expert >= 0) & (expert < num_experts), H, 0)
        mask = cols < width
        v = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            v += tl.load(x_ptr + s * stride_xs + row * stride_xm + j * stride_xk + cols, mask=mask,
                         other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v *= tl.load(w_ptr + row * TOP_K + j).to(tl.float32)
        acc += v
    tl.store(out_ptr + row * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


def sum_topk(x: torch.Tensor, topk_weights: torch.Tensor | None = None,
             out: torch.Tensor | None = None, pdl: bool = False,
             topk_ids: torch.Tensor | None = None, num_experts: int = 0) -> torch.Tensor:
    """Plain implementation of :func:`moe_sum` (optionally into ``out``). ``x`` may also be
    [S, M, k, H]: S split-K partial sums of the same pairs, added here in the same pass. ``pdl``:
    launch as part of a programmatic-dependent-launch chain. ``topk_ids`` [M, k]: pairs routed
    outside [0, num_experts) are skipped (their rows of x were never written)."""
    x4 = x if x.dim() == 4 else x.unsqueeze(0)
    splits, m, top_k, h = x4.shape
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    if out is None:
        out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if topk_weights is not None:
        topk_weights = topk_weights.contiguous()
    if topk_ids is not None:
        topk_ids = topk_ids.contiguous()
    block_h = min(triton.next_power_of_2(h), 1024)
    _moe_sum_kernel[(m, triton.cdiv(h, block_h))](
        x4, topk_weights if topk_weights is not None else x4, topk_ids if topk_ids is not None else x4, out,
        h, num_experts, x4.stride(0), x4.stride(1), x4.stride(2), out.stride(0), SPLITS=splits, TOP_K=top_k,
        HAS_WEIGHTS=topk_weights is not None, HAS_IDS=topk_ids is not None, BLOCK_H=block_h, PDL=pdl,
        num_warps=4, **pdl_launch(pdl))
    return out


@torch.library.custom_op("moe_registry::moe_sum", mutates_args=())
def moe_sum(x: torch.Tensor, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """[M, k, H] -> [M, H] in x's dtype: sum over k, weighted by ``topk_weights`` [M, k] when the
    router weights were not applied already. Accumulates in float32."""
    return sum_topk(x, topk_weights)


@moe_sum.register_fake
def _(x, topk_weights=None):
    return x.new_empty(x.shape[0], x.shape[2])
