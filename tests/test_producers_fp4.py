"""FP4 checkpoints read as their producers mean them (tests/fixtures/fp4, made by tools/make_fixtures_fp4.py;
versions in VERSIONS.json), and the Triton FP4 paths (interpreter, float16).

NVFP4 and compressed-tensors MXFP4: a tiny Qwen3-MoE quantized and saved by ModelOpt 0.47 (NVFP4, both
config forms) and llm-compressor 0.14 / compressed-tensors 0.19 (presets NVFP4, NVFP4A16, MXFP4,
MXFP4A16); ref.safetensors holds the producer's own dequantisation of experts 0 and 1 (ours equal it, and
what explain says of gpt-oss MXFP4: tests/test_producers.py). W4A4 checkpoints run weight-only (the
schemes' ``emulation``), which explain must say.

gpt-oss MXFP4: blocks and scales laid out as OpenAI's checkpoints lay them out; ref.safetensors holds
what transformers' own reader (``Mxfp4Config(dequantize=True)``) made of them: its dequantised fused
expert tensors and its GptOssMLP's output with the routing it chose. The float64 MoE here is written
from modeling_gpt_oss (x @ W + b, gate/up interleaved, gate clamped at 7 above, up at +-7, (up + 1) *
gate * sigmoid(1.702 gate)), not from our activation code.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.cli.main import main
from moe_registry.core.errors import CheckpointError
from moe_registry.layer.experts import ExpertsConfig

try:  # the Triton decoders, for the exhaustive test below (a jit function resolves names in module globals)
    import triton
    import triton.language as tl
    from moe_registry_kernels.triton.fp4_dequant import (
        _dequant_e2m1,
        _e2m1_value,
        _folded_e8m0,
        _scale_code_value,
        e2m1_register_order,
        e4m3_scale_codes,
    )
except ImportError:
    triton = None
else:
    @triton.jit
    def _decode_e2m1_codes(e2m1_ptr, e2m1_out):
        tl.store(e2m1_out + tl.arange(0, 16), _e2m1_value(tl.load(e2m1_ptr + tl.arange(0, 16))))

    @triton.jit
    def _decode_scale_codes(codes_ptr, out_ptr, DT: tl.constexpr, TIMES: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(out_ptr + offs, _scale_code_value(tl.load(codes_ptr + offs), DT, TIMES))

    @triton.jit
    def _folded_scales(codes_ptr, out_ptr, n, DT: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(out_ptr + offs, _folded_e8m0(tl.load(codes_ptr + offs, mask=offs < n, other=127), DT), mask=offs < n)

    @triton.jit
    def _dequant_folded(codes_ptr, scale_ptr, low_ptr, high_ptr, rows):
        """Every byte of codes_ptr (256) under each of ``rows`` folded float16 scales (at most 256)."""
        r = tl.arange(0, 256)[:, None]
        c = tl.arange(0, 256)[None, :]
        scale = tl.load(scale_ptr + r, mask=r < rows, other=0.0)
        low, high = _dequant_e2m1(tl.broadcast_to(tl.load(codes_ptr + c), (256, 256)), scale, tl.float16,
                                  False, True)
        tl.store(low_ptr + r * 256 + c, low, mask=r < rows)
        tl.store(high_ptr + r * 256 + c, high, mask=r < rows)

FIXTURES = Path(__file__).parent / "fixtures" / "fp4"
MXFP4 = FIXTURES / "gpt-oss-mxfp4"
PREFIX = "model.layers.0.mlp.experts."
E, H, INTER = 4, 64, 64
MXFP4_KEY = "e2m1 scale:e8m0:group(32):static"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.fixture(scope="module")
def mxfp4_ref() -> dict[str, torch.Tensor]:
    return load_file(str(MXFP4 / "ref.safetensors"))


@pytest.fixture(scope="module")
def mxfp4_built():
    return moe_registry.build(MXFP4, platform="cpu", layer=0, dtype="float32", kernel="torch-reference")


def _gpt_oss_moe64(gate_up: torch.Tensor, gate_up_b: torch.Tensor, down: torch.Tensor, down_b: torch.Tensor,
                   x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, limit: float = 7.0,
                   alpha: float = 1.702) -> torch.Tensor:
    """modeling_gpt_oss's GptOssExperts in float64 on transformers-layout tensors ([E, in, out])."""
    x, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = x[t] @ gate_up[e].double() + gate_up_b[e].double()
            gate, up = gu[::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
            h = (up + 1) * gate * torch.sigmoid(gate * alpha)
            out[t] += float(w[t, j]) * (h @ down[e].double() + down_b[e].double())
    return out


def _transformers_moe64(ref: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                        w: torch.Tensor) -> torch.Tensor:
    ckpt = load_file(str(MXFP4 / "model.safetensors"))
    return _gpt_oss_moe64(ref["experts.gate_up_proj"], ckpt[PREFIX + "gate_up_proj_bias"], ref["experts.down_proj"],
                          ckpt[PREFIX + "down_proj_bias"], x, ids, w)


# ------------------------------------------------------------------------------------- MXFP4 (gpt-oss)


def test_versions_name_the_producer() -> None:
    versions = json.loads((FIXTURES / "VERSIONS.json").read_text())
    wanted = {"gpt-oss-mxfp4": "transformers", "modelopt-qwen3-nvfp4": "nvidia-modelopt",
              **{n: "compressed-tensors" for n in QWEN_FP4 if n.startswith("ct-")}}
    assert set(versions["fixtures"]) == set(wanted) == {p.name for p in FIXTURES.iterdir() if p.is_dir()}
    for fixture, producer in wanted.items():
        run = versions["packages"][fixture]
        assert run[producer] and run["transformers"].startswith("5.") and run["torch"], fixture


def test_gpt_oss_20b_config_picks_triton(tmp_path: Path, capsys) -> None:
    """openai/gpt-oss-20b's config.json as published (its shape and quantization_config): the Triton kernel
    on an H100 with the swigluoai clamp and biases, at hidden 2880 (no power of two: masked K tiles)."""
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
              "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
              "num_hidden_layers": 24, "hidden_act": "silu", "swiglu_limit": 7.0, "torch_dtype": "bfloat16",
              "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 201088,
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                  "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["explain", str(tmp_path / "config.json"), "--platform", "cuda:9.0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheme"]["name"] == "mxfp4" and report["scheme"]["weight_key"] == MXFP4_KEY
    assert report["chosen_kernel"] == "triton-fused-moe"
    assert report["runtime"]["shape"]["activation"] == "swigluoai" and report["runtime"]["shape"]["has_bias"]


def test_mxfp4_dequantised_weights_equal_transformers(mxfp4_built, mxfp4_ref) -> None:
    """Bit-exact: our packed codes and scales, dequantised, are transformers' bfloat16 weights (gate and up
    taken from its interleaved columns; w13 holds gate rows then up rows)."""
    from moe_registry_kernels.dequant import dequantize

    weights = mxfp4_built.weights
    assert str(weights.weight_key) == MXFP4_KEY and weights.w13.weight.dtype == torch.uint8
    assert tuple(weights.w13.weight.shape) == (E, 2 * INTER, H // 2)  # still packed: the kernels read the codes
    gu = mxfp4_ref["experts.gate_up_proj"].float()  # [E, H, 2I]
    want13 = torch.cat((gu[:, :, 0::2].transpose(1, 2), gu[:, :, 1::2].transpose(1, 2)), dim=1)
    want2 = mxfp4_ref["experts.down_proj"].float().transpose(1, 2)
    assert torch.equal(dequantize(weights.w13, weights.weight_key), want13)
    assert torch.equal(dequantize(weights.w2, weights.weight_key), want2)


def test_mxfp4_layer_matches_transformers_block(mxfp4_built, mxfp4_ref) -> None:
    """transformers' GptOssMLP output (its routing, bfloat16) is reproduced by the float64 MoE on its
    weights, and our layer (torch reference) is within the scheme's tolerance of it."""
    x, ids, w = mxfp4_ref["hidden_states"].float(), mxfp4_ref["layer.topk_ids"], mxfp4_ref["layer.topk_weights"].float()
    want64 = _transformers_moe64(mxfp4_ref, x, ids, w)
    assert _rel(want64, mxfp4_ref["layer.output"]) < 1.5e-2
    got = mxfp4_built.kernel(x, w, ids)
    assert _rel(got, want64) < 1e-5  # float32 reference on the same (exact) weights
    assert _rel(got, mxfp4_ref["layer.output"]) <= mxfp4_built.tolerance


def test_mxfp4_router_routes_as_transformers(mxfp4_ref) -> None:
    """The full layer module (router + experts) picks transformers' experts on its hidden states."""
    layer = moe_registry.load_layer(MXFP4, layer=0, device="cpu")
    x = mxfp4_ref["hidden_states"].float()
    with torch.no_grad():
        out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    want64 = _transformers_moe64(mxfp4_ref, x, mxfp4_ref["layer.topk_ids"], mxfp4_ref["layer.topk_weights"].float())
    # the CPU kernel's own tolerance (its int8 activations add ~1%); one token routed elsewhere is far more
    assert _rel(out, want64) < layer.build.tolerance, (layer.build.report.chosen, layer.build.tolerance)


def test_mxfp4_triton_kernel_matches_float64_moe_float16(mxfp4_built, mxfp4_ref) -> None:
    """The Triton fused kernel (interpreter, float16 activations) on the packed e2m1 weights, with the
    clamped swiglu and biases in its epilogue."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton.experts import TritonExperts

    x = mxfp4_ref["hidden_states"].to(torch.float16)
    ids, w = mxfp4_ref["layer.topk_ids"], mxfp4_ref["layer.topk_weights"].float()
    want64 = _transformers_moe64(mxfp4_ref, x.float(), ids, w)
    got = TritonExperts(mxfp4_built.weights, ExpertsConfig(activation="swigluoai")).apply(x, w, ids)
    tol = moe_registry.load_registry().scheme("mxfp4").tolerance["float16"]
    assert got.dtype == torch.float16 and _rel(got, want64) <= tol, f"{_rel(got, want64):.2e} > {tol}"


# ------------------------------------------------------------------------------------- NVFP4


NVFP4_KEY = "e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static"
NVFP4_ACT = "e2m1 scale:fp8e4m3:group(16):dynamic scale2:float32:tensor:static"
MXFP4_ACT = "e2m1 scale:e8m0:group(32):dynamic"
# per-expert FP4 checkpoints of the tiny Qwen3-MoE: scheme, weight key, the checkpoint's activation key
# when the scheme emulates it (runs 16-bit activations instead), else None
QWEN_FP4 = {
    "modelopt-qwen3-nvfp4": ("modelopt-nvfp4", NVFP4_KEY, NVFP4_ACT),
    "ct-qwen3-nvfp4": ("compressed-tensors-nvfp4", NVFP4_KEY, NVFP4_ACT),
    "ct-qwen3-nvfp4a16": ("compressed-tensors-nvfp4a16", NVFP4_KEY, None),
    "ct-qwen3-mxfp4": ("compressed-tensors-mxfp4", MXFP4_KEY, MXFP4_ACT),
    "ct-qwen3-mxfp4a16": ("compressed-tensors-mxfp4a16", MXFP4_KEY, None),
}
QWEN_PREFIX = "model.layers.0.mlp.experts."


def _nvfp4_dirs(tmp_path: Path) -> dict[str, Path]:
    """Every config form: ModelOpt's export (hf_quant_config.json and config.json's quantization_config),
    each of its two forms alone, and compressed-tensors'."""
    out = {name: FIXTURES / name for name in QWEN_FP4}
    only_config = tmp_path / "modelopt-config-json-only"
    shutil.copytree(FIXTURES / "modelopt-qwen3-nvfp4", only_config)
    (only_config / "hf_quant_config.json").unlink()
    only_hf = tmp_path / "modelopt-hf-quant-config-only"
    shutil.copytree(FIXTURES / "modelopt-qwen3-nvfp4", only_hf)
    config = json.loads((only_hf / "config.json").read_text())
    del config["quantization_config"]
    (only_hf / "config.json").write_text(json.dumps(config))
    return {**out, "modelopt-config-json-only": only_config, "modelopt-hf-quant-config-only": only_hf}


@pytest.mark.parametrize("form", [*QWEN_FP4, "modelopt-config-json-only", "modelopt-hf-quant-config-only"])
@pytest.mark.parametrize(("platform", "kernel"), [("cuda:9.0", "triton-fused-moe"), ("cpu", "torch-cpu-dot8")])
def test_fp4_explain_reports_exact_keys_and_emulation(form: str, platform: str, kernel: str, tmp_path: Path,
                                                      capsys) -> None:
    """The checkpoint's keys are reported exactly; W4A4 checkpoints run weight-only, and explain says so
    (W4A16 ones have nothing to say)."""
    model = _nvfp4_dirs(tmp_path)[form]
    name, weight_key, checkpoint_act = QWEN_FP4["modelopt-qwen3-nvfp4" if form.startswith("modelopt") else form]
    assert main(["explain", str(model), "--platform", platform, "--dtype", "bfloat16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    scheme = report["scheme"]
    assert scheme["name"] == name and scheme["weight_key"] == weight_key
    assert scheme["activation_key"] == "unquantized" and scheme["checkpoint_activation_key"] == checkpoint_act
    assert report["chosen_kernel"] == kernel
    assert main(["explain", str(model), "--platform", platform]) == 0
    text = capsys.readouterr().out
    if checkpoint_act is None:  # a W4A16 checkpoint: only a kernel that quantises the activations itself says so
        assert scheme["emulation"] is None
        if kernel == "torch-cpu-dot8":
            assert "torch-cpu-dot8 runs them as int8\n" in text
        else:
            assert "emulation" not in text
        return
    assert "16-bit activation dtype (weight-only emulation)" in scheme["emulation"]
    assert "tensor-core dot before Blackwell" in scheme["emulation"]
    assert "emulation   the checkpoint's activations are e2m1" in text


@pytest.fixture(scope="module")
def nvfp4_built() -> dict[str, object]:
    return {n: moe_registry.build(FIXTURES / n, platform="cpu", layer=0, dtype="float32", kernel="torch-reference")
            for n in QWEN_FP4}


@pytest.mark.parametrize("name", sorted(QWEN_FP4))
def test_fp4_weights_stay_packed(name: str, nvfp4_built) -> None:
    """The converted weights keep the checkpoint's e2m1 codes and scales (NVFP4: e4m3 group scales, a global
    scale per expert row); that they dequantise bit-exactly to the producer's own (ModelOpt's NVFP4QTensor,
    compressed-tensors' decompressors): tests/test_producers.py."""
    weights = nvfp4_built[name].weights
    assert str(weights.weight_key) == QWEN_FP4[name][1] and weights.w13.weight.dtype == torch.uint8
    if QWEN_FP4[name][1] == NVFP4_KEY:
        assert weights.w13.scale.dtype == torch.float8_e4m3fn and tuple(weights.w13.scale2.shape) == (E, 2 * INTER, 1)


def _routing(seed: int, m: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 over experts 0 and 1: the experts whose producer-dequantised weights are kept."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(2, generator=g) for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, 2, generator=g) + 0.1
    return ids, (w / w.sum(-1, keepdim=True)).float()


def test_triton_fp4_decoder_is_exact_for_every_code() -> None:
    """The in-register bit move (fp4_dequant) against the producers' table: all 16 e2m1 codes (ModelOpt's
    e2m1_values, transformers' FP4_VALUES)."""
    if triton is None:
        pytest.skip("triton is not installed")
    from moe_registry_kernels.fp4 import E2M1_VALUES

    e2m1 = torch.empty(16)
    _decode_e2m1_codes[(1,)](torch.arange(16, dtype=torch.uint8), e2m1)
    assert torch.equal(e2m1, torch.tensor(E2M1_VALUES)) and torch.equal(torch.signbit(e2m1)[8], torch.tensor(True))


# the types and fold factors the GEMMs decode NVFP4's scales in (launch._e2m1_fold: unscale 2^U over 2^8)
SCALE_CODE_TYPES = [(torch.bfloat16, 2.0 ** 118), (torch.float16, 2.0 ** 6), (torch.bfloat16, 1.0),
                    (torch.float16, 1.0), (torch.float32, 1.0)]


@pytest.mark.parametrize(("dtype", "times"), SCALE_CODE_TYPES, ids=lambda v: str(v).replace("torch.", ""))
def test_nvfp4_scale_codes_decode_to_every_positive_e4m3_value(dtype: torch.dtype, times: float) -> None:
    """NVFP4's scales as the GEMMs take them (fp4_dequant.e4m3_scale_codes, decoded by one integer
    multiply-add): every positive finite e4m3 value (126, subnormals too) times the type's fold factor,
    bit for bit torch's float8_e4m3fn value times it; the groups' padding code 0 reads a finite nonzero
    power of two."""
    if triton is None:
        pytest.skip("triton is not installed")
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    positive = every[every.float() > 0]
    assert positive.numel() == 126
    _, codes = e4m3_scale_codes(torch.zeros(1, 1, 8 * positive.numel(), dtype=torch.uint8), positive.view(1, 1, -1))
    codes = torch.cat([codes.view(-1), torch.zeros(256 - positive.numel(), dtype=torch.uint8)])
    out = torch.empty(256, dtype=dtype)
    tl_type = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    _decode_scale_codes[(1,)](codes, out, DT=tl_type, TIMES=times)
    want = (positive.float() * times).to(dtype)
    assert torch.equal(out[:positive.numel()], want)
    padding = out[positive.numel():].float()
    assert torch.isfinite(padding).all() and (padding > 0).all()


def test_nvfp4_zero_and_negative_scales_move_into_their_groups_codes() -> None:
    """A group whose e4m3 scale is zero has its codes zeroed, one whose scale is negative their signs
    flipped: each group's codes times its scale are unchanged (the scales' codes then stand for |scale|),
    and the codes handed in are left as they were. A NaN scale is refused by name."""
    if triton is None:
        pytest.skip("triton is not installed")
    from moe_registry_kernels.fp4 import E2M1_VALUES

    gen = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (2, 3, 24), dtype=torch.uint8, generator=gen)  # 48 columns, 3 groups
    scale = torch.tensor([[[1.5, -2.0, 0.0], [-0.0, 0.25, -448.0], [3.0, 2.0 ** -9, 1.0]],
                          [[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0], [1.0, 2.0, 4.0]]]).to(torch.float8_e4m3fn)
    given = packed.clone()
    codes, scale_codes = e4m3_scale_codes(packed, scale)
    assert torch.equal(packed, given)

    def weights(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(E2M1_VALUES)
        values = torch.stack([table[(p & 0xF).long()], table[(p >> 4).long()]], dim=-1).flatten(-2)
        return values * s.repeat_interleave(16, dim=-1)

    magnitude = torch.ldexp(1 + (scale_codes.int() & 7).float() / 8, (scale_codes.int() >> 3) - 10)
    assert torch.equal(magnitude[scale.float() != 0], scale.float().abs()[scale.float() != 0])
    assert torch.equal(weights(codes, magnitude), weights(given, scale.float()))
    assert not codes[1, 1].any() and torch.equal(codes[0, 2], given[0, 2])  # zeroed / untouched
    nan = scale.clone()
    nan.view(torch.uint8)[0, 0, 0] = 0x7F
    with pytest.raises(ValueError, match="NVFP4 group scales hold a NaN code"):
        e4m3_scale_codes(packed, nan)
    with pytest.raises(ValueError, match="take uint8 FP4 codes and float8_e4m3fn scales, got torch.uint8 and "
                                         "torch.float32"):
        e4m3_scale_codes(packed, scale.float())


SWAPPED = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
           "num_stages": 2, "SWAP_AB": True}
SPLIT = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "SPLIT_K": 2, "num_warps": 4, "num_stages": 2}


MASKED_K = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("key", [MXFP4_KEY, NVFP4_KEY])
def test_triton_experts_keep_fp4_codes_once_in_their_register_order(key: str) -> None:
    """The Triton experts hold the codes in the decoders' byte order and not the converted ones as well
    (a stand-in of their shape keeps the layer's shapes): the weights they were handed are left as they were."""
    pytest.importorskip("triton")
    from moe_registry_kernels.quant_ref import make_random_expert_weights
    from moe_registry_kernels.triton import experts as triton_experts

    from moe_registry.core.keys import parse_quant_key
    from moe_registry.layer.resident import reachable_tensors

    weights = make_random_expert_weights(parse_quant_key(key), parse_quant_key("unquantized"), num_experts=4,
                                         hidden=64, intermediate=32, dtype=torch.float16, seed=3)
    before = [p.weight.clone() for p in (weights.w13, weights.w2)]
    experts = triton_experts.TritonExperts(weights, ExpertsConfig())
    held = {t.untyped_storage().data_ptr() for t in reachable_tensors(experts)}
    for p, kept, want in zip((weights.w13, weights.w2), (experts.weights.w13, experts.weights.w2), before,
                             strict=True):
        assert torch.equal(p.weight, want)  # not mutated
        assert p.weight.untyped_storage().data_ptr() not in held
        assert kept.weight.shape == p.weight.shape and kept.weight.untyped_storage().nbytes() == 1
    codes = [experts._tensors[0], experts._tensors[6]]
    assert [c.data_ptr() in held for c in codes] == [True, True]
    for c, p in zip(codes, (weights.w13, weights.w2), strict=True):
        assert torch.equal(c, e2m1_register_order(p.weight))


@pytest.mark.parametrize("key", [MXFP4_KEY, NVFP4_KEY])
@pytest.mark.parametrize("config", ["swapped", "split-k", "swapped-split-k", "masked-k", "swapped-masked-k"])
def test_fp4_triton_swapped_and_split_k(key: str, config: str) -> None:
    """The swapped-operand kernel (the dequantised FP4 tile as the dot's register operand), split-K
    GEMM2 (the global scale applied to each piece) and K tiles past the end of K (hidden 96 in 64-wide
    tiles, as gpt-oss's 2880 in 128-wide ones: codes and scales masked) against the float64 reference."""
    pytest.importorskip("triton")
    from moe_registry_kernels.quant_ref import make_random_expert_weights
    from moe_registry_kernels.reference import reference_moe
    from moe_registry_kernels.triton import experts as triton_experts
    from moe_registry_kernels.triton import tile_config

    from moe_registry.core.keys import parse_quant_key

    hidden, inter = (96, 96) if config.endswith("masked-k") else (128, 64)
    weights = make_random_expert_weights(parse_quant_key(key), parse_quant_key("unquantized"), num_experts=4,
                                         hidden=hidden, intermediate=inter, dtype=torch.float16, bias=True, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, hidden, generator=gen).to(torch.float16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(7)]).to(torch.int32)
    w = torch.rand(7, 2, generator=gen) + 0.1
    gemm1 = {"swapped-masked-k": SWAPPED, "masked-k": MASKED_K}.get(config, SWAPPED if config.startswith("swapped")
                                                                     else None)
    gemm2 = {"swapped-split-k": {**SWAPPED, "SPLIT_K": 2}, "split-k": SPLIT, "masked-k": MASKED_K}.get(config, SWAPPED)
    with tile_config.config_override(gemm1, gemm2):
        got = triton_experts.TritonExperts(weights, ExpertsConfig(activation="swigluoai")).apply(x, w, ids)
    want = reference_moe(x, w, ids, weights, ExpertsConfig(activation="swigluoai"))
    assert _rel(got, want) <= 1e-2, f"{config}: {_rel(got, want):.2e}"


# ---------------------------------------------------------------- FP4 tiles whose scales carry the codes' unscale


def _with_scales(weights, rewrite):
    """The experts with their scale bytes rewritten (``rewrite`` of a uint8 view of a copy, in place),
    both projections."""
    import dataclasses

    def rewritten(p):
        scale = p.scale.clone()
        rewrite(scale.view(torch.uint8))
        return dataclasses.replace(p, scale=scale)

    return dataclasses.replace(weights, w13=rewritten(weights.w13), w2=rewritten(weights.w2))


def _scale_codes_set(codes: dict[tuple[int, int], int]):
    """A rewrite for _with_scales: some scale bytes set (expert 0, weight row r, group g -> code)."""
    def rewrite(raw: torch.Tensor) -> None:
        for (row, group), code in codes.items():
            raw[0, row, group] = code
    return rewrite


def _fp4_layer(key: str, codes: dict[tuple[int, int], int], m: int, config: str, fold: bool, rewrite=None):
    """(output, the fold arguments each GEMM took, the weights, the inputs) of a float16 FP4 layer with
    some scale codes set (and ``rewrite``, where given, applied to its scale bytes after); fold False:
    unfolded tiles."""
    from moe_registry_kernels.quant_ref import make_random_expert_weights
    from moe_registry_kernels.triton import experts as triton_experts
    from moe_registry_kernels.triton import launch as triton_launch
    from moe_registry_kernels.triton import tile_config

    from moe_registry.core.keys import parse_quant_key

    weights = _with_scales(make_random_expert_weights(
        parse_quant_key(key), parse_quant_key("unquantized"), num_experts=4, hidden=128, intermediate=64,
        dtype=torch.float16, bias=True, seed=8), _scale_codes_set(codes))
    if rewrite is not None:
        weights = _with_scales(weights, rewrite)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(m, 128, generator=gen).to(torch.float16)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, 2, generator=gen) + 0.1
    seen: list[dict] = []
    real = triton_launch._e2m1_fold

    def spy(proj, scheme, dtype):
        args = real(proj, scheme, dtype) if fold else {"E2M1_FOLDED": False, "E2M1_SHIFT": 0}
        seen.append(args)
        return args

    gemms = {"default": (None, None), "swapped": (SWAPPED, SWAPPED), "split-k": (MASKED_K, SPLIT)}[config]
    with pytest.MonkeyPatch.context() as mp, tile_config.config_override(*gemms):
        mp.setattr(triton_launch, "_e2m1_fold", spy)
        out = triton_experts.TritonExperts(weights, ExpertsConfig(activation="swigluoai")).apply(x, w, ids)
    return out, seen, weights, (x, w, ids)


