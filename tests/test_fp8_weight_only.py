"""FP8 checkpoints before sm_89 (``--platform cuda:8.0``): the Triton kernel's key patterns declare them
weight-only (an ``emulation`` to unquantized activations), explain and run say so, the build hands the kernel
16-bit activations, and the kernel decodes the fp8 codes with integer operations, which compile for sm_80.
On sm_89+ nothing of this applies: the fp8 dots run the checkpoint's activations.

The checkpoints are the producers' own (tests/fixtures/fp8): block-128 (llm-compressor), per-channel weights
with per-token activations (llm-compressor), per-tensor static (ModelOpt) and per-tensor dynamic
(transformers' FineGrainedFP8).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.build import build
from moe_registry.oracle.verdicts import DowngradeKind

triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402
from moe_registry_kernels.triton.dequant_ptx import _e4m3_value  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "fp8"
ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = {  # fixture -> the scheme explain names
    "llmc-fp8-block": "compressed-tensors-w8a8-fp8-block",
    "llmc-fp8-dynamic": "compressed-tensors-w8a8-fp8-dynamic",
    "modelopt-fp8": "modelopt-fp8",
    "transformers-fp8-dynamic": "fp8-w8a8-dynamic",
}
WHY = "no fp8 tensor-core dot before sm_89"


# hidden states ~ N(0, 0.1^2): the static checkpoints' input scales were calibrated on states of about this size
# (GEMM1's fp8 range about +-4, GEMM2's +-0.3); unit-normal states saturate the W8A8 reference's codes (10-13%
# from it, where the weight-only layer is 4% from it here)
HIDDEN_STD = 0.1


def _inputs(hidden: int, experts: int, dtype: torch.dtype, tokens: int = 5):
    g = torch.Generator().manual_seed(0)
    x = (HIDDEN_STD * torch.randn(tokens, hidden, generator=g)).to(dtype)
    topk_weights, topk_ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g), -1), 2, dim=-1)
    return x, topk_weights, topk_ids.to(torch.int32)


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


@triton.jit
def _decode_all(codes_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, _e4m3_value(tl.load(codes_ptr + offs)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter run (GPU: the gpu tests)")
def test_e4m3_codes_decode_exactly_without_an_fp8_type():
    """Every finite e4m3 code, subnormals and both zeros included, decodes to torch's float8_e4m3fn value."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    _decode_all[(1,)](codes, out)
    finite = (codes & 0x7F) != 0x7F  # the NaN codes
    want = codes.view(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(out[finite], want[finite])
    assert torch.equal(out[finite].view(torch.int32), want[finite].view(torch.int32))  # -0.0 kept


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_explain_on_sm80_runs_fp8_weight_only_on_triton_and_says_so(name):
    from moe_registry.oracle.select import select
    from moe_registry.situation.config import read_model_config
    from moe_registry.situation.describe import Flags, situation_for_model
    from moe_registry.spec.loader import load_registry

    registry = load_registry()
    model = read_model_config(FIXTURES / name, registry)

    def report(platform: str):
        return select(registry, situation_for_model(model, registry, Flags(platform=platform)))

    ampere, hopper = report("cuda:8.0"), report("cuda:9.0")
    assert ampere.scheme.scheme == hopper.scheme.scheme == CHECKPOINTS[name]
    assert ampere.chosen == hopper.chosen == "triton-fused-moe"
    [note] = ampere.downgrades  # the activation note, and no slow-path note
    assert note.kind is DowngradeKind.ACTIVATION and note.runs == "unquantized" and WHY in note.why
    assert note.asked == str(ampere.scheme.activation_key) and ampere.scheme.activation_key.quantized
    assert ampere.run_activation_key == parse_quant_key("unquantized")
    # sm_89+: the fp8 dot runs the checkpoint's activations, no note
    assert hopper.downgrades == () and hopper.kernel_activation_key is None
    assert hopper.run_activation_key == hopper.scheme.activation_key


def test_explain_and_its_json_name_the_weight_only_run_on_sm80():
    fixture = str(FIXTURES / "llmc-fp8-block")
    env = {k: v for k, v in os.environ.items()}
    text = subprocess.run([sys.executable, "-m", "moe_registry", "explain", fixture, "--platform", "cuda:8.0"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "emulation" in text.stdout and "weight-only" in text.stdout and "slow path" not in text.stdout
    data = json.loads(subprocess.run([sys.executable, "-m", "moe_registry", "explain", fixture, "--platform",
                                      "cuda:8.0", "--json"], capture_output=True, text=True, env=env,
                                     timeout=120).stdout)
    assert [(d["kind"], d["runs"]) for d in data["downgrades"]] == [("activation", "unquantized")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run (GPU: the gpu tests)")
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_a_built_sm80_layer_is_weight_only_and_within_the_schemes_tolerance(name):
    """The build hands the kernel 16-bit activations (no input scale kept): its output is held to the
    float64 reference of those weights, and, at the scheme's tolerance, to the reference that quantises the
    activations as the checkpoint declares (what sm_89+ runs)."""
    layer = build(FIXTURES / name, platform="cuda:8.0", dtype="float16", device="cpu", keep_weights=True)
    weights = layer.weights
    assert layer.report.chosen == "triton-fused-moe" and not weights.activation_key.quantized
    assert weights.w13.input_scale is None and weights.w2.input_scale is None
    x, topk_weights, topk_ids = _inputs(weights.hidden_size, weights.num_experts, torch.float16)
    out = layer.kernel(x, topk_weights, topk_ids)
    from moe_registry_kernels.reference import reference_moe

    weight_only = reference_moe(x, topk_weights, topk_ids, weights, layer.kernel.experts.config, torch.float64)
    assert _relative(out, weight_only) < 1e-2
    w8a8 = build(FIXTURES / name, platform="cuda:9.0", dtype="float16", kernel="torch-reference", device="cpu",
                 keep_weights=True)
    assert w8a8.weights.activation_key == layer.report.scheme.activation_key
    asked = reference_moe(x, topk_weights, topk_ids, w8a8.weights, w8a8.kernel.experts.config, torch.float64)
    assert _relative(out, asked) < layer.tolerance


def test_the_triton_kernel_takes_fp8_weights_with_16_bit_activations_and_refuses_other_mixes():
    from moe_registry_kernels.triton.variant import variant_from_keys

    for scale in ("block(128x128)", "channel", "tensor"):
        variant = variant_from_keys(f"fp8e4m3 scale:float32:{scale}:static", "unquantized")
        assert (variant.weight_type, variant.act_quant, variant.dot) == ("fp8e4m3", "none", "float")
    with pytest.raises(ValueError, match="per-token/per-tensor fp8 activations need fp8 weights with per-channel"):
        variant_from_keys("fp8e4m3 scale:float32:block(128x128):static", "fp8e4m3 scale:float32:token:dynamic")


def test_weight_only_fp8_codes_reach_the_gemms_as_their_bytes():
    """Below sm_89 Triton refuses any fp8 type: the weight-only GEMMs read the codes as uint8, the same storage,
    and unpack gives the fp8 tensor back; the fp8 dots (sm_89+) keep reading fp8."""
    from moe_registry_kernels.quant_ref import make_random_expert_weights
    from moe_registry_kernels.triton.layout import TritonWeightLayout
    from moe_registry_kernels.triton.variant import variant_from_keys

    wkey = "fp8e4m3 scale:float32:block(128x128):static"
    weights = make_random_expert_weights(parse_quant_key(wkey), parse_quant_key("unquantized"), num_experts=2,
                                         hidden=128, intermediate=128)
    held = TritonWeightLayout(variant_from_keys(wkey, "unquantized")).pack(weights.w13)
    assert held[0].dtype == torch.uint8
    assert held[0].untyped_storage().data_ptr() == weights.w13.weight.untyped_storage().data_ptr()
    back = TritonWeightLayout(variant_from_keys(wkey, "unquantized")).unpack(held)
    assert back.weight.dtype == torch.float8_e4m3fn and torch.equal(back.weight.view(torch.uint8),
                                                                    weights.w13.weight.view(torch.uint8))
    fp8_dot = TritonWeightLayout(variant_from_keys(wkey, "fp8e4m3 scale:float32:group(128):dynamic"))
    assert fp8_dot.pack(weights.w13)[0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("scheme", ["fp8-block128", "compressed-tensors-w8a8-fp8-dynamic", "fp8-w8a8-static",
                                    "modelopt-mxfp8"])
def test_fp8_schemes_gemms_compile_for_sm80(scheme):
    """What sm_80 launches (the spec's weight-only keys, no dependent launch, no sm_90 paired bfloat16 PTX)
    compiles with ptxas for sm_80, its dot on 16-bit operands (HMMA), at decode and prefill."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for m in ("8", "512"):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_sass.py"), "--scheme", scheme,
                               "--shape", "qwen3", "--m", m, "--arch", "80", "--json"],
                              capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        results = json.loads(done.stdout)
        assert len(results) == 2 and all("HMMA" in r["loop_opcodes"] for r in results), results


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_fp8_weight_only_on_a_gpu_as_cuda_8_0(name, dtype):
    """On a GPU, the layer built for cuda:8.0 runs the weight-only code (whatever the GPU): held to the float64
    reference of its weights, and to the checkpoint's W8A8 reference at the scheme's tolerance."""
    from moe_registry_kernels.reference import reference_moe

    layer = build(FIXTURES / name, platform="cuda:8.0", dtype=dtype, device="cuda", keep_weights=True)
    assert not layer.weights.activation_key.quantized
    torch_dtype = getattr(torch, dtype)
    x, topk_weights, topk_ids = (t.cuda() for t in _inputs(layer.weights.hidden_size, layer.weights.num_experts,
                                                              torch_dtype, tokens=33))
    out = layer.kernel(x, topk_weights, topk_ids)
    weights = layer.weights.to(torch.device("cuda"))
    ref = reference_moe(x, topk_weights, topk_ids, weights, layer.kernel.experts.config, torch.float64)
    assert _relative(out, ref) < 1e-2
    w8a8 = build(FIXTURES / name, platform="cuda:9.0", dtype=dtype, kernel="torch-reference", device="cuda",
                 keep_weights=True)
    asked = reference_moe(x, topk_weights, topk_ids, w8a8.weights.to(torch.device("cuda")),
                          w8a8.kernel.experts.config, torch.float64)
    assert _relative(out, asked) < layer.tolerance


def test_mx_fp8_in_float16_folds_through_the_pair_convert_only_where_the_gpu_has_it(monkeypatch):
    """MXFP8's float16 PTX form converts e4m3 pairs in hardware (sm_89+): before it the codes take the
    integer decode; the bfloat16 form is integer operations and folds wherever the PTX runs."""
    from types import SimpleNamespace

    from moe_registry_kernels.triton import dequant_ptx, launch
    from moe_registry_kernels.triton.variant import variant_from_keys

    assert not dequant_ptx.fp8_pair_convert_on((8, 6)) and dequant_ptx.fp8_pair_convert_on((8, 9))
    variant = variant_from_keys("fp8e4m3 scale:e8m0:block(1x32):static", "unquantized")
    w, gpu = SimpleNamespace(scale_codes=[120, 130]), torch.device("cuda")
    monkeypatch.setattr(launch, "fp8_pair_convert", lambda device: True)
    assert launch._e4m3_folded(w, variant, torch.float16, True, gpu)
    monkeypatch.setattr(launch, "fp8_pair_convert", lambda device: False)
    assert not launch._e4m3_folded(w, variant, torch.float16, True, gpu)
    assert launch._e4m3_folded(w, variant, torch.bfloat16, True, gpu)


def test_the_benchmark_runs_fp8_schemes_as_the_kernel_spec_runs_them_on_a_platform():
    """tools/bench.py --platform cuda:8.0 times the weight-only keys (16-bit dot, its roofline); without it, the
    bound ones."""
    import bench

    ampere, bound = bench.registry_schemes(platform="cuda:8.0"), bench.registry_schemes()
    for name in ("fp8-block128", "modelopt-fp8", "compressed-tensors-w8a8-fp8-dynamic"):
        assert (ampere[name].activation, ampere[name].unit) == ("unquantized", "bf16")
        assert ampere[name].weight == bound[name].weight and bound[name].unit == "fp8"
    assert ampere["gptq-w4a16"] == bound["gptq-w4a16"]


def test_a_kernel_is_handed_unquantized_activations_only_where_its_pattern_runs_them_weight_only():
    """The build's and conformance's one rule: an emulation to 16-bit activations hands the kernel those; an
    emulation that quantises (torch-cpu-dot8's int8 per 32 columns) hands it the scheme's, which it quantises."""
    from moe_registry.oracle.handed import handed_activation
    from moe_registry.oracle.predicates import matching_pattern
    from moe_registry.situation.runtime import parse_platform
    from moe_registry.spec.loader import load_registry

    registry = load_registry()
    fp8 = parse_quant_key("fp8e4m3 scale:float32:block(128x128):static")
    group = parse_quant_key("fp8e4m3 scale:float32:group(128):dynamic")
    triton_kernel = registry.kernel("triton-fused-moe")
    for platform, handed in (("cuda:8.0", parse_quant_key("unquantized")), ("cuda:8.6", parse_quant_key("unquantized")),
                             ("cuda:8.9", group), ("cuda:9.0", group)):
        pattern = matching_pattern(triton_kernel, fp8, group, parse_platform(platform))
        assert handed_activation(group, pattern) == handed, platform
    int4 = parse_quant_key("uint4b8 scale:float16:group(128):static")
    unquantized = parse_quant_key("unquantized")
    dot8 = matching_pattern(registry.kernel("torch-cpu-dot8"), int4, unquantized, parse_platform("cpu"))
    assert dot8 is not None and dot8.emulation is not None
    assert handed_activation(unquantized, dot8) == unquantized
