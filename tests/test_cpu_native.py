"""The compiled CPU kernel (torch-cpu-native) beyond what the conformance suite checks: its ops against exact
math (every fp8 byte, every e2m1 code with every e8m0 / e4m3 scale byte, zero points, int32 dots, int4 packing
order), quant_ref's fp8 activation quantisation bit for bit, the layer-wide dynamic per-tensor fp8 scale, its
other code paths (many rows, the unfolded fp8 path), resident bytes, and the oracle's choice (and fallback where
no compiler is on PATH). Producer files: test_cpu_native_producers.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_registry_kernels.cpu_native import KIND_FP4, KIND_FP8, KIND_INT8, NativeExperts, native_ops
from moe_registry_kernels.cpu_packed import packed_checkpoint_bytes
from moe_registry_kernels.dequant import dequantize, unpack_int4
from moe_registry_kernels.fp4 import e2m1_to_float
from moe_registry_kernels.quant_ref import AMAX_FLOOR, fake_quantize_activation, make_random_expert_weights
from moe_registry_kernels.reference import reference_moe, reference_moe_batched

from moe_registry.cli.main import main as cli_main
from moe_registry.core.keys import parse_quant_key
from moe_registry.formats.weights import ProjectionWeights
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.situation import describe as situation_module
from moe_registry.situation.runtime import Platform

GEN = torch.Generator().manual_seed(7)
INT8, FP8, FP4 = KIND_INT8, KIND_FP8, KIND_FP4


@pytest.fixture(scope="module")
def ops():
    return native_ops()


def test_the_build_targets_the_vector_isa_torch_reports(ops) -> None:
    cap = torch.backends.cpu.get_cpu_capability()
    assert ops.isa() == ("avx2" if cap in ("AVX2", "AVX512") else "scalar")


def test_every_fp8_byte_dequantises_exactly(ops) -> None:
    """All 256 e4m3 bytes (subnormals, both zeros) times block scales, huge ones included (s * 2^120 overflows
    float32: the two-step path): bit-equal to torch's own float8 -> float32 conversion times the scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(130, 1)  # [130, 256]
    codes[:, 0x7F] = codes[:, 0xFF] = 0  # NaN bytes: refused when a checkpoint loads
    fp8 = codes.view(torch.float8_e4m3fn)
    scale = torch.tensor([[0.37, 2.0 ** -20], [2.0 ** 20, 3.0e-3]])
    out = torch.empty(130, 256)
    ops.dq_rows(codes.view(torch.int8), scale, None, None, 128, 128, FP8, 0, out)
    want = fp8.float() * scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)
    assert torch.equal(out, want)