# scale codes at the edges of what folding keeps exact, where the unfolded float16 tile is exact too:
# MX up to 2 (code 128) and down to 2^-24 (code 103); NVFP4 e4m3 448 (0x7E) and its smallest subnormal
EDGE_CODES = {MXFP4_KEY: {(0, 0): 128, (1, 1): 103, (2, 0): 127}, NVFP4_KEY: {(0, 0): 0x7E, (1, 1): 0x01}}


@pytest.mark.parametrize("key", [MXFP4_KEY, NVFP4_KEY], ids=["mxfp4", "nvfp4"])
@pytest.mark.parametrize("config", ["default", "swapped", "split-k"])
@pytest.mark.parametrize("m", [1, 7])
def test_fp4_tiles_with_the_unscale_in_their_scales_are_bit_equal(key: str, config: str, m: int) -> None:
    """One multiply a weight pair instead of two (fp4_dequant's module note): the layer's output is
    bit-equal with the unfolded tiles', scales at the edges of the folded range included."""
    pytest.importorskip("triton")
    folded, seen, _, _ = _fp4_layer(key, EDGE_CODES[key], m, config, fold=True)
    plain, _, _, _ = _fp4_layer(key, EDGE_CODES[key], m, config, fold=False)
    shift = 0 if key == MXFP4_KEY else 8
    assert seen and all(s == {"E2M1_FOLDED": True, "E2M1_SHIFT": shift} for s in seen), seen
    assert torch.equal(folded, plain)


