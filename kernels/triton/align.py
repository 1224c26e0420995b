"""Alignment: the (token, k) pairs grouped by expert, each expert padded to a multiple of BLOCK_M
(:func:`align`, the custom op :func:`moe_align_block_size`); and at decode the same launch doing the
input's row work too: its quantisation (:func:`align_quant`) or its per-group row sums
(:func:`align_row_sums`, the input of a ZERO_SUMS GEMM).
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .activation_quant import _act_quant_launch, _act_quant_tile, act_quant
from .chain import grid_dependency, pdl_launch

# Up to this many (token, k) pairs, alignment is one launch of one program per ALIGN_PART_PAIRS
# pairs, each recounting all of them (decode); above it, three launches that count chunks once
# (prefill). ALIGN_WARPS: warps of the one-launch alignment.
ALIGN_ONE_LAUNCH_MAX = 1024
ALIGN_PART_PAIRS = 32
ALIGN_WARPS = 4
# sentinel slots stored per step by the alignment kernels
SENTINEL_FILL = 256


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
# each row's sums over groups of columns (ZERO_SUMS GEMMs' inputs; see gemm.FACTORED)

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
