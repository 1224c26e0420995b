"""The Triton kernels' weight layout, in one room: :class:`TritonWeightLayout` takes a projection in the
``nk`` layout of :mod:`moe_registry.formats.weights` to the tensors the GEMMs read and back, and
``_Proj`` is one projection as the launchers see it. Every kernel-private form of a weight (FP4
register order, e4m3 scale codes, padded group scales, scale-and-zero words) is made here.
"""

import dataclasses
from dataclasses import dataclass

import torch

from moe_registry.formats.weights import BULK_FIELDS, ExpertWeights, ProjectionWeights

from .fp4_dequant import e2m1_nibble_order, e2m1_register_order, e4m3_scale_codes, e4m3_scale_values
from .variant import KernelVariant, packed


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
    scale2: torch.Tensor | None = None  # second-level weight scale per (expert, row), float32 [E, N] (NVFP4)
    # MX scales: their lowest and highest e8m0 code where known, which decide _e2m1_fold
    scale_codes: tuple[int, int] | None = None



# one-byte group scales (MX e8m0, NVFP4 e4m3), and group scales with zero points, are kept with their
# group count padded to a multiple of this
SCALE_GROUPS_PAD = 16


def _padded_groups(t: torch.Tensor | None) -> torch.Tensor | None:
    """Per-group scales [E, N, G] with G padded (zeros) to a multiple of SCALE_GROUPS_PAD: a K tile's
    groups then load as one masked vector per weight row, whose mask the compiler sees constant
    over the vector (Triton marks integer arguments divisible by 16), and the pipeliner streams
    such loads ahead like the codes. H100: MXFP4's four single-byte scale loads per step were
    waited on inside the step (sm_90 SASS, tools/kernel_sass.py); streamed, decode is 1.02-1.10x
    faster, NVFP4's 1.09-1.41x. 16-bit scales are left as they are (a tile's one or two groups per
    row are too few bytes for a streamed copy, and padding them would hold up to 5% more bytes)
    but with zero points: a ZERO_SUMS tile's epilogue reads 16 groups of a row's scales and zero
    points at once (gemm_common._less_zero_point_terms), as vectors where padded, else as 32
    scalar loads a thread (sm_90 SASS, AWQ's GEMM2 at Qwen3's shape, 6 groups: 36 loads a
    thread in the epilogue's loop, whose instructions then outnumbered the main loop's; H100,
    AWQ at Qwen3's M = 64 on GPTQ int4's tiles, 181.1 -> 164.7 us a layer). The cost: that GEMM's
    6 groups a row are held as 16 (AWQ: 64 bytes of scale-and-zero words a row beside 384 of codes,
    where the checkpoint has 15 of scales and zero points; Qwen3's whole AWQ layer is held in 5.6%
    more bytes than its checkpoint's); the kernels read only the groups K holds."""
    if t is None or t.shape[2] % SCALE_GROUPS_PAD == 0:
        return t
    pad = SCALE_GROUPS_PAD - t.shape[2] % SCALE_GROUPS_PAD
    return torch.cat([t, t.new_zeros(t.shape[0], t.shape[1], pad)], dim=2)


