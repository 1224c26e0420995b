"""The compiled CPU kernel (torch-cpu-native) beyond what the conformance suite checks: its ops against exact
math (every fp8 byte, int32 dots, int4 packing order), quant_ref's fp8 activation quantisation bit for bit,
its other code paths (many rows, the unfolded fp8 path), resident bytes, and the oracle's fallback where no
compiler is on PATH."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_registry_kernels.cpu_native import NativeExperts, native_ops
from moe_registry_kernels.cpu_packed import packed_checkpoint_bytes
from moe_registry_kernels.quant_ref import AMAX_FLOOR, fake_quantize_activation, make_random_expert_weights
from moe_registry_kernels.reference import reference_moe

from moe_registry.cli.main import main as cli_main
from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.model import situation as situation_module
from moe_registry.oracle.runtime import Platform

GEN = torch.Generator().manual_seed(7)


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
    ops.dq_rows(codes.view(torch.int8), scale, 128, 128, True, 0, out)
    want = fp8.float() * scale.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)
    assert torch.equal(out, want)


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
    y = ops.dq_gemm(x, raw, s, 1, g, fp8, True)
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
                                  "fp8e4m3 scale:float32:block(128x128):static"])
def test_both_row_paths_match_the_reference(wkey: str, tokens: int) -> None:
    """Up to SMALL_M rows per expert the register kernel, past it exactly dequantised tiles and torch.mm; a
    partial 128-row block (N = 400) and a partial column group (K = 200)."""
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
    y = ops.dq_gemm(x, raw, s, 1, 32, True, fold)
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


KEYS = [
    ("uint8b128 scale:float16:group(128):static", "unquantized"),
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
    return next(ln for ln in out.splitlines() if f" {kernel} " in ln)


def test_explain_cpu_chooses_native_ahead_of_packed_and_reference(tmp_path, capsys) -> None:
    out = _explain(tmp_path, capsys, GPTQ8)
    assert "kernel      torch-cpu-native" in out
    native, packed, ref = (_line(out, k) for k in ("torch-cpu-native", "torch-cpu-packed", "torch-reference"))
    assert "chosen" in native and "eligible" in packed and "eligible" in ref
    assert out.index(native) < out.index(packed) < out.index(ref)


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
    assert "kernel      torch-cpu-native" in _explain(tmp_path, capsys, config, "--platform", "auto")


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
