"""torch-cpu-dot8 beyond the conformance suite (which holds it to its declared 2e-2 against the float reference):
every build this CPU runs (AVX-512 VNNI, AVX2, scalar) computes exactly what its spec declares - the reference
with the declared int8-per-32-columns activations - for each weight form it claims; foreign experts, the batched
format and the op's refusals; the oracle's choice (bfloat16: this kernel, with the emulation note; float16 and
float32: passed over for torch-cpu-native, said; --prefer restores it) and a CPU without AVX2 turning it down."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from moe_registry_kernels import cpu_dot8
from moe_registry_kernels.cpu_packed import packed_checkpoint_bytes
from moe_registry_kernels.dequant import unpack_int4
from moe_registry_kernels.quant_ref import make_random_expert_weights
from moe_registry_kernels.reference import reference_moe, reference_moe_batched

from moe_registry.core.checks import Reason
from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.layer.routing import softmax_topk
from moe_registry.oracle.select import select
from moe_registry.situation.describe import Flags, situation_for
from moe_registry.situation.machine import probe_cpu_features
from moe_registry.situation.runtime import Platform
from moe_registry.spec.loader import load_registry

REGISTRY = load_registry()
DECLARED = parse_quant_key(REGISTRY.kernel("torch-cpu-dot8").key_patterns()[0].emulation.activation)
BUILDS = [name for name, _, _ in cpu_dot8.ISA_FLAGS if cpu_dot8.runs(name)]
UNQUANTIZED = parse_quant_key("unquantized")
GPTQ4 = Path(__file__).parent / "fixtures" / "gptqmodel" / "qwen3-gptq-w4-sym" / "checkpoint"


def _layer(weight: str, hidden: int, inter: int, *, bias: bool = False, experts: int = 4):
    return make_random_expert_weights(parse_quant_key(weight), UNQUANTIZED, num_experts=experts, hidden=hidden,
                                      intermediate=inter, dtype=torch.float32, bias=bias, seed=11)


def _experts(weights, isa: str, activation: str = "silu", on_input: bool = False) -> cpu_dot8.Dot8Experts:
    ex = cpu_dot8.Dot8Experts(weights, ExpertsConfig(activation, apply_router_weight_on_input=on_input))
    ex._ops = cpu_dot8.dot8_ops(isa)
    return ex


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("weight,hidden,inter", [
    ("uint4b8 scale:float16:group(128):static", 256, 128),
    ("uint4b8 scale:float16:channel:static", 96, 80),  # K padded to 64, N = 80 and 96 rows
    ("uint4 scale:float16:group(32):static zp:group", 96, 160),  # groups of one activation block
    ("uint4 scale:float16:group(64):static zp:group", 128, 192),
    ("uint8b128 scale:float16:group(128):static", 256, 128),
    ("uint8 scale:float16:channel:static zp:group", 96, 112),
    ("e2m1 scale:e8m0:block(1x32):static", 256, 96),  # MXFP4
    ("e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static", 128, 160),  # NVFP4: groups of 16
])
def test_each_build_computes_the_declared_int8_activation_math(isa: str, weight: str, hidden: int,
                                                               inter: int) -> None:
    """Against the float64 reference whose activations are quantised as the spec's emulation key says (per 32
    columns, amax / 127): equal but for float32 sums and the rare intermediate code that float32 rounds to the
    other side of a half (one such flip moves the output about 5e-4), 10x under the quantisation's own error;
    and within the declared tolerance of the float reference."""
    plain, biased = _layer(weight, hidden, inter), _layer(weight, hidden, inter, bias=True)
    gen = torch.Generator().manual_seed(5)
    # without bias: two calls, the activation function and the router-weighted sum inside the second; with: the
    # composed path (bias, then torch's activation function)
    for weights, activation, tokens in ((plain, "silu", 1), (plain, "gelu", 5), (plain, "swigluoai", 9),
                                        (biased, "swigluoai", 3)):
        x = torch.randn(tokens, hidden, generator=gen)
        r = softmax_topk(torch.randn(tokens, 4, generator=gen), 2, True)
        config = ExpertsConfig(activation)
        out = _experts(weights, isa, activation).apply(x, r.topk_weights, r.topk_ids)
        declared = reference_moe(x, r.topk_weights, r.topk_ids, dataclasses.replace(weights, activation_key=DECLARED),
                                 config, torch.float64)
        exact = reference_moe(x, r.topk_weights, r.topk_ids, weights, config, torch.float64)
        assert _rel(out, declared) < 2e-3, (isa, weight, activation)
        assert 1e-3 < _rel(out, exact) < 2e-2  # the quantised activations' error: there, and inside the tolerance


NVFP4 = "e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static"


@pytest.mark.parametrize("isa", BUILDS)
def test_nvfp4_keeps_float16_group_scales_exactly_and_each_rows_tensor_scale(isa: str) -> None:
    """NVFP4's e4m3 group scales, halved, are held in float16 bit-exactly (every e4m3 byte but NaN), and its tensor
    scale multiplies each output row once: with a different scale2 on every row (gate and up have their own in
    checkpoints) the layer still computes the declared math."""
    weights = _layer(NVFP4, 128, 96)
    gen = torch.Generator().manual_seed(9)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3's NaN bytes are refused when a checkpoint loads
    w13 = weights.w13
    scale = codes[torch.randint(len(codes), w13.scale.shape, generator=gen)].view(torch.float8_e4m3fn)
    rows = torch.rand(w13.scale2.shape, generator=gen) * 3 + 0.25
    weights = dataclasses.replace(weights, w13=dataclasses.replace(w13, scale=scale, scale2=rows))
    layer = _experts(weights, isa)
    e, n, g = scale.shape
    held = layer.w13.scale.view(e, n // 4, g // 4, 4, 4).transpose(2, 3).reshape(e, n, g)  # undo the chunk order
    assert layer.w13.scale.dtype == torch.float16
    assert torch.equal(held.double(), scale.double() * 0.5)
    assert torch.equal(layer.w13.row_scale, rows.reshape(e, n))
    x = torch.randn(7, 128, generator=gen)
    r = softmax_topk(torch.randn(7, 4, generator=gen), 2, True)
    declared = reference_moe(x, r.topk_weights, r.topk_ids, dataclasses.replace(weights, activation_key=DECLARED),
                             ExpertsConfig(), torch.float64)
    assert _rel(layer.apply(x, r.topk_weights, r.topk_ids), declared) < 2e-3


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("weight", ["uint4b8 scale:float16:group(128):static",
                                    "uint8b128 scale:float16:group(32):static", "e2m1 scale:e8m0:block(1x32):static"])
def test_a_fixed_zero_is_folded_not_stored_and_matches_stored_zeros(isa: str, weight: str) -> None:
    """Without zero points no zero is stored; the folded zero computes what the same zero stored per group does
    (the zero-point path), but for float32 rounding."""
    weights = _layer(weight, 128, 192)
    ops = cpu_dot8.dot8_ops(isa)
    folded = cpu_dot8.Dot8Proj.build(weights.w13, weights.weight_key, ops)
    assert folded.zero.numel() == 0 and folded.zero_const >= 0
    stored = dataclasses.replace(folded, zero=torch.full(folded.scale.shape, folded.zero_const, dtype=torch.uint8),
                                 zero_const=-1)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([0, 3, 1, 1, 2])
    a, b = folded.gemm(ops, x, ids), stored.gemm(ops, x, ids)
    assert float((a - b).norm() / b.norm()) < 1e-5


@pytest.mark.parametrize("weight", [NVFP4, "e2m1 scale:e8m0:block(1x32):static",
                                    "uint4b8 scale:float16:group(128):static",
                                    "uint4 scale:float16:group(32):static zp:group",
                                    "uint8b128 scale:float16:channel:static"])
def test_resident_bytes_within_a_quarter_of_the_checkpoint(weight: str) -> None:
    """What the layer keeps reachable (codes, scales, zeros only where the checkpoint has them, NVFP4's float16
    group scales and row scales) against the checkpoint's packed expert bytes."""
    w = make_random_expert_weights(parse_quant_key(weight), UNQUANTIZED, num_experts=4, hidden=256,
                                   intermediate=384, dtype=torch.bfloat16, seed=5)
    packed = packed_checkpoint_bytes(w)
    layer = cpu_dot8.Dot8Experts(w, ExpertsConfig())
    del w
    for ratio in (layer.resident_weight_bytes() / packed, reachable_tensor_bytes(layer) / packed):
        assert ratio <= 1.25, f"{weight}: {ratio:.3f}"