@pytest.mark.parametrize("scales", ["e8m0", "e4m3-scale2"])
def test_every_fp4_code_and_scale_byte_dequantises_as_the_reference(ops, scales: str) -> None:
    """Every e2m1 code in both nibbles, every e8m0 byte (2^-127 .. 2^127) or every finite e4m3 byte times a
    second-level scale per row: dq_rows is bit-equal to the reference's float32 dequantisation
    (value * (scale * scale2), one rounding)."""
    n, k = 254, 512
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(n, 1)  # [n, k/2]: every byte
    if scales == "e8m0":
        key, g = parse_quant_key("e2m1 scale:e8m0:block(1x32):static"), 32
        scale = torch.arange(n * (k // g), dtype=torch.int32).remainder(255).to(torch.uint8).view(n, k // g)
        scale2 = None
    else:
        key, g = parse_quant_key("e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static"), 16
        b = torch.arange(n * (k // g), dtype=torch.int32).remainder(256).to(torch.uint8)
        b[(b == 0x7F) | (b == 0xFF)] = 0x38  # NaN bytes: refused on load
        scale = b.view(torch.float8_e4m3fn).view(n, k // g)
        scale2 = torch.rand(n, generator=GEN) * 1e-3 + 1e-4
    out = torch.empty(n, k)
    ops.dq_rows(codes, scale, None, scale2, 1, g, FP4, 0, out)
    proj = ProjectionWeights(weight=codes[None], scale=scale[None],
                             scale2=None if scale2 is None else scale2.reshape(1, n, 1))
    assert torch.equal(out, dequantize(proj, key)[0])


def _fp4_operands(n: int, k: int, nvfp4: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int,
                                                           torch.Tensor]:
    """Random packed e2m1 codes [n, k/2], scales (e8m0 per 32 or e4m3 per 16), scale2 and the float64 weights."""
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.int32, generator=GEN).to(torch.uint8)
    g = 16 if nvfp4 else 32
    if nvfp4:
        scale = (torch.rand(n, -(-k // g), generator=GEN) * 400 + 0.01).to(torch.float8_e4m3fn)
        scale2 = torch.rand(n, generator=GEN) + 0.5
        s64 = scale.double() * scale2.double()[:, None]
    else:
        scale = torch.randint(110, 140, (n, -(-k // g)), dtype=torch.int32, generator=GEN).to(torch.uint8)
        scale2 = None
        s64 = torch.exp2(scale.double() - 127)
    w = e2m1_to_float(unpack_int4(codes), torch.float64) * s64.repeat_interleave(g, 1)[:, :k]
    return codes, scale, scale2, g, w


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 17])
@pytest.mark.parametrize("variant", ["mxfp4", "nvfp4", "uint8-zero-point"])
def test_fp4_and_zero_point_register_gemm_matches_float64(ops, m: int, variant: str) -> None:
    """e2m1 codes with e8m0 / e4m3 scales (and a second-level scale per row), uint8 codes with a zero point per
    group: rows of x one to four at a time, K with a partial last group (200), within float32 sums of float64."""
    n, k = 70, 200
    x = torch.randn(m, k, generator=GEN)
    if variant == "uint8-zero-point":
        g = 32
        raw = torch.randint(0, 256, (n, k), dtype=torch.int32, generator=GEN)
        zero = torch.randint(0, 256, (n, -(-k // g)), dtype=torch.int32, generator=GEN)
        s = torch.rand(n, -(-k // g), generator=GEN) + 0.05
        w = (raw - zero.repeat_interleave(g, 1)[:, :k]).double() * s.double().repeat_interleave(g, 1)[:, :k]
        y = ops.dq_gemm(x, (raw - 128).to(torch.int8), s, zero.to(torch.uint8), None, 1, g, INT8, True)
    else:
        codes, scale, scale2, g, w = _fp4_operands(n, k, variant == "nvfp4")
        y = ops.dq_gemm(x, codes, scale, None, scale2, 1, g, FP4, True)
    want = x.double() @ w.T
    assert float((y.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("m", [1, 3, 4, 7, 17])
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_register_gemm_matches_float64(ops, m: int, fp8: bool) -> None:
    """Rows of x four at a time plus 1-3 left over, a K with a tail (200), group scales: float32 sums of exact
    products, so within 1e-6 of float64."""
    n, k, g = 70, 200, 32
    raw = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=GEN)
    if fp8:
        raw[raw == 127] = 0
        raw[raw == -1] = 0  # 0x7F, 0xFF: NaN
    w = raw.view(torch.float8_e4m3fn).double() if fp8 else raw.double()
    s = torch.rand(n, -(-k // g), generator=GEN) + 0.05
    x = torch.randn(m, k, generator=GEN)
    y = ops.dq_gemm(x, raw, s, None, None, 1, g, FP8 if fp8 else INT8, True)
    want = x.double() @ (w * s.double().repeat_interleave(g, 1)[:, :k]).T
    assert float((y.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("bits", [8, 4])
def test_int_gemm_dots_are_exact_int32(ops, bits: int) -> None:
    """Codes at the extremes (-128 x -128 over K = 4096 would saturate _mm256_maddubs_epi16): the int32 dot is
    exact, checked on unit scales against int64 math; int4 in the kernel's nibble order."""
    m, n, k = 5, 40, 4096
    q = torch.full((m, k), -128, dtype=torch.int8)
    q[1] = 127
    q[2:] = torch.randint(-128, 128, (m - 2, k), dtype=torch.int8, generator=GEN)
    if bits == 8:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=GEN)
        codes[0] = -128
        w = codes
    else:
        codes = torch.randint(-8, 8, (n, k), generator=GEN)
        codes[0] = -8
        b = (codes + 8).view(n, k // 32, 2, 16)
        w = (b[:, :, 0] | (b[:, :, 1] << 4)).to(torch.uint8).reshape(n, k // 2)
    y = ops.int_gemm(q, torch.ones(m), w, bits, torch.ones(n, 1), 1, k)
    want = q.long() @ codes.long().T
    assert torch.equal(y.double(), want.double())


@pytest.mark.parametrize("key", ["fp8e4m3 scale:float32:group(128):dynamic", "fp8e4m3 scale:float32:token:dynamic"])
def test_fp8_activation_quantisation_is_quant_refs_bit_for_bit(ops, key: str) -> None:
    k = parse_quant_key(key)
    x = torch.randn(6, 400, generator=GEN) * torch.logspace(-9, 4, 400)[torch.randperm(400, generator=GEN)]
    x[0] = 0.0  # an all-zero row: the amax floor
    cols = 400 if k.scale.group.cols == -1 else k.scale.group.cols
    assert torch.equal(ops.fp8_fake_quant(x, cols, AMAX_FLOOR, 0.0), fake_quantize_activation(x, k))
    static = parse_quant_key("fp8e4m3 scale:float32:tensor:static")
    s = torch.tensor([0.0173])
    assert torch.equal(ops.fp8_fake_quant(x, 400, AMAX_FLOOR, float(s)), fake_quantize_activation(x, static, s))


def _layer_error(wkey: str, akey: str, tokens: int, scale: float = 1.0, **kw) -> float:
    w = make_random_expert_weights(parse_quant_key(wkey), parse_quant_key(akey), num_experts=2, hidden=256,
                                   intermediate=200, dtype=torch.float32, seed=3, **kw)
    experts = NativeExperts(w, ExpertsConfig())
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(1)) * scale
    ids = torch.tensor([[1, 0]] * tokens, dtype=torch.int32)
    topk_w = torch.full((tokens, 2), 0.5)
    ref = reference_moe(x, topk_w, ids, w, ExpertsConfig())
    return float((experts.apply(x, topk_w, ids).double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("tokens", [3, 40], ids=["register-kernel", "dequantised-tiles"])
@pytest.mark.parametrize("wkey", ["uint8b128 scale:float16:group(32):static", "fp8e4m3 scale:e8m0:block(1x32):static",
                                  "fp8e4m3 scale:float32:block(128x128):static",
                                  "uint8 scale:float16:group(32):static zp:group", "e2m1 scale:e8m0:block(1x32):static",
                                  "e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static"])
def test_both_row_paths_match_the_reference(wkey: str, tokens: int) -> None:
    """Up to SMALL_M rows per expert the register kernel, past it exactly dequantised tiles and torch.mm; a
    partial 128-row block (N = 400) and a partial column group (K = 200); zero points, FP4 codes and scales."""
    assert _layer_error(wkey, "unquantized", tokens) < 1e-5


@pytest.mark.parametrize("fold", [True, False], ids=["x-too-large", "scales-too-large"])
def test_fp8_gemm_falls_back_to_exact_rows_where_the_fold_would_overflow(ops, fold: bool) -> None:
    """x * 2^60 overflows float32 past 2^68 (or the caller says the scales' would): dequantised rows and a
    matmul instead of folding 2^60 into x, still within float32 rounding of float64."""
    raw = torch.randint(-126, 126, (48, 64), dtype=torch.int8, generator=GEN)
    raw[raw == -1] = 0  # 0xFF: NaN
    s = torch.rand(48, 2, generator=GEN) + 0.1
    x = torch.randn(2, 64, generator=GEN)
    if fold:
        x[1, 3] = 2.0 ** 70
    y = ops.dq_gemm(x, raw, s, None, None, 1, 32, FP8, fold)
    want = x.double() @ (raw.view(torch.float8_e4m3fn).double() * s.double().repeat_interleave(32, 1)).T
    assert bool(torch.isfinite(y).all()) and float((y.double() - want).norm() / want.norm()) < 1e-6


def test_huge_fp8_scales_take_the_exact_path() -> None:
    w = make_random_expert_weights(parse_quant_key("fp8e4m3 scale:e8m0:block(1x32):static"),
                                   parse_quant_key("unquantized"), num_experts=2, hidden=64, intermediate=64,
                                   dtype=torch.float32, seed=4)
    w = dataclasses.replace(w, w13=dataclasses.replace(w.w13, scale=torch.full_like(w.w13.scale, 127 + 80)))
    experts = NativeExperts(w, ExpertsConfig())
    assert not experts.w13.fold and experts.w2.fold
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * 1e-20
    ids = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
    topk_w = torch.full((5, 2), 0.5)
    ref = reference_moe(x, topk_w, ids, w, ExpertsConfig())
    assert float((experts.apply(x, topk_w, ids).double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("on_input", [False, True], ids=["router-after", "router-on-input"])
def test_fp8_dynamic_per_tensor_scale_spans_the_whole_layer(on_input: bool) -> None:
    """fp8-w8a8-dynamic: one activation scale over the layer's whole GEMM1 input (tokens routed nowhere here
    too) and one over all intermediates. Tokens 30x apart in size go to different experts: a scale per expert
    would quantise the small ones finely, 1e-2 from the reference on their rows; the layer-wide one matches."""
    w = make_random_expert_weights(parse_quant_key("fp8e4m3 scale:float32:tensor:static"),
                                   parse_quant_key("fp8e4m3 scale:float32:tensor:dynamic"), num_experts=4,
                                   hidden=128, intermediate=96, dtype=torch.float32, seed=6)
    config = ExpertsConfig(apply_router_weight_on_input=on_input)
    x = torch.randn(12, 128, generator=torch.Generator().manual_seed(3))
    x[:6] *= 0.03
    top_k = 1 if on_input else 2
    ids = torch.tensor([[0, 1]] * 6 + [[2, 3]] * 6, dtype=torch.int32)[:, :top_k]
    ids[-1] = -1  # a foreign pair: its token still counts towards GEMM1's amax,
    x[-1] *= 4  # and holds that amax
    topk_w = torch.full((12, top_k), 1.0 / top_k)
    ref = reference_moe(x, topk_w, ids, w, config)
    got = NativeExperts(w, config).apply(x, topk_w, ids).double()
    small = slice(0, 6)
    assert float((got[small] - ref[small]).norm() / ref[small].norm()) < 1e-5
    assert float((got - ref).norm() / ref.norm()) < 1e-5
    batched = torch.zeros(4, 6, 128)
    counts = torch.tensor([6, 0, 5, 0])
    batched[0], batched[2, :5] = x[:6], x[6:11]
    want = reference_moe_batched(batched, counts, w, ExpertsConfig())
    assert float((NativeExperts(w, ExpertsConfig()).apply_batched(batched, counts).double() - want).norm()
                 / want.norm()) < 1e-5


KEYS = [
    ("uint8b128 scale:float16:group(128):static", "unquantized"),
    ("uint8 scale:float16:group(128):static zp:group", "unquantized"),
    ("e2m1 scale:e8m0:block(1x32):static", "unquantized"),
    ("e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static", "unquantized"),
    ("fp8e4m3 scale:e8m0:block(1x32):static", "unquantized"),
    ("fp8e4m3 scale:float32:block(128x128):static", "fp8e4m3 scale:float32:group(128):dynamic"),
    ("int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic"),
    ("uint4b8 scale:float32:group(32):static", "int8 scale:float32:token:dynamic"),
]


@pytest.mark.parametrize("wkey,akey", KEYS, ids=[k[0] for k in KEYS])
def test_resident_bytes_within_a_quarter_of_the_checkpoint(wkey: str, akey: str) -> None:
    w = make_random_expert_weights(parse_quant_key(wkey), parse_quant_key(akey), num_experts=4, hidden=256,
                                   intermediate=384, dtype=torch.bfloat16, seed=5)
    packed = packed_checkpoint_bytes(w)
    experts = NativeExperts(w, ExpertsConfig())
    del w
    ratio = reachable_tensor_bytes(experts) / packed
    assert ratio <= 1.25, f"{wkey}: reachable / checkpoint bytes = {ratio:.3f}"


RUNTIME = ("platform: cpu\ndtype: bfloat16\nnum_experts: 8\ntop_k: 2\nhidden: 1024\nintermediate: 512\n"
           "quantization_config: {config}\n")
GPTQ8 = "{quant_method: gptq, bits: 8, group_size: 128, sym: true, desc_act: false}"
FP8_BLOCK = "{quant_method: fp8, weight_block_size: [128, 128], activation_scheme: dynamic}"


def _explain(tmp_path, capsys, config: str, *flags: str) -> str:
    rt = tmp_path / "rt.yaml"
    rt.write_text(RUNTIME.format(config=config))
    assert cli_main(["explain", str(rt), *flags]) == 0
    return capsys.readouterr().out


def _line(out: str, kernel: str) -> str:
    """The kernel's row of explain's kernel list."""
    return next(ln for ln in out.splitlines() if ln.lstrip(" +-").startswith(f"{kernel} "))


def test_explain_cpu_chooses_native_ahead_of_packed_and_reference(tmp_path, capsys) -> None:
    """bfloat16 int8 groups: torch-cpu-dot8 first (its int8 activations within the bfloat16 tolerance), then this
    kernel, ahead of the packed op and the reference."""
    out = _explain(tmp_path, capsys, GPTQ8)
    assert "kernel      torch-cpu-dot8" in out
    dot8, native, packed, ref = (_line(out, k) for k in ("torch-cpu-dot8", "torch-cpu-native", "torch-cpu-packed",
                                                           "torch-reference"))
    assert "chosen" in dot8 and "eligible" in native and "eligible" in packed and "eligible" in ref
    assert out.index(dot8) < out.index(native) < out.index(packed) < out.index(ref)


@pytest.mark.parametrize("config,chosen", [
    ("{quant_method: fp8, activation_scheme: dynamic}", "torch-cpu-native"),
    ("{quant_method: gptq, bits: 8, group_size: 128, sym: false, desc_act: false}", "torch-cpu-dot8"),
    ("{quant_method: mxfp4}", "torch-cpu-dot8")], ids=["fp8-dynamic", "gptq-w8-asym", "mxfp4"])
def test_explain_cpu_chooses_native_with_the_reference_behind_it(tmp_path, capsys, config: str, chosen: str) -> None:
    """Schemes only the reference ran on a CPU before (per-tensor dynamic fp8, uint8 zero points, FP4); in
    bfloat16, uint8 zero points and FP4 go to torch-cpu-dot8 first, this kernel next."""
    out = _explain(tmp_path, capsys, config)
    assert f"kernel      {chosen}" in out
    native, ref = (_line(out, k) for k in ("torch-cpu-native", "torch-reference"))
    assert ("chosen" if chosen == "torch-cpu-native" else "eligible") in native
    assert "eligible" in ref and out.index(native) < out.index(ref)


@pytest.mark.parametrize("config,fallback", [(GPTQ8, "torch-cpu-packed"), (FP8_BLOCK, "torch-reference")],
                         ids=["int8-group", "fp8-block"])
def test_without_a_compiler_the_oracle_falls_back_and_says_why(tmp_path, capsys, monkeypatch, config, fallback):
    """This machine probed (--platform auto) with no c++ on PATH: torch-cpu-native is rejected with the reason
    and the next kernel in the scheme's order runs."""
    monkeypatch.setattr(situation_module, "probe_platform", lambda: Platform("cpu", None, "cpu"))
    monkeypatch.setattr(situation_module, "probe_commands", lambda commands: frozenset(set(commands) - {"c++"}))
    out = _explain(tmp_path, capsys, config, "--platform", "auto")
    assert f"kernel      {fallback}" in out
    native = _line(out, "torch-cpu-native")
    assert "rejected" in native and "needs c++ on PATH: not found" in out
    monkeypatch.setattr(situation_module, "probe_commands", lambda commands: frozenset(commands))
    with_compiler = _explain(tmp_path, capsys, config, "--platform", "auto")
    assert "chosen" in _line(with_compiler, "torch-cpu-dot8")  # both schemes list it first on a CPU


def test_a_failed_build_is_one_line_naming_the_way_out(monkeypatch, tmp_path):
    """No compiler, or a build that breaks: one line naming the source, the build dir and what to do, not
    torch's build log."""
    import torch.utils.cpp_extension as ext
    from moe_registry_kernels import cpu_native

    from moe_registry.core.errors import ConfigError

    def broken(**_: object) -> None:
        raise RuntimeError("Error building extension 'moe_registry_cpu_moe_avx2'\nc++: not found")

    monkeypatch.setattr(ext, "load", broken)
    monkeypatch.setattr(cpu_native, "_OPS", [])
    monkeypatch.setenv("MOE_REGISTRY_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        cpu_native.native_ops()
    message = str(err.value)
    assert message.startswith("kernel torch-cpu-native: building cpu_moe.cpp in ")
    assert message.endswith("failed (Error building extension 'moe_registry_cpu_moe_avx2'); wanted a C++ compiler "
                            "(c++) and ninja on PATH, or pick another kernel (--kernel torch-cpu-packed)")
    assert "\n" not in message


def test_a_compiler_that_refuses_openmp_gets_a_single_threaded_build(monkeypatch, tmp_path):
    """Apple's clang refuses -fopenmp: the second build, without it, is the kernel (not a ConfigError)."""
    import torch.utils.cpp_extension as ext
    from moe_registry_kernels import cpu_native

    calls = []

    def picky(**kwargs: object) -> str:
        calls.append(list(kwargs["extra_cflags"]))  # type: ignore[arg-type]
        if "-fopenmp" in kwargs["extra_cflags"]:  # type: ignore[operator]
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")
        built = tmp_path / "built.so"  # what torch's load returns: the library it built (and loaded)
        built.write_bytes(b"")
        return str(built)

    monkeypatch.setattr(ext, "load", picky)
    monkeypatch.setattr(torch.backends.openmp, "is_available", lambda: True)
    monkeypatch.setattr(cpu_native, "_OPS", [])
    monkeypatch.setenv("MOE_REGISTRY_CACHE_DIR", str(tmp_path))
    assert cpu_native.native_ops() is torch.ops.moe_registry_cpu
    assert ["-fopenmp" in c for c in calls] == [True, False]
