"""Format converters. Random float weights are packed into each checkpoint format, converted to the
``nk`` layout, and read back with ``dequantize``; the result must equal an independent reading of
the raw checkpoint tensors written here from each format's documented bit layout (no helper shared
with the package) and be close to the original weights. Bad values must be rejected by a message
naming the full checkpoint tensor, what was found and what was expected."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from moe_registry_kernels.dequant import dequantize

from moe_registry.core.errors import CheckpointError, MoERegistryError, SpecError
from moe_registry.core.keys import parse_quant_key
from moe_registry.formats import ConvertContext, get_converter, known_converters
from moe_registry.spec.loader import load_registry
from moe_registry.testing import packers

ROLES = ("gate", "up", "down")
FORMATS_DIR = Path(__file__).resolve().parent.parent / "moe_registry" / "formats"
MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}
E, H, INTER = 3, 64, 32


def mixtral_name(e: int, role: str, tensor: str) -> str:
    return f"model.layers.1.block_sparse_moe.experts.{e}.{MIXTRAL[role]}.{tensor}"


def float_weights(seed: int, experts: int = E, h: int = H, i: int = INTER) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    return [{r: torch.randn(shapes[r], generator=gen) * 0.1 for r in ROLES} for _ in range(experts)]


# ---- independent readings of the raw checkpoint tensors: value [out, in] float32 ---------------


def read_awq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """AutoAWQ GEMM: nibble i of word j holds output column 8j + [0,2,4,6,1,3,5,7][i]."""
    qw, qz, s = t["qweight"].long(), t["qzeros"].long(), t["scales"].float()
    k, n = qw.shape[0], qw.shape[1] * 8
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    q = torch.zeros(k, n, dtype=torch.long)
    z = torch.zeros(qz.shape[0], n, dtype=torch.long)
    for i in range(8):
        q[:, order[i]::8] = (qw >> (4 * i)) & 0xF
        z[:, order[i]::8] = (qz >> (4 * i)) & 0xF
    g = torch.arange(k) // (k // s.shape[0])
    return ((q - z[g]) * s[g]).t()


def read_gptq(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """GPTQ v1: qweight packed along the input, low bits first; qzeros store zero − 1; g_idx."""
    qw, qz, s, g_idx = t["qweight"].long(), t["qzeros"].long(), t["scales"].float(), t["g_idx"].long()
    per, mask = 32 // bits, (1 << bits) - 1
    q = torch.zeros(qw.shape[0] * per, qw.shape[1], dtype=torch.long)
    z = torch.zeros(qz.shape[0], qz.shape[1] * per, dtype=torch.long)
    for i in range(per):
        q[i::per, :] = (qw >> (bits * i)) & mask
        z[:, i::per] = ((qz >> (bits * i)) & mask) + 1
    return ((q - z[g_idx]) * s[g_idx]).t()


def read_ct_int4(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors pack-quantized: 8 nibbles along the input, low first, signed int4 + 8."""
    pk, s = t["weight_packed"].long(), t["weight_scale"].float()
    n, k = pk.shape[0], pk.shape[1] * 8
    q = torch.zeros(n, k, dtype=torch.long)
    for i in range(8):
        q[:, i::8] = ((pk >> (4 * i)) & 0xF) - 8
    return q * s[:, torch.arange(k) // (k // s.shape[1])]


def read_int8(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1)


def read_mxfp8(t: dict[str, torch.Tensor]) -> torch.Tensor:
    scale = torch.pow(2.0, t["weight_scale"].double() - 127).float()
    return t["weight"].float() * scale.repeat_interleave(32, dim=1)


def read_fp8_block(t: dict[str, torch.Tensor]) -> torch.Tensor:
    w = t["weight"].float()
    s = t["weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w * s[: w.shape[0], : w.shape[1]]


@dataclass(frozen=True)
class Case:
    id: str
    fmt: str
    weight_key: str
    pack: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    read: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    tol: float  # relative Frobenius error allowed against the original float weights
    activation_key: str = "unquantized"
    activation_dtype: torch.dtype = torch.float16
    h: int = H
    i: int = INTER

    def context(self, tensor_name=mixtral_name) -> ConvertContext:
        return ConvertContext(parse_quant_key(self.weight_key), parse_quant_key(self.activation_key),
                              self.activation_dtype, {}, tensor_name)


CASES = [
    Case("awq-g32", "awq-gemm", "uint4 scale:float16:group(32):static zp:group",
         lambda w: packers.pack_awq_gemm(w, 32), read_awq, 0.12),
    Case("awq-g-1", "awq-gemm", "uint4 scale:float16:group(-1):static zp:group",
         lambda w: packers.pack_awq_gemm(w, -1), read_awq, 0.15),
    Case("gptq4-g32", "gptq", "uint4b8 scale:float16:group(32):static",
         lambda w: packers.pack_gptq(w, 4, 32), lambda t: read_gptq(t, 4), 0.12),
    Case("gptq8-g32", "gptq", "uint8b128 scale:float16:group(32):static",
         lambda w: packers.pack_gptq(w, 8, 32), lambda t: read_gptq(t, 8), 0.01),
    Case("quark-channel", "quark-int8", "int8 scale:float32:channel:static",
         packers.pack_quark_int8, read_int8, 0.02, "int8 scale:float32:token:dynamic"),
    Case("quark-channel-bf16", "quark-int8", "int8 scale:float32:channel:static",
         lambda w: packers.pack_quark_int8(w, scale_dtype=torch.bfloat16), read_int8, 0.02,
         "int8 scale:float32:token:dynamic", torch.bfloat16),
    Case("quark-tensor-static", "quark-int8", "int8 scale:float32:tensor:static",
         lambda w: packers.pack_quark_int8(w, per_tensor=True, input_scale=0.05), read_int8, 0.03,
         "int8 scale:float32:tensor:static"),
    Case("ct-int8", "quark-int8", "int8 scale:float32:channel:static",
         packers.pack_compressed_tensors_int8, read_int8, 0.02, "int8 scale:float32:token:dynamic",
         torch.bfloat16),
    Case("mxfp8", "modelopt-mxfp8", "fp8e4m3 scale:e8m0:block(1x32):static",
         packers.pack_modelopt_mxfp8, read_mxfp8, 0.07, "fp8e4m3 scale:e8m0:block(1x32):dynamic",
         torch.bfloat16),
    Case("fp8-block", "fp8-block", "fp8e4m3 scale:float32:block(128x128):static",
         packers.pack_fp8_block, read_fp8_block, 0.07, "fp8e4m3 scale:float32:group(128):dynamic",
         torch.bfloat16, h=256, i=128),
    Case("unquantized", "unquantized", "unquantized",
         packers.pack_unquantized, lambda t: t["weight"].to(torch.float16).float(), 0.01),
    Case("ct-int4-g32", "compressed-tensors-pack", "uint4b8 scale:bfloat16:group(32):static",
         lambda w: packers.pack_compressed_tensors_int4(w, 32), read_ct_int4, 0.12,
         "unquantized", torch.bfloat16),
]
CASE_BY_ID = {c.id: c for c in CASES}


def pack_experts(case: Case, weights: list[dict[str, torch.Tensor]]) -> list[dict[str, dict[str, torch.Tensor]]]:
    return [{r: case.pack(w[r]) for r in ROLES} for w in weights]


def clone(experts):
    return [{r: {n: t.clone() for n, t in roles.items()} for r, roles in ex.items()} for ex in experts]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b) -> None:
    """Bit-for-bit equality (NaN included): converters must not write into their inputs."""
    for ea, eb in zip(a, b, strict=True):
        for r in ROLES:
            assert ea[r].keys() == eb[r].keys()
            for n in ea[r]:
                assert ea[r][n].dtype == eb[r][n].dtype and ea[r][n].shape == eb[r][n].shape, (r, n)
                assert torch.equal(_bytes(ea[r][n]), _bytes(eb[r][n])), (r, n)


def expected(case: Case, experts) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.stack([torch.cat([case.read(ex["gate"]), case.read(ex["up"])]) for ex in experts])
    w2 = torch.stack([case.read(ex["down"]) for ex in experts])
    return w13, w2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_converted_weights_mean_what_the_checkpoint_means(case: Case) -> None:
    weights = float_weights(1, h=case.h, i=case.i)
    experts = pack_experts(case, weights)
    before = clone(experts)
    ew = get_converter(case.fmt, "nk")(experts, case.context())
    assert_same(experts, before)

    assert ew.layout == "nk" and ew.num_experts == E
    assert (ew.hidden_size, ew.intermediate_size) == (case.h, case.i)
    assert str(ew.weight_key) == str(parse_quant_key(case.weight_key))
    want13, want2 = expected(case, experts)
    got13, got2 = dequantize(ew.w13, ew.weight_key), dequantize(ew.w2, ew.weight_key)
    assert got13.shape == (E, 2 * case.i, case.h) and got2.shape == (E, case.h, case.i)
    torch.testing.assert_close(got13, want13, rtol=0, atol=0)
    torch.testing.assert_close(got2, want2, rtol=0, atol=0)

    orig13 = torch.stack([torch.cat([w["gate"], w["up"]]) for w in weights])
    orig2 = torch.stack([w["down"] for w in weights])
    assert rel_err(got13, orig13) < case.tol
    assert rel_err(got2, orig2) < case.tol


@pytest.mark.parametrize("case_id,weight_dtype,scale_shape,scale_dtype", [
    ("awq-g32", torch.uint8, (E, 2 * INTER, H // 32), torch.float16),
    ("awq-g-1", torch.uint8, (E, 2 * INTER, 1), torch.float32),
    ("gptq4-g32", torch.uint8, (E, 2 * INTER, H // 32), torch.float16),
    ("gptq8-g32", torch.uint8, (E, 2 * INTER, H // 32), torch.float16),
    ("quark-channel", torch.int8, (E, 2 * INTER, 1), torch.float32),
    ("quark-tensor-static", torch.int8, (E, 2 * INTER, 1), torch.float32),
    ("ct-int8", torch.int8, (E, 2 * INTER, 1), torch.float32),
    ("mxfp8", torch.float8_e4m3fn, (E, 2 * INTER, H // 32), torch.uint8),
    ("fp8-block", torch.float8_e4m3fn, (E, 2, 2), torch.float32),
    ("unquantized", torch.float16, None, None),
    ("ct-int4-g32", torch.uint8, (E, 2 * INTER, H // 32), torch.bfloat16),
])
def test_layout_dtypes_and_shapes(case_id, weight_dtype, scale_shape, scale_dtype) -> None:
    case = CASE_BY_ID[case_id]
    ew = get_converter(case.fmt, "nk")(pack_experts(case, float_weights(2, h=case.h, i=case.i)), case.context())
    w = ew.w13
    assert w.weight.dtype == weight_dtype
    if scale_shape is None:
        assert w.scale is None
    else:
        assert (tuple(w.scale.shape), w.scale.dtype) == (scale_shape, scale_dtype)
    if case.weight_key.endswith("zp:group"):
        assert w.zero.dtype == torch.uint8 and w.zero.shape == w.scale.shape
    else:
        assert w.zero is None
    packed_k = case.h // 2 if weight_dtype == torch.uint8 and "8b128" not in case.weight_key else case.h
    assert tuple(w.weight.shape) == (E, 2 * case.i, packed_k)


def test_awq_scales_cast_to_the_key_scale_dtype() -> None:
    """A bf16 run binds bf16 scales: fp16 checkpoint scales are rounded once, nothing else moves."""
    case = CASE_BY_ID["awq-g32"]
    experts = pack_experts(case, float_weights(3))
    ctx = ConvertContext(parse_quant_key("uint4 scale:bfloat16:group(32):static zp:group"),
                         parse_quant_key("unquantized"), torch.bfloat16)
    ew = get_converter("awq-gemm", "nk")(experts, ctx)
    assert ew.w13.scale.dtype == torch.bfloat16
    want13, _ = expected(case, experts)
    torch.testing.assert_close(dequantize(ew.w13, ew.weight_key), want13, rtol=2**-8, atol=0)


# ---- act-order ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_act_order(bits: int) -> None:
    gen = torch.Generator().manual_seed(4)
    weights = float_weights(4)
    orders = [(torch.randperm(H, generator=gen), torch.randperm(INTER, generator=gen)) for _ in range(E)]
    orders[1] = (None, None)  # one expert without act-order
    experts = [
        {"gate": packers.pack_gptq(w["gate"], bits, 16, o_in), "up": packers.pack_gptq(w["up"], bits, 16, o_in),
         "down": packers.pack_gptq(w["down"], bits, 16, o_dn)}
        for w, (o_in, o_dn) in zip(weights, orders, strict=True)
    ]
    before = clone(experts)
    ctx = ConvertContext(parse_quant_key(f"{'uint4b8' if bits == 4 else 'uint8b128'} scale:float16:group(16):static"),
                         parse_quant_key("unquantized"), torch.float16, {}, mixtral_name)
    ew = get_converter("gptq", "nk")(experts, ctx)
    assert_same(experts, before)

    assert ew.w13.perm.dtype == torch.int32 and ew.w13.perm.shape == (E, H)
    assert ew.w2.perm.shape == (E, INTER)
    for e, ex in enumerate(experts):
        g_idx = ex["gate"]["g_idx"].long()
        assert torch.equal(ew.w13.perm[e].long(), torch.argsort(g_idx, stable=True))
        # stored order: groups contiguous, group of stored column j is j // 16
        assert torch.equal(g_idx[ew.w13.perm[e].long()], torch.arange(H) // 16)
    assert torch.equal(ew.w13.perm[1], torch.arange(H, dtype=torch.int32))
    assert not torch.equal(ew.w13.perm[0], torch.arange(H, dtype=torch.int32))

    def read(t):
        return read_gptq(t, bits)

    w13 = torch.stack([torch.cat([read(ex["gate"]), read(ex["up"])]) for ex in experts])
    w2 = torch.stack([read(ex["down"]) for ex in experts])
    torch.testing.assert_close(dequantize(ew.w13, ew.weight_key), w13, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(ew.w2, ew.weight_key), w2, rtol=0, atol=0)
    orig13 = torch.stack([torch.cat([w["gate"], w["up"]]) for w in weights])
    assert rel_err(dequantize(ew.w13, ew.weight_key), orig13) < (0.12 if bits == 4 else 0.01)


def _gptq_ctx() -> ConvertContext:
    return ConvertContext(parse_quant_key("uint4b8 scale:float16:group(16):static"),
                          parse_quant_key("unquantized"), torch.float16, {}, mixtral_name)


def _gptq_act_order_experts(seed: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for w in float_weights(seed, experts=2):
        o_in = torch.randperm(H, generator=gen)
        out.append({"gate": packers.pack_gptq(w["gate"], 4, 16, o_in),
                    "up": packers.pack_gptq(w["up"], 4, 16, o_in),
                    "down": packers.pack_gptq(w["down"], 4, 16, torch.randperm(INTER, generator=gen))})
    return out


def test_gptq_gate_and_up_act_order_must_agree() -> None:
    experts = _gptq_act_order_experts(5)
    experts[1]["up"] = packers.pack_gptq(torch.randn(INTER, H), 4, 16, torch.randperm(H))
    with pytest.raises(CheckpointError) as err:
        get_converter("gptq", "nk")(experts, _gptq_ctx())
    msg = str(err.value)
    assert "model.layers.1.block_sparse_moe.experts.1.w3.g_idx" in msg
    assert "model.layers.1.block_sparse_moe.experts.1.w1.g_idx" in msg
    assert "same act-order permutation" in msg


def test_gptq_g_idx_with_uneven_groups() -> None:
    experts = _gptq_act_order_experts(6)
    g_idx = experts[0]["down"]["g_idx"].clone()
    g_idx[g_idx == 1] = 0  # group 0 now holds 32 columns, group 1 none
    experts[0]["down"] = {**experts[0]["down"], "g_idx": g_idx}
    with pytest.raises(CheckpointError, match=r"experts\.0\.w2\.g_idx: group 0 has 32 columns; expected every "
                                              r"group to hold 16 columns"):
        get_converter("gptq", "nk")(experts, _gptq_ctx())


def test_gptq_g_idx_out_of_range() -> None:
    experts = _gptq_act_order_experts(7)
    g_idx = experts[1]["gate"]["g_idx"].clone()
    g_idx[5] = 9
    experts[1]["gate"] = {**experts[1]["gate"], "g_idx": g_idx}
    with pytest.raises(CheckpointError, match=r"experts\.1\.w1\.g_idx: 1 of 64 values are outside 0\.\.3 "
                                              r"\(first at \[5\] = 9\)"):
        get_converter("gptq", "nk")(experts, _gptq_ctx())


# ---- per-tensor scales and static activation scales ---------------------------------------------


def test_per_tensor_gate_and_up_keep_their_own_scales() -> None:
    weights = float_weights(8)
    experts = []
    for e, w in enumerate(weights):
        experts.append({
            "gate": packers.pack_quark_int8(w["gate"] * (1 + e), per_tensor=True, input_scale=0.01 * (e + 1)),
            "up": packers.pack_quark_int8(w["up"] * 3, per_tensor=True, input_scale=0.02 * (e + 1)),
            "down": packers.pack_quark_int8(w["down"], per_tensor=True, input_scale=0.5 - 0.1 * e),
        })
    case = CASE_BY_ID["quark-tensor-static"]
    ew = get_converter("quark-int8", "nk")(experts, case.context())
    for e, ex in enumerate(experts):
        gate_s, up_s = ex["gate"]["weight_scale"], ex["up"]["weight_scale"]
        assert gate_s.shape == () and gate_s != up_s
        assert torch.equal(ew.w13.scale[e, :INTER, 0], gate_s.expand(INTER))
        assert torch.equal(ew.w13.scale[e, INTER:, 0], up_s.expand(INTER))
    assert ew.w13.input_scale.dtype == torch.float32 and ew.w13.input_scale.shape == (1,)
    assert ew.w13.input_scale.item() == pytest.approx(0.02 * E)  # max over gate and up of every expert
    assert ew.w2.input_scale.item() == pytest.approx(0.5)
    want13, want2 = expected(case, experts)
    torch.testing.assert_close(dequantize(ew.w13, ew.weight_key), want13, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(ew.w2, ew.weight_key), want2, rtol=0, atol=0)


def test_dynamic_activations_ignore_no_input_scale_but_static_needs_one() -> None:
    case = CASE_BY_ID["quark-channel"]
    experts = pack_experts(case, float_weights(9))
    assert get_converter("quark-int8", "nk")(experts, case.context()).w13.input_scale is None
    static = Case("x", "quark-int8", "int8 scale:float32:channel:static", packers.pack_quark_int8, read_int8, 0,
                  "int8 scale:float32:tensor:static")
    with pytest.raises(CheckpointError, match=r"missing checkpoint tensor "
                                              r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.input_scale"):
        get_converter("quark-int8", "nk")(experts, static.context())


# ---- biases -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bias_is_fused_and_stacked_as_float32(case: Case) -> None:
    gen = torch.Generator().manual_seed(10)
    experts = pack_experts(case, float_weights(10, h=case.h, i=case.i))
    for ex in experts:
        for r in ROLES:
            n = case.h if r == "down" else case.i
            ex[r]["bias"] = torch.randn(n, generator=gen).to(torch.bfloat16)
    ew = get_converter(case.fmt, "nk")(experts, case.context())
    assert ew.w13.bias.dtype == torch.float32 and ew.w13.bias.shape == (E, 2 * case.i)
    want = torch.stack([torch.cat([ex["gate"]["bias"], ex["up"]["bias"]]).float() for ex in experts])
    assert torch.equal(ew.w13.bias, want)
    assert torch.equal(ew.w2.bias, torch.stack([ex["down"]["bias"].float() for ex in experts]))


def test_bias_on_some_projections_only() -> None:
    case = CASE_BY_ID["unquantized"]
    experts = pack_experts(case, float_weights(11))
    experts[0]["gate"]["bias"] = torch.ones(INTER)
    with pytest.raises(CheckpointError, match=r"missing checkpoint tensor model\.layers\.1\.block_sparse_moe\."
                                              r"experts\.0\.w3\.bias while .*experts\.0\.w1\.bias exists"):
        get_converter("unquantized", "nk")(experts, case.context())


# ---- bad values ---------------------------------------------------------------------------------


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    out = t.clone()
    out[index] = value
    return out


def _set_low_field(words: torch.Tensor, bits: int, value: int) -> torch.Tensor:
    """Word [0, 0] with its lowest ``bits`` replaced by ``value``."""
    out = words.clone()
    mask = (1 << bits) - 1
    out[0, 0] = (int(out[0, 0]) & ~mask) | value
    return out


BAD = [
    # (case id, expert, role, tensor, mutate, message fragments)
    ("awq-g32", 1, "gate", "scales", lambda t: _set(t, (1, 5), float("nan")),
     ["1 of 64 values are NaN (first at [1, 5] = nan)", "expected finite scales > 0"]),
    ("gptq4-g32", 2, "down", "scales", lambda t: _set(t, (0, 3), float("inf")),
     ["are infinite (first at [0, 3] = inf)", "expected finite scales > 0"]),
    ("quark-channel", 0, "up", "weight_scale", lambda t: _set(t, 7, 0.0),
     ["are zero (first at [7] = 0.0)", "expected finite scales > 0"]),
    ("quark-tensor-static", 0, "down", "input_scale", lambda t: torch.tensor(float("nan")),
     ["are NaN", "expected finite scales > 0"]),
    ("fp8-block", 1, "up", "weight_scale_inv", lambda t: _set(t, (0, 1), -0.5),
     ["are negative (first at [0, 1] = -0.5)"]),
    ("ct-int8", 2, "gate", "weight_scale", lambda t: _set(t, (3, 0), float("-inf")),
     ["are infinite (first at [3, 0] = -inf)"]),
    ("gptq4-g32", 0, "gate", "qzeros", lambda t: _set_low_field(t, 4, 15),
     ["zero point out of range",
      "1 of 64 stored zero points [group, output column] are stored as 15 (first at [0, 0] = 15), meaning 16",
      "outside 0..15", "expected 7 (zero = 8"]),
    ("gptq4-g32", 1, "down", "qzeros", lambda t: _set_low_field(t, 4, 3),
     ["asymmetric zero points", "are not 7 (first at [0, 0] = 3)", "expected 7 everywhere (zero = 8)",
      "only symmetric GPTQ"]),
    ("gptq8-g32", 0, "up", "qzeros", lambda t: _set_low_field(t, 8, 100),
     ["asymmetric zero points", "are not 127 (first at [0, 0] = 100)", "expected 127 everywhere (zero = 128)"]),
    ("gptq8-g32", 0, "up", "qzeros", lambda t: _set_low_field(t, 8, 255),
     ["zero point out of range", "are stored as 255 (first at [0, 0] = 255), meaning 256"]),
    ("mxfp8", 2, "down", "weight_scale", lambda t: _set(t, (4, 0), 255),
     ["1 of 64 values are 255, the E8M0 NaN encoding (first at [4, 0] = 255)", "expected exponents 0..254"]),
    ("ct-int4-g32", 0, "gate", "weight_zero_point", lambda t: _set(torch.zeros(INTER, 2, dtype=torch.int8), (2, 1), 3),
     ["asymmetric zero points", "are non-zero (first at [2, 1] = 3)", "expected all 0"]),
    ("unquantized", 1, "up", "bias", lambda t: _set(torch.zeros(INTER), 4, float("nan")),
     ["are NaN (first at [4] = nan)", "expected finite values"]),
]


@pytest.mark.parametrize("case_id,expert,role,tensor,mutate,fragments", BAD,
                         ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_are_rejected_naming_the_tensor(case_id, expert, role, tensor, mutate, fragments) -> None:
    case = CASE_BY_ID[case_id]
    experts = pack_experts(case, float_weights(12, h=case.h, i=case.i))
    if tensor == "bias":  # a bias everywhere, one of them bad
        for ex in experts:
            for r in ROLES:
                ex[r]["bias"] = torch.zeros(case.h if r == "down" else case.i)
    experts[expert][role] = {**experts[expert][role], tensor: mutate(experts[expert][role].get(tensor))}
    before = clone(experts)
    with pytest.raises(CheckpointError) as err:
        get_converter(case.fmt, "nk")(experts, case.context())
    msg = str(err.value)
    assert msg.startswith(f"{mixtral_name(expert, role, tensor)}: "), msg
    for fragment in fragments:
        assert fragment in msg, msg
    assert_same(experts, before)


def test_scale_that_does_not_fit_the_key_dtype() -> None:
    case = CASE_BY_ID["ct-int4-g32"]
    experts = pack_experts(case, float_weights(13))
    experts[0]["down"]["weight_scale"] = _set(experts[0]["down"]["weight_scale"], (2, 0), 2.0**20)
    ctx = ConvertContext(parse_quant_key("uint4b8 scale:float16:group(32):static"),
                         parse_quant_key("unquantized"), torch.float16)  # default naming
    with pytest.raises(CheckpointError, match=r"^experts\.0\.down\.weight_scale: 1 of 64 values are not "
                                              r"representable in torch\.float16 \(first at \[2, 0\] = 1048576\.0\), "
                                              r"which becomes inf"):
        get_converter("compressed-tensors-pack", "nk")(experts, ctx)


def test_fp8_block_gate_up_must_fill_whole_blocks() -> None:
    case = CASE_BY_ID["fp8-block"]
    experts = pack_experts(case, float_weights(14, experts=2, h=256, i=64))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight: 64 output rows, not a multiple of the "
                                              r"128-row scale block.*intermediate size % 128 == 0"):
        get_converter("fp8-block", "nk")(experts, case.context())


def test_a_conversion_makes_every_role_or_one_projection() -> None:
    """One projection (a dense linear given as the down projection) converts that alone, w13 the same projection;
    any other set of roles is refused by name."""
    case = CASE_BY_ID["fp8-block"]
    down = pack_experts(case, float_weights(16, experts=1, h=256, i=64))[0]["down"]
    one = get_converter("fp8-block", "nk")([{"down": down}], dataclasses.replace(case.context(), roles=("down",)))
    assert one.w13 is one.w2 and tuple(one.w2.weight.shape) == (1, 256, 64)
    with pytest.raises(MoERegistryError, match=r"^roles \('gate',\): a conversion makes every role "):
        get_converter("fp8-block", "nk")([{"down": down}], dataclasses.replace(case.context(), roles=("gate",)))


def test_missing_tensor_and_missing_role() -> None:
    case = CASE_BY_ID["awq-g32"]
    experts = pack_experts(case, float_weights(15))
    del experts[2]["up"]["qzeros"]
    with pytest.raises(CheckpointError, match=r"missing checkpoint tensor .*experts\.2\.w3\.qzeros "
                                              r"\(this projection has: qweight, scales\)"):
        get_converter("awq-gemm", "nk")(experts, case.context())
    experts = pack_experts(case, float_weights(15))
    del experts[1]["down"]
    with pytest.raises(CheckpointError, match=r"expert 1 has no down projection"):
        get_converter("awq-gemm", "nk")(experts, case.context())
    with pytest.raises(CheckpointError, match="no experts to convert"):
        get_converter("awq-gemm", "nk")([], case.context())


def test_key_that_the_format_cannot_hold() -> None:
    case = CASE_BY_ID["gptq4-g32"]
    ctx = ConvertContext(parse_quant_key("int4 scale:float16:group(32):static"),
                         parse_quant_key("unquantized"), torch.float16)
    with pytest.raises(MoERegistryError, match="format 'gptq' holds uint4b8 or uint8b128 or uint4 or uint8 "
                                               "weights, but the scheme bound weight key int4 scale"):
        get_converter("gptq", "nk")(pack_experts(case, float_weights(16)), ctx)


def test_a_key_outside_the_formats_holds_is_refused_before_converting() -> None:
    """The format spec's holds patterns, not the converter, decide: MXFP4 holds e8m0 scales per 32 inputs only."""
    ctx = ConvertContext(parse_quant_key("e2m1 scale:e8m0:group(16):static"), parse_quant_key("unquantized"),
                         torch.bfloat16)
    with pytest.raises(MoERegistryError, match=r"^checkpoint format 'mxfp4' holds e2m1 scale:e8m0:group\(32\):\* "
                                               r"weights, but the scheme bound weight key e2m1 scale:e8m0:group\(16\)"):
        get_converter("mxfp4", "nk")([], ctx)


# ---- registry ------------------------------------------------------------------------------------


def test_every_format_is_registered_for_nk() -> None:
    formats = {"awq-gemm", "gptq", "quark-int8", "modelopt-mxfp8", "fp8-block", "unquantized",
               "compressed-tensors-pack"}
    assert {(f, "nk") for f in formats} <= set(known_converters())
    assert known_converters() == sorted(known_converters())


def test_unknown_pair_lists_known_pairs() -> None:
    with pytest.raises(MoERegistryError, match=r"no converter from checkpoint format 'awq-gemm' to kernel "
                                               r"layout 'kn'; known: awq-gemm -> nk, .*gptq -> nk"):
        get_converter("awq-gemm", "kn")


def test_converters_are_declared_by_format_specs_not_found_by_import() -> None:
    """Every shipped converter module is named by a format spec, and nothing is registered by
    importing: the pairs come from specs/formats/*.yaml."""
    declared = {spec.spec.format: spec.spec for spec in load_registry().formats.values()}
    assert set(known_converters()) == {(f, c.layout) for f, s in declared.items() for c in s.converters}
    modules = {c.impl.partition(":")[0] for s in declared.values() for c in s.converters}
    helpers = ("__init__", "assemble", "bitpack", "checks", "layer", "registry", "stacked", "weights")
    shipped = {f"moe_registry.formats.{p.stem}" for p in FORMATS_DIR.glob("*.py")} - {
        f"moe_registry.formats.{name}" for name in helpers}
    assert modules == shipped


def test_a_user_spec_dir_adds_a_converter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A format spec in a user dir with its converter in a package inside that dir: found by
    (format, layout), imported only when asked for."""
    (tmp_path / "formats").mkdir()
    package = tmp_path / "my_converters"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "halves.py").write_text(
        "from moe_registry.formats.unquantized import convert_unquantized\n"
        "def convert(experts, ctx):\n"
        "    half = [{r: {n: t / 2 for n, t in ts.items()} for r, ts in e.items()} for e in experts]\n"
        "    return convert_unquantized(half, ctx)\n")
    (tmp_path / "formats" / "halves.yaml").write_text(
        "format: halves\nsummary: weights stored doubled\n"
        "converters:\n  - {layout: nk, impl: 'my_converters.halves:convert'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = load_registry([tmp_path])
    assert ("halves", "nk") in known_converters(registry)
    assert "my_converters.halves" not in sys.modules  # declared, not imported
    case = CASE_BY_ID["unquantized"]
    experts = pack_experts(case, float_weights(2, h=case.h, i=case.i))
    plain = get_converter("unquantized", "nk", registry)(experts, case.context())
    halved = get_converter("halves", "nk", registry)(experts, case.context())
    torch.testing.assert_close(halved.w13.weight.float() * 2, plain.w13.weight.float(), rtol=1e-3, atol=1e-7)


def test_a_converter_outside_the_spec_dir_is_refused_before_import(tmp_path: Path) -> None:
    (tmp_path / "formats").mkdir()
    (tmp_path / "formats" / "evil.yaml").write_text(
        "format: evil\nsummary: x\nconverters:\n  - {layout: nk, impl: 'antigravity:fly'}\n")
    with pytest.raises(SpecError, match=r"evil.yaml:4: converters.0.impl: format evil converter nk: impl "
                                        r"antigravity:fly: module antigravity is neither in moe_registry.formats"):
        load_registry([tmp_path])
    assert "antigravity" not in sys.modules


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_nk_bytes_are_the_codes_unpacked_and_packed_again(bits: int, dim: int) -> None:
    """Reading the words as bytes equals unpacking every field and packing it into the nk layout, on words
    with every bit pattern (negative int32 words too)."""
    from moe_registry.formats.bitpack import nk_bytes, pack_nibbles, unpack_int32

    g = torch.Generator().manual_seed(bits + dim)
    words = torch.randint(-2**31, 2**31 - 1, (12, 40) if dim == 0 else (40, 12), generator=g, dtype=torch.int32)
    codes = unpack_int32(words, bits, dim=dim)
    codes = codes.t() if dim == 0 else codes  # [N, K]
    want = pack_nibbles(codes) if bits == 4 else codes.to(torch.uint8)
    got = nk_bytes(words, bits, dim)
    assert got.dtype == torch.uint8 and got.shape == (40, 12 * 4) and torch.equal(got, want)


def test_stacking_fused_rows_equals_torch_stack_of_cat() -> None:
    """Fusing gate and up and stacking over experts writes each byte once; the result is torch.stack of
    torch.cat's, promotion of differing dtypes included, and pieces torch.stack refuses are refused alike."""
    from moe_registry.formats.assemble import _stack_rows

    gen = torch.Generator().manual_seed(0)
    pieces = [(torch.randn(6, 4, generator=gen).to(torch.bfloat16), torch.randn(6, 4, generator=gen).to(torch.bfloat16))
              for _ in range(5)]
    want = torch.stack([torch.cat(p) for p in pieces])
    got = _stack_rows(pieces)
    assert got.dtype == want.dtype and torch.equal(got, want)
    single = [(p[0],) for p in pieces]  # w2: one piece an expert
    assert torch.equal(_stack_rows(single), torch.stack([p[0] for p in pieces]))
    mixed = [(a.float(), b) for a, b in pieces]  # gate in float32, up in bfloat16: promoted as torch.cat does
    got = _stack_rows(mixed)
    assert got.dtype == torch.float32 and torch.equal(got, torch.stack([torch.cat(p) for p in mixed]))
    ragged = [*pieces[:-1], (pieces[-1][0][:5], pieces[-1][1])]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        _stack_rows(ragged)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_a_nan_or_infinity_anywhere_in_a_float_tensor_is_refused(dtype: torch.dtype) -> None:
    """The check reads min and max, which NaN reaches and an infinity is: every bad value at every place."""
    from moe_registry.core.guards import check_tensor_values

    n = 100_003  # past every vector width, with a tail
    check_tensor_values("w", torch.randn(n).to(dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, n // 2, n - 1):
            t = torch.randn(n).to(dtype)
            t[at] = bad
            with pytest.raises(CheckpointError, match=rf"^w: 1 of {n} values are NaN or infinite \(first at "
                                                      rf"\[{at}\] = {bad}\); expected finite values$"):
                check_tensor_values("w", t)


@pytest.mark.parametrize(("value", "signed", "what"), [
    (-0.5, True, None), (0.0, True, "are zero"), (float("nan"), True, "are NaN"), (float("-inf"), True, "are infinite"),
    (-0.5, False, "are negative"), (float("inf"), False, "are infinite"), (6e-5, False, None)])
def test_check_scales_refuses_what_the_scheme_refuses(value, signed, what):
    """Scales are checked in one pass, the message found only for a bad tensor: ``signed_scales`` (AutoRound's
    symmetric int4) takes a negative scale and refuses zero, NaN and infinity; unsigned ones refuse any value
    that is not finite and > 0, wherever it sits."""
    from moe_registry.formats.checks import check_scales

    scales = torch.full((4, 6), 0.25, dtype=torch.float16)
    scales[3, 5] = value
    if what is None:
        check_scales(scales, "model.layers.0.mlp.experts.0.gate_proj.scales", signed=signed)
        return
    wanted = rf"experts\.0\.gate_proj\.scales: 1 of 24 values {what} \(first at \[3, 5\]"
    with pytest.raises(CheckpointError, match=wanted):
        check_scales(scales, "model.layers.0.mlp.experts.0.gate_proj.scales", signed=signed)