@pytest.mark.parametrize("config", ["default", "swapped", "split-k"])
def test_nvfp4_negative_and_zero_scales_through_the_triton_layer(config: str) -> None:
    """Expert 0's e4m3 scales all negative, half of expert 1's weight rows with zero scales (their codes
    left as they were): the Triton layer, whose scales are exponent codes of |scale| with the signs and
    zeros moved into the groups' codes, against the float64 reference of the file's values. (A zero
    scale's code alone reads 2^-10, too small to show here: the test above checks those codes are zeroed.)"""
    pytest.importorskip("triton")
    from moe_registry_kernels.reference import reference_moe

    def signed(raw: torch.Tensor) -> None:
        raw[0] |= 0x80
        raw[1, ::2] = 0

    got, _, weights, (x, w, ids) = _fp4_layer(NVFP4_KEY, {}, 7, config, fold=True, rewrite=signed)
    assert {0, 1} <= set(ids.flatten().tolist())  # both experts are routed to
    want = reference_moe(x, w, ids, weights, ExpertsConfig(activation="swigluoai"))
    assert _rel(got, want) <= 1e-2, f"{config}: {_rel(got, want):.2e}"


@pytest.mark.parametrize("code", [129, 98])
def test_mx_scales_outside_the_folded_range_keep_two_multiplies(code: int) -> None:
    """An MX code above 128 (2 * 2^U overflows the 16-bit scale) or, in float16, below 99 (2^U times
    it is no normal float16): the tiles stay unfolded and the layer still matches the reference."""
    pytest.importorskip("triton")
    from moe_registry_kernels.reference import reference_moe

    out, seen, weights, (x, w, ids) = _fp4_layer(MXFP4_KEY, {(0, 0): code}, 7, "default", fold=True)
    assert seen and not any(s["E2M1_FOLDED"] for s in seen)
    want = reference_moe(x, w, ids, weights, ExpertsConfig(activation="swigluoai"))
    assert torch.isfinite(out).all() and _rel(out, want) <= 1e-2, f"{_rel(out, want):.2e}"