FP8_KEYS = [("fp8e4m3 scale:float32:block(128x128):static", "fp8e4m3 scale:float32:group(128):dynamic"),
            ("fp8e4m3 scale:float32:channel:static", "fp8e4m3 scale:float32:token:dynamic")]


def _fp8_codes(shape: tuple[int, ...], gen: torch.Generator, subnormal_only: bool = False) -> torch.Tensor:
    """Random e4m3 bytes over every finite code (subnormals, +-448 and both zeros among them), or over the
    subnormals 0x01..0x07 and their negatives only."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN bytes are refused when a checkpoint loads
    if subnormal_only:
        codes = codes[((codes & 0x78) == 0) & ((codes & 0x07) != 0)]
    return codes[torch.randint(len(codes), shape, generator=gen)].view(torch.float8_e4m3fn)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("wkey,akey", FP8_KEYS, ids=["block128", "channel"])
def test_fp8_runs_the_schemes_own_numbers_subnormals_and_max_codes_included(isa: str, wkey: str, akey: str) -> None:
    """FP8 W8A8 has no emulation here: against the float64 reference (activations quantised to e4m3 as the scheme
    declares), only float32 summation order differs. Weight codes over every finite e4m3 byte, activations over
    16 binary orders of magnitude (so that many quantise to subnormal codes); then weights of subnormal codes only,
    whose every product a subnormal-flushing dot (bfloat16's) would drop; K and N not multiples of 128; and 1 and
    2 threads giving the same bits."""
    gen = torch.Generator().manual_seed(4)
    for hidden, inter, subnormal in ((320, 192, False), (192, 96, True)):
        weights = make_random_expert_weights(parse_quant_key(wkey), parse_quant_key(akey), num_experts=4,
                                             hidden=hidden, intermediate=inter, dtype=torch.float32, seed=8)
        w13, w2 = (dataclasses.replace(p, weight=_fp8_codes(tuple(p.weight.shape), gen, subnormal))
                   for p in (weights.w13, weights.w2))
        weights = dataclasses.replace(weights, w13=w13, w2=w2)
        x = torch.randn(6, hidden, generator=gen) * torch.exp2(-16 * torch.rand(6, hidden, generator=gen))
        r = softmax_topk(torch.randn(6, 4, generator=gen), 2, True)
        layer = _experts(weights, isa)
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = layer.apply(x, r.topk_weights, r.topk_ids)
            torch.set_num_threads(2)
            two = layer.apply(x, r.topk_weights, r.topk_ids)
        finally:
            torch.set_num_threads(before)
        want = reference_moe(x, r.topk_weights, r.topk_ids, weights, ExpertsConfig(), torch.float64)
        assert torch.equal(one, two) and want.norm() > 0
        assert _rel(one, want) < 1e-5, (isa, wkey, subnormal, _rel(one, want))


def test_fp8_refuses_what_its_spec_does_not_claim() -> None:
    weights = make_random_expert_weights(parse_quant_key(FP8_KEYS[0][0]), parse_quant_key(FP8_KEYS[1][1]),
                                         num_experts=2, hidden=128, intermediate=64, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"torch-cpu-dot8 runs fp8e4m3 weights with float32 scales per 128x128 block "
                                         r"or per channel, .* got weight key fp8e4m3 scale:float32:block\(128x128\)"
                                         r":static, activation key fp8e4m3 scale:float32:token:dynamic"):
        cpu_dot8.Dot8Experts(weights, ExpertsConfig())


def test_foreign_experts_add_nothing_and_router_weight_on_input() -> None:
    """A pair routed to another rank's expert (-1) adds nothing, bias included; router weights on the input
    scale GEMM1's rows (quantised per pair then)."""
    x = torch.randn(3, 128)
    ids = torch.tensor([[0, 1], [2, -1], [-1, 3]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    for bias in (False, True):  # the two-call path and the composed one
        weights = _layer("uint4b8 scale:float16:group(64):static", 128, 64, bias=bias)
        declared = dataclasses.replace(weights, activation_key=DECLARED)
        local = reference_moe(x, w, ids.clamp(min=0), declared, ExpertsConfig(), torch.float64)
        drop = reference_moe(x, w * (ids >= 0), ids.clamp(min=0), declared, ExpertsConfig(), torch.float64)
        out = _experts(weights, BUILDS[0]).apply(x, w, ids)
        assert _rel(out, drop) < 2e-3 and _rel(out, local) > 1e-2
    ex1 = _experts(weights, BUILDS[0], on_input=True)
    ids1 = torch.tensor([[1], [3], [2]])
    ref = reference_moe(x, w[:, :1], ids1, dataclasses.replace(weights, activation_key=DECLARED),
                        ExpertsConfig(apply_router_weight_on_input=True), torch.float64)
    assert _rel(ex1.apply(x, w[:, :1], ids1), ref) < 2e-3


def test_batched_format_matches_the_declared_math() -> None:
    weights = _layer("uint8b128 scale:float16:group(128):static", 128, 128)
    x = torch.randn(4, 3, 128)
    counts = torch.tensor([3, 0, 1, 2])
    out = _experts(weights, BUILDS[0]).apply_batched(x, counts)
    ref = reference_moe_batched(x, counts, dataclasses.replace(weights, activation_key=DECLARED), ExpertsConfig(),
                                torch.float64)
    assert _rel(out, ref) < 2e-3
    assert not out[1].any() and not out[2, 1:].any()


def test_refusals_name_what_was_seen_and_wanted() -> None:
    weights = _layer("uint4b8 scale:float16:group(32):static", 96, 96)
    bad = dataclasses.replace(weights.w13, scale=weights.w13.scale[:, :, :2])  # groups of 48 columns
    with pytest.raises(ValueError, match=r"uint4b8 scale:float16:group\(32\):static: 2 scale groups over K=96; "
                                         "torch-cpu-dot8 takes groups of 16 or 32 columns or a multiple of 64"):
        cpu_dot8.Dot8Proj.build(bad, weights.weight_key, cpu_dot8.dot8_ops())
    with pytest.raises(ValueError, match=r"quantises 16- and 32-bit activations itself \(and takes int8 scale:float32:"
                                         r"token:dynamic ones on int8 weights\), got activation key int8 scale:float32:"
                                         r"group\(32\):dynamic on weight key uint4b8"):
        cpu_dot8.Dot8Experts(dataclasses.replace(weights, activation_key=DECLARED), ExpertsConfig())
    proj = cpu_dot8.Dot8Proj.build(weights.w13, weights.weight_key, cpu_dot8.dot8_ops())
    with pytest.raises(RuntimeError, match=r"experts\[0\] = 4 is outside \[0, 4\)"):
        proj.gemm(cpu_dot8.dot8_ops(), torch.zeros(1, 96), torch.tensor([4]))
    with pytest.raises(RuntimeError, match="a's K = 64 does not match the codes' padded K = 128"):
        proj.gemm(cpu_dot8.dot8_ops(), torch.zeros(1, 64), torch.tensor([0]))


@pytest.mark.parametrize("isa", BUILDS)
def test_repacked_codes_sit_in_a_huge_page_aligned_buffer_of_their_own(isa: str) -> None:
    """The codes start on a 2 MiB boundary (where madvise can give them huge pages), hold exactly their bytes and
    outlive the call that made them."""
    weights = _layer("uint4b8 scale:float16:group(128):static", 256, 128)
    proj = cpu_dot8.Dot8Proj.build(weights.w13, weights.weight_key, cpu_dot8.dot8_ops(isa))
    assert proj.codes.data_ptr() % (1 << 21) == 0
    assert proj.codes.nbytes == 4 * 256 * 256 // 2
    unpacked = unpack_int4(weights.w13.weight[1].view(torch.uint8))  # expert 1, row 5: columns 0..31 low nibbles,
    assert torch.equal(proj.codes[1, 1, 0, 1] & 0xF, unpacked[5, :32])  # 32..63 high ones
    assert torch.equal(proj.codes[1, 1, 0, 1] >> 4, unpacked[5, 32:64])
    with pytest.raises(RuntimeError, match="nbytes must be >= 0, got -1"):
        cpu_dot8.dot8_ops(isa).weight_buffer(-1)


def test_the_default_build_is_the_best_this_cpu_runs() -> None:
    assert cpu_dot8.dot8_ops().isa() == BUILDS[0]
    flags = probe_cpu_features()
    vnni = "avx512_vnni" in flags and "avx512bw" in flags
    assert (vnni and "avx512_bf16" in flags) == (BUILDS[0] == "avx512bf16")
    assert vnni == (BUILDS[0] in ("avx512bf16", "avx512vnni"))


def test_cpu_features_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: none\n")
    assert probe_cpu_features(str(info)) == frozenset({"fpu", "sse2", "avx2", "fma"})
    assert probe_cpu_features(str(tmp_path / "missing")) == frozenset()


def _report(dtype: str, features: frozenset[str] | None, prefer: str | None = None):
    situation = situation_for(GPTQ4 / "config.json", REGISTRY, Flags(platform="cpu", dtype=dtype))
    runtime = dataclasses.replace(situation.runtime, platform=Platform("cpu", None, "cpu", features))
    return select(REGISTRY, dataclasses.replace(situation, runtime=runtime), prefer=prefer)


def test_bfloat16_runs_it_with_the_emulation_said() -> None:
    report = _report("bfloat16", frozenset({"avx2", "fma"}))
    assert report.chosen == "torch-cpu-dot8" and report.notes == ()
    (note,) = report.downgrades
    assert (note.kind.value, note.asked, note.runs) == ("activation", "unquantized", str(DECLARED))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_float16_and_float32_pass_it_over_for_exact_sums_and_prefer_restores_it(dtype: str) -> None:
    report = _report(dtype, frozenset({"avx2", "fma"}))
    assert (report.chosen, report.downgrades) == ("torch-cpu-native", ())
    assert report.notes == (f"torch-cpu-dot8 passed over: its numbers for {dtype} (emulation; declared error up to "
                            "0.02) exceed scheme gptq-w4a16's tolerance 0.01; torch-cpu-native computes it as asked "
                            "(--prefer torch-cpu-dot8 runs it)",)
    preferred = _report(dtype, frozenset({"avx2", "fma"}), prefer="torch-cpu-dot8")
    assert preferred.chosen == "torch-cpu-dot8"
    assert [d.kind.value for d in preferred.downgrades] == ["activation"]


def test_a_cpu_without_avx2_turns_it_down_with_the_reason() -> None:
    report = _report("bfloat16", frozenset({"sse2", "fma"}))
    verdict = next(v for v in report.kernels if v.kernel == "torch-cpu-dot8")
    assert not verdict.eligible and report.chosen == "torch-cpu-packed"
    (failure,) = verdict.failures
    assert failure.reason is Reason.CAPABILITY
    assert failure.message == "this CPU lacks avx2; the kernel's build needs avx2, fma"
    unprobed = _report("bfloat16", None)  # --platform cpu names no machine: not checked, said
    check = next(c for v in unprobed.kernels if v.kernel == "torch-cpu-dot8" for c in v.checks
                 if c.field == "platform.cpu_features")
    assert check.passed and "not checked" in check.message


def test_two_threads_compute_what_one_does_bit_for_bit() -> None:
    """Every task runs exactly once whichever thread takes it (a task run twice would add its rows twice into the
    router-weighted sum, one skipped would leave them out)."""
    weights = _layer("uint4b8 scale:float16:group(128):static", 256, 512, experts=16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(12, 256, generator=gen)
    r = softmax_topk(torch.randn(12, 16, generator=gen), 4, True)
    layer = _experts(weights, BUILDS[0])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer.apply(x, r.topk_weights, r.topk_ids)
        torch.set_num_threads(2)
        two = [layer.apply(x, r.topk_weights, r.topk_ids) for _ in range(5)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one, t) for t in two)
    assert one.abs().sum() > 0