def _scale_zero_words(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 group scales and their integer zero points [E, N, G] as one int32 word each, given
    as both tensors (gemm_common._scale_of, _zero_of): the scale's bits low, the zero point (signed)
    high. A tile's scale and zero of a column are then one 4-byte load, which the pipeliner streams
    ahead of the step like the codes (cp.async), where a 2-byte scale and a 1-byte zero point were
    two loads the step waited on (sm_90 SASS, tools/kernel_sass.py: AWQ's GEMM2 at Qwen3's M = 8,
    4 such loads a step -> none). TritonExperts packs 4-bit codes' only. H100, tools/bench.py, on
    tables tuned for two tensors: AWQ's Mixtral M = 1 108.9 -> 103.7 us, M = 8
    312.1 -> 301.6, Qwen3 M = 64 164.3 -> 159.1, but DeepSeek-V2-Lite M = 8 88.6 -> 91.3 (its
    M = 64 re-tuned since); W8A16 asym's M = 64 241.8 -> 260.1 (Qwen3), 231.9 -> 251.4
    (DeepSeek-V2-Lite). Other scales and zero points are left as they are."""
    if scale.dtype != torch.float16 or zero.is_floating_point():
        return scale, zero
    words = (scale.view(torch.int16).to(torch.int32) & 0xFFFF) | (zero.to(torch.int32) << 16)
    return words, words


def _scale_zero_halves(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale-and-zero words (:func:`_scale_zero_words`) back to float16 scales and uint8 zero points."""
    scale = (words & 0xFFFF).to(torch.int16).view(torch.float16)
    return scale, (words >> 16).to(torch.uint8)


# the non-swapped tiles of at least this many rows read scale-and-zero words as their two 16-bit
# halves (_word_halves_for)
WORD_HALVES_MIN_ROWS = 128


def _word_halves_for(w: _Proj, config: dict) -> _Proj:
    """The projection as a tile reads it: scale-and-zero words (_scale_zero_words) as they are, or,
    for non-swapped tiles of WORD_HALVES_MIN_ROWS rows or more, as their two 16-bit halves, the
    scales and the zero points (int16 views of the same storage, strides doubled). A 4-byte word is
    one load the pipeliner streams through shared memory (faster at decode, and for the swapped
    prefill tiles); a 2-byte one is a load into registers, which the large non-swapped tiles take
    better. H100, AWQ at M = 4096 (tools/bench.py --m 4096 --schemes awq-w4a16): words 1183.4 ->
    halves 1131.8 us on Qwen3-30B-A3B's shape, 1466.3 -> 1402.4 on DeepSeek-V2-Lite's; Mixtral's
    swapped tiles, words against two tensors, 6288.2 against 7285.1."""
    if config["SWAP_AB"] or config["BLOCK_M"] < WORD_HALVES_MIN_ROWS:  # (every decode launch stops here)
        return w
    words = w.scale is not None and w.scale.dtype == torch.int32 and w.zero is not None and (
        w.zero.dtype == torch.int32 and w.zero.data_ptr() == w.scale.data_ptr())
    if not words:
        return w
    halves = w.scale.view(torch.int16)
    strides = tuple(2 * stride for stride in w.scale.stride())
    scales = halves.as_strided(w.scale.shape, strides, halves.storage_offset())
    zeros = halves.as_strided(w.scale.shape, strides, halves.storage_offset() + 1)
    return dataclasses.replace(w, scale=scales, zero=zeros)


def fp8_as_bytes(variant: KernelVariant) -> bool:
    """Whether fp8 weight codes reach the GEMMs as their bytes (uint8, the same storage): weights the 16-bit
    dot dequantises in registers (dequant_ptx._e4m3_value), which then compile below sm_89, where Triton
    refuses any fp8 type; fp8 dots (sm_89+) read them as fp8."""
    return variant.weight_type == "fp8e4m3" and variant.dot == "float"


@dataclass(frozen=True)
class TritonWeightLayout:
    """The Triton kernels' last conversion step: a projection in the ``nk`` layout
    (:mod:`moe_registry.formats.weights`) to the tensors the GEMMs read (:meth:`pack`), and back
    (:meth:`unpack`). Everything private to these kernels happens here and nowhere else: FP4 codes
    in their decoders' byte order (:func:`e2m1_register_order`), NVFP4's e4m3 scales as exponent codes
    (:func:`e4m3_scale_codes`), one-byte group scales and zero-point weights' group scales padded
    (:func:`_padded_groups`), 4-bit codes' group scales and zero points as one word each
    (:func:`_scale_zero_words`; a tile reads them as :func:`_word_halves_for` says)."""

    variant: KernelVariant

    def pack(self, p: ProjectionWeights) -> list[torch.Tensor | None]:
        """The projection's tensors in the layer op's order (weight, scale, zero, perm, bias,
        input_scale), contiguous, router-side dtypes fixed once (zero points share the scales'
        strides, and are padded with them)."""
        variant = self.variant

        def ready(t: torch.Tensor | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t if dtype is None else t.to(dtype)
            return t.contiguous()

        scale, zero, codes = ready(p.scale), ready(p.zero), p.weight
        if scale is not None and scale.dtype == torch.float8_e4m3fn:  # NVFP4's scales as the kernels read them
            codes, scale = e4m3_scale_codes(codes, scale)
        if variant.weight_scale in ("group", "mx") and scale is not None and (scale.element_size() == 1
                                                                               or zero is not None):
            scale, zero = _padded_groups(scale), _padded_groups(zero)
        if variant.weight_scale == "group" and zero is not None and packed(variant.weight_type):
            scale, zero = _scale_zero_words(scale, zero)
        weight = e2m1_register_order(codes) if variant.weight_type == "e2m1" else ready(codes)
        if fp8_as_bytes(variant):
            weight = weight.view(torch.uint8)
        return [weight, scale, zero, ready(p.perm, torch.int32), ready(p.bias, torch.float32),
                ready(p.input_scale, torch.float32)]

    def keep(self, p: ProjectionWeights, held: list[torch.Tensor | None]) -> ProjectionWeights:
        """What the experts keep of a projection beside its packed tensors ``held``: each converted
        code, scale and zero-point tensor where the kernel reads that very tensor, else a stand-in
        (ProjectionWeights.with_stand_ins), so none is pinned twice."""
        copied = p.not_held_in(dict(zip(BULK_FIELDS, held[:len(BULK_FIELDS)], strict=True)))
        return p.with_stand_ins(*copied) if copied else p

    def unpack(self, held: list[torch.Tensor | None], scale2: torch.Tensor | None = None) -> ProjectionWeights:
        """The ``nk``-layout projection that :meth:`pack` made ``held`` from: the same tensors where the
        kernel reads them as converted, else new ones with the same values (NVFP4 codes of a group whose
        scale was zero or negative come back zeroed or sign-flipped, with the scale's magnitude: the
        same dequantised weights). ``scale2``: the projection's second-level scale, as it was."""
        weight, scale, zero, perm, bias, input_scale = held
        variant = self.variant
        if variant.weight_type == "e2m1":
            weight = e2m1_nibble_order(weight)
        if fp8_as_bytes(variant):
            weight = weight.view(torch.float8_e4m3fn)
        words = scale is not None and zero is not None and scale.dtype == torch.int32
        if words and zero.data_ptr() == scale.data_ptr():
            scale, zero = _scale_zero_halves(scale)
        if variant.weight_scale in ("group", "mx") and scale is not None:
            in_features = weight.shape[-1] * (2 if variant.packed else 1)
            groups = -(-in_features // variant.weight_group)
            scale = scale[..., :groups]
            zero = zero[..., :groups] if zero is not None else None
        if variant.weight_type == "e2m1" and variant.weight_scale == "group" and scale is not None:
            scale = e4m3_scale_values(scale)
        return ProjectionWeights(weight, scale, zero, perm, bias, input_scale, scale2)


def mx_scale_codes(weights: ExpertWeights, variant: KernelVariant) -> list[int] | None:
    """[lowest, highest] e8m0 code of MX FP4 or fp8 experts' scales (None for any other key), read once
    where the weights are set up: the layer's custom ops take it as ``mx_scale_codes`` (_e2m1_fold,
    _e4m3_folded)."""
    if variant.weight_type not in ("e2m1", "fp8e4m3") or variant.weight_scale != "mx":
        return None
    codes = torch.cat([p.scale.reshape(-1).view(torch.uint8) for p in (weights.w13, weights.w2)])
    lowest, highest = torch.aminmax(codes)
    return [int(lowest), int(highest)]