@pytest.mark.parametrize("dtype, codes, folded", [
    (torch.bfloat16, (0, 128), True), (torch.bfloat16, (0, 129), False), (torch.float16, (99, 128), True),
    (torch.float16, (98, 128), False), (torch.float16, None, False), (torch.float32, (100, 120), False)])
def test_mx_fold_needs_every_scale_code_in_range(dtype: torch.dtype, codes, folded: bool) -> None:
    """MX tiles fold only where the layer knows every scale code lies in range for its dtype; NVFP4
    tiles always (16-bit), leaving 2^8 to the result."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton import launch as triton_launch
    from moe_registry_kernels.triton import layout as triton_layout
    from moe_registry_kernels.triton import variant as triton_variant

    w = torch.zeros(1, 2, 16, dtype=torch.uint8)
    proj = triton_layout._Proj(w, None, None, None, None, None, 2, 32, scale_codes=codes)
    mx = triton_variant.variant_from_keys(MXFP4_KEY, "unquantized")
    nv = triton_variant.variant_from_keys(NVFP4_KEY, "unquantized")
    assert triton_launch._e2m1_fold(proj, mx, dtype) == {"E2M1_FOLDED": folded, "E2M1_SHIFT": 0}
    assert triton_launch._e2m1_fold(proj, nv, dtype) == {"E2M1_FOLDED": dtype != torch.float32,
                                                      "E2M1_SHIFT": 8 if dtype != torch.float32 else 0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_folded_mx_scales_are_built_from_the_codes_bits(dtype: torch.dtype) -> None:
    """_folded_e8m0: 2^(e - 127) * 2^U (U: 126 bfloat16, 14 float16) for every code the fold admits."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton import launch as triton_launch

    lowest, highest = triton_launch.E2M1_MX_FOLD_CODES[dtype]
    codes = torch.arange(lowest, highest + 1, dtype=torch.uint8)
    out = torch.empty(256, dtype=dtype)
    _folded_scales[(1,)](codes, out, codes.numel(), DT=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16)
    unscale = 126 if dtype == torch.bfloat16 else 14
    assert torch.equal(out[:codes.numel()].double(), torch.exp2(codes.double() - 127 + unscale))
    # the pad's code 0 (past a row's groups, where the codes are masked to 0) stays finite
    pad = torch.empty(256, dtype=dtype)
    _folded_scales[(1,)](torch.zeros(1, dtype=torch.uint8), pad, 1, DT=tl.bfloat16 if dtype == torch.bfloat16
                         else tl.float16)
    assert torch.isfinite(pad[0])


@pytest.mark.parametrize("scales", ["e8m0", "e4m3"])
def test_folded_fp4_tiles_are_the_code_table_times_the_scale(scales: str) -> None:
    """The folded tile (plain Triton; the GPU's PTX is held to it in test_triton_gpu) for every e2m1
    code times every scale the fold admits in float16 -- MX codes 99..128, every finite e4m3 byte -- is
    the table value times the scale rounded once, times 2^-8 for e4m3 (exact)."""
    pytest.importorskip("triton")
    from moe_registry_kernels.fp4 import e2m1_to_float

    if scales == "e8m0":
        scale, shift = torch.exp2(torch.arange(99, 129).double() - 127), 0
    else:
        scale = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        scale, shift = torch.cat([scale, -scale]), 8
    codes = torch.arange(256, dtype=torch.uint8)
    folded = (scale * 2.0 ** (14 - shift)).to(torch.float16)  # what _group_scales hands the tile
    assert torch.equal(folded.double(), scale * 2.0 ** (14 - shift))  # exact
    low = torch.empty(scale.numel(), 256, dtype=torch.float16)
    high = torch.empty_like(low)
    _dequant_folded[(1,)](e2m1_register_order(codes), folded, low, high, scale.numel())
    for nibbles, got in ((codes & 0xF, low), (codes >> 4, high)):
        want = (e2m1_to_float(nibbles).double()[None, :] * scale[:, None]).to(torch.float16)
        assert torch.equal(got.double() * 2.0 ** shift, want.double())


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", *sorted(QWEN_FP4)])
def test_producers_fp4_checkpoints_take_the_folded_tiles(name: str, mxfp4_built, nvfp4_built, mxfp4_ref,
                                                         monkeypatch) -> None:
    """What transformers' gpt-oss layout, llm-compressor and ModelOpt write folds in both 16-bit dtypes
    (its MX scale codes lie in range), and the folded layer gives the two-multiply layer's output exactly."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton import experts as triton_experts
    from moe_registry_kernels.triton import launch as triton_launch
    from moe_registry_kernels.triton import layer as triton_layer

    if name == "gpt-oss-mxfp4":
        weights, config = mxfp4_built.weights, ExpertsConfig(activation="swigluoai")
        x, (ids, w) = mxfp4_ref["hidden_states"], (mxfp4_ref["layer.topk_ids"], mxfp4_ref["layer.topk_weights"])
    else:
        weights, config = nvfp4_built[name].weights, ExpertsConfig()
        x, (ids, w) = load_file(str(FIXTURES / name / "ref.safetensors"))["hidden_states"], _routing(11)
    experts = triton_experts.TritonExperts(weights, config)
    p13, _ = triton_layer._projections(1, *experts._tensors, mx_scale_codes=experts._options.get("mx_scale_codes"))
    for dtype in (torch.float16, torch.bfloat16):
        assert triton_launch._e2m1_fold(p13, experts.variant, dtype)["E2M1_FOLDED"], (name, dtype)
    x, w = x.to(torch.float16), w.float()
    folded = experts.apply(x, w, ids)
    monkeypatch.setattr(triton_launch, "_e2m1_fold",
                        lambda proj, variant, dtype: {"E2M1_FOLDED": False, "E2M1_SHIFT": 0})
    assert torch.equal(folded, experts.apply(x, w, ids))


# ------------------------------------------------------------------------------------ bad input


def _broken(tmp_path: Path, src: Path, change: dict[str, torch.Tensor]) -> Path:
    dest = tmp_path / src.name
    shutil.copytree(src, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    tensors.update(change)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def test_mxfp4_nan_scale_code_is_refused(tmp_path: Path) -> None:
    scales = load_file(str(MXFP4 / "model.safetensors"))[PREFIX + "down_proj_scales"].clone()
    scales[2, 5, 1] = 255
    dest = _broken(tmp_path, MXFP4, {PREFIX + "down_proj_scales": scales})
    with pytest.raises(CheckpointError, match=r"down_proj_scales\[2\]: 1 of .* are 255, the E8M0 NaN encoding.*"
                                              r"expected exponents 0\.\.254"):
        moe_registry.build(dest, platform="cpu", layer=0)


def test_mxfp4_missing_stacked_tensor_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "gpt-oss-mxfp4"
    shutil.copytree(MXFP4, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    del tensors[PREFIX + "gate_up_proj_scales"]
    save_file(tensors, str(dest / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_up_proj_scales: missing \(scheme mxfp4 stores blocks, scales "
                                              r"stacked over experts\)"):
        moe_registry.build(dest, platform="cpu", layer=0)


def test_mxfp4_blocks_of_the_wrong_shape_are_refused(tmp_path: Path) -> None:
    blocks = load_file(str(MXFP4 / "model.safetensors"))[PREFIX + "gate_up_proj_blocks"]
    dest = _broken(tmp_path, MXFP4, {PREFIX + "gate_up_proj_blocks": blocks.reshape(E, 2 * INTER, H // 2)})
    with pytest.raises(CheckpointError, match=r"gate_up_proj_blocks: shape \[4, 128, 32\]; expected \[4, 128, 2, 16\]"):
        moe_registry.build(dest, platform="cpu", layer=0)


def test_nvfp4_nan_scale_code_is_refused(tmp_path: Path) -> None:
    src = FIXTURES / "modelopt-qwen3-nvfp4"
    scale = load_file(str(src / "model.safetensors"))[QWEN_PREFIX + "1.up_proj.weight_scale"].clone()
    scale.view(torch.uint8)[3, 2] = 0x7F
    dest = _broken(tmp_path, src, {QWEN_PREFIX + "1.up_proj.weight_scale": scale})
    with pytest.raises(CheckpointError, match=r"experts\.1\.up_proj\.weight_scale: 1 of 256 values are the fp8 "
                                              r"e4m3fn NaN encoding .*first at \[3, 2\] = 0x7f"):
        moe_registry.build(dest, platform="cpu", layer=0)


@pytest.mark.parametrize(("name", "tensor", "value", "seen"), [
    ("modelopt-qwen3-nvfp4", "weight_scale_2", 0.0, "global scale 0.0"),
    ("modelopt-qwen3-nvfp4", "weight_scale_2", -1.0, "global scale -1.0"),
    ("modelopt-qwen3-nvfp4", "weight_scale_2", float("nan"), "1 of 1 values are NaN or infinite"),
    ("ct-qwen3-nvfp4", "weight_global_scale", 0.0, "global scale 0.0"),
    ("ct-qwen3-nvfp4", "weight_global_scale", float("inf"), "1 of 1 values are NaN or infinite"),
])
def test_nvfp4_bad_global_scale_is_refused(tmp_path: Path, name: str, tensor: str, value: float, seen: str) -> None:
    src = FIXTURES / name
    full = f"{QWEN_PREFIX}2.down_proj.{tensor}"
    old = load_file(str(src / "model.safetensors"))[full]
    dest = _broken(tmp_path, src, {full: torch.full_like(old, value)})
    with pytest.raises(CheckpointError, match=rf"{full.replace('.', '[.]')}: {re.escape(seen)}.*expected"):
        moe_registry.build(dest, platform="cpu", layer=0)


def test_compressed_tensors_mxfp4_nan_scale_code_is_refused(tmp_path: Path) -> None:
    src = FIXTURES / "ct-qwen3-mxfp4a16"
    full = QWEN_PREFIX + "3.gate_proj.weight_scale"
    scale = load_file(str(src / "model.safetensors"))[full].clone()
    scale[7, 1] = 255
    dest = _broken(tmp_path, src, {full: scale})
    with pytest.raises(CheckpointError, match=rf"{re.escape(full)}: 1 of 128 values are 255, the E8M0 NaN encoding"):
        moe_registry.build(dest, platform="cpu", layer=0)
