"""What every producer's checkpoint must pass, written once over one table of the producers' own files
(tests/fixtures/<producer>/..., each made by its tools/make_fixtures_*.py with the producer itself; versions in each
VERSIONS.json): ``explain`` names the producer's scheme, its keys and the kernel the oracle picks, and our converted
weights, rounded to the producer's dtype, are the producer's own dequantisation bit for bit; for the weight-only
schemes, the built layer matches a float64 MoE on the producer's own weights; where the producer kept its own
quantized linears' outputs, the float64 linear on our weights with its activation quantisation reproduces them.

Each producer's module (tests/test_producers_<format>.py) keeps what only its format has: the float64 MoE done
the producer's way where it quantizes activations, the kernels' paths its codes take, and its bad input.

The producers' dequantisations in ref.safetensors, by name: ``experts.{e}.{role}.dequant`` (Quark, ModelOpt,
llm-compressor, transformers' FineGrainedFP8: the experts and rows each maker kept), or
``model.layers.0.mlp.experts.{e}.{role}_proj.weight`` (GPTQModel, AutoAWQ, AutoRound: every expert).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from activation_qdq import qdq
from safetensors.torch import load_file

import moe_registry
from moe_registry.cli.main import main

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ROLES = ("gate", "up", "down")
DEQUANT_NAME = re.compile(r"^(?:experts\.(?P<e>\d+)\.(?P<role>gate|up|down)\.dequant"
                          r"|model\.layers\.0\.mlp\.experts\.(?P<e2>\d+)\.(?P<proj>gate|up|down)_proj\.weight)$")


def checkpoint(fixture: str) -> Path:
    """The model dir of a fixture: ``<fixture>/checkpoint`` where the maker keeps ref.safetensors outside it."""
    inner = FIXTURES / fixture / "checkpoint"
    return inner if inner.is_dir() else FIXTURES / fixture


def producer_dequantisation(fixture: str) -> dict[tuple[int, str], torch.Tensor]:
    """The producer's own dequantised expert weights in ref.safetensors, by (expert, role)."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for name, tensor in load_file(str(FIXTURES / fixture / "ref.safetensors")).items():
        m = DEQUANT_NAME.match(name)
        if m:
            out[(int(m["e"] or m["e2"]), m["role"] or m["proj"])] = tensor
    return out


def our_weights(fixture: str, dtype: torch.dtype) -> dict[tuple[int, str], torch.Tensor]:
    """Our converted weights read back through the one definition of the layout, in ``dtype``, by (expert, role)."""
    from moe_registry_kernels.reference import dense_experts

    layer = moe_registry.build(checkpoint(fixture), platform="cpu", layer=0, dtype="float32",
                               kernel="torch-reference")
    dense = dense_experts(layer.weights, dtype)
    inter = layer.weights.intermediate_size
    return {**{(e, "gate"): w[:inter] for e, w in enumerate(dense.w13)},
            **{(e, "up"): w[inter:] for e, w in enumerate(dense.w13)},
            **{(e, "down"): w for e, w in enumerate(dense.w2)}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------- explain


@dataclass(frozen=True)
class Explained:
    """What ``explain --json`` must say of a fixture on a platform (None: not checked for this fixture)."""

    fixture: str
    platform: str
    scheme: str
    kernel: str | None
    weight_key: str | None = None
    activation_key: str | None = None
    dtype: str | None = None  # --dtype; None: explain's default
    num_experts: int | None = None


GPTQ4 = "uint4b8 scale:float16:group(32):static"
ZP4 = "uint4 scale:float16:group(32):static zp:group"
ZP8 = "uint8 scale:float16:group(32):static zp:group"
TRITON = "triton-fused-moe"
DOT8 = "torch-cpu-dot8"  # integer and FP4 weight-only layers at explain's default dtype (bfloat16) on a CPU


def _gptq(fixture: str, scheme: str, key: str, producer: str = "gptqmodel") -> Explained:
    return Explained(f"{producer}/{fixture}", "cuda:9.0", scheme, TRITON, key)


def _presets(fixture: str, scheme: str, key: str, cpu: str) -> list[Explained]:
    return [Explained(f"compressed_tensors_presets/{fixture}", platform, scheme, kernel, key, "unquantized")
            for platform, kernel in (("cuda:9.0", TRITON), ("cpu", cpu))]


EXPLAINED = [
    _gptq("qwen3-gptq-w4-sym", "gptq-w4a16", GPTQ4),
    _gptq("qwen3-gptq-w4-asym", "gptq-w4a16-asym", ZP4),
    _gptq("qwen3-gptq-w8-sym-actorder", "gptq-w8a16", "uint8b128 scale:float16:group(32):static"),
    _gptq("qwen3-gptq-w4-sym-v2", "gptq-v2-w4a16", GPTQ4),
    _gptq("qwen3-gptq-w4-asym-actorder-v2", "gptq-v2-w4a16-asym", ZP4),
    _gptq("qwen3-awq-w4-gemm", "awq-w4a16", ZP4, producer="autoawq"),
    _gptq("mixtral-gptq-w4-sym", "gptq-w4a16", GPTQ4),  # GPTQModel's own module names (naming.alternatives)
    _gptq("qwen3-gptq-w8-asym", "gptq-w8a16-asym", ZP8),
    _gptq("qwen3-gptq-w8-asym-v2", "gptq-v2-w8a16-asym", ZP8),
    _gptq("qwen3-autoround-w4-sym", "autoround-w4a16", GPTQ4, producer="autoround"),  # auto_round:auto_gptq
    _gptq("qwen3-autoround-w4-asym", "autoround-w4a16-asym", ZP4, producer="autoround"),
    *[Explained(f, "cuda:9.0", s, TRITON, dtype="float16", num_experts=4) for f, s in (
        ("quark/qwen3-w8a8-int8-channel", "quark-w8a8-int8"),
        ("quark/qwen3-w8a8-int8-tensor", "quark-w8a8-int8-tensor"),
        ("modelopt/qwen3-mxfp8", "modelopt-mxfp8"),
        ("compressed_tensors/qwen3-w8a8-int8", "compressed-tensors-w8a8-int8"),
        ("compressed_tensors/qwen3-w4a16", "compressed-tensors-w4a16"),
        ("compressed_tensors/qwen3-w4a8", "compressed-tensors-w4a8-int-quantized"))],
    *_presets("w4a16-g128", "compressed-tensors-w4a16", "uint4b8 scale:float16:group(128):static", DOT8),
    *_presets("w4a16-channel", "compressed-tensors-w4a16", "uint4b8 scale:float16:channel:static", DOT8),
    *_presets("w4a16-asym-g64-actorder-weight", "compressed-tensors-w4a16-asym",
              "uint4 scale:float16:group(64):static zp:group", DOT8),
    *_presets("w8a16-asym-g32", "compressed-tensors-w8a16-asym", ZP8, DOT8),
    *[Explained("fp4/gpt-oss-mxfp4", platform, "mxfp4", kernel, "e2m1 scale:e8m0:group(32):static", "unquantized",
                dtype="bfloat16") for platform, kernel in (("cuda:9.0", TRITON), ("cpu", DOT8))],
]


@pytest.mark.parametrize("case", EXPLAINED, ids=[f"{c.fixture}-{c.platform}" for c in EXPLAINED])
def test_explain_names_the_producers_scheme_keys_and_kernel(case: Explained, capsys) -> None:
    args = ["explain", str(checkpoint(case.fixture)), "--platform", case.platform, "--json"]
    assert main([*args, *(["--dtype", case.dtype] if case.dtype else [])]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheme"]["name"] == case.scheme
    if case.weight_key is not None:
        assert report["scheme"]["weight_key"] == case.weight_key
    if case.activation_key is not None:
        assert report["scheme"]["activation_key"] == case.activation_key
    if case.kernel is not None:
        assert report["chosen_kernel"] == case.kernel, report["chosen_kernel"]
    if case.num_experts is not None:
        assert report["runtime"]["shape"]["num_experts"] == case.num_experts


# ----------------------------------------------------------------------------------------- dequantisation


@dataclass(frozen=True)
class Dequantised:
    """A fixture whose ref.safetensors holds the producer's dequantisation: which experts and rows it kept, its
    dtype (the producer's own), and the dtype ours is computed in before rounding to it: float32 where the
    producer computes in float32 (ModelOpt's NVFP4 code x (scale x weight_scale_2) rounds as float32 does)."""

    fixture: str
    experts: int  # experts 0 .. experts-1 kept
    rows: int | None  # rows kept per projection; None: all
    dtype: torch.dtype
    ours: torch.dtype = torch.float64


DEQUANTISED = [
    *[Dequantised(f"gptqmodel/{n}", 4, None, torch.float16, torch.float32) for n in (
        "qwen3-gptq-w4-sym", "qwen3-gptq-w4-asym", "qwen3-gptq-w8-sym-actorder", "qwen3-gptq-w4-sym-v2",
        "qwen3-gptq-w4-asym-actorder-v2", "mixtral-gptq-w4-sym", "qwen3-gptq-w8-asym", "qwen3-gptq-w8-asym-v2")],
    Dequantised("autoawq/qwen3-awq-w4-gemm", 4, None, torch.float16, torch.float32),
    *[Dequantised(f"autoround/{n}", 4, None, torch.float16, torch.float32)
      for n in ("qwen3-autoround-w4-sym", "qwen3-autoround-w4-asym")],
    Dequantised("quark/qwen3-w8a8-int8-channel", 2, None, torch.bfloat16),
    Dequantised("quark/qwen3-w8a8-int8-tensor", 2, None, torch.bfloat16),
    Dequantised("modelopt/qwen3-mxfp8", 2, None, torch.bfloat16),
    *[Dequantised(f"compressed_tensors/{n}", 2, None, torch.bfloat16)
      for n in ("qwen3-w8a8-int8", "qwen3-w4a16", "qwen3-w4a8")],
    *[Dequantised(f"compressed_tensors_presets/{n}", 1, None, torch.bfloat16)
      for n in ("w4a16-g128", "w4a16-channel", "w4a16-asym-g64-actorder-weight", "w8a16-asym-g32")],
    *[Dequantised(f"fp8/{n}", 1, 16, torch.bfloat16) for n in ("llmc-fp8", "llmc-fp8-block", "llmc-fp8-dynamic")],
    Dequantised("fp8/modelopt-fp8", 1, 16, torch.float32),
    # transformers' FP8Experts: every expert's first four rows (stacked scales, gate's block rows first)
    *[Dequantised(f"fp8/{n}", 4, 4, torch.float32)
      for n in ("transformers-fp8-block", "transformers-fp8-block-ue8m0", "transformers-fp8-dynamic")],
    Dequantised("fp4/modelopt-qwen3-nvfp4", 2, None, torch.float32, torch.float32),
    *[Dequantised(f"fp4/{n}", 2, None, torch.bfloat16, torch.float32)
      for n in ("ct-qwen3-nvfp4", "ct-qwen3-nvfp4a16", "ct-qwen3-mxfp4", "ct-qwen3-mxfp4a16")],
]


@pytest.mark.parametrize("case", DEQUANTISED, ids=[c.fixture for c in DEQUANTISED])
def test_converted_weights_are_the_producers_dequantisation(case: Dequantised) -> None:
    """Bit for bit after rounding ours to the producer's dtype (both are code x scale with one rounding): a wrong
    expert's scale, gate and up swapped, a misread group, zero point or act-order would all differ."""
    theirs, ours = producer_dequantisation(case.fixture), our_weights(case.fixture, case.ours)
    assert sorted(theirs) == [(e, r) for e in range(case.experts) for r in sorted(ROLES)], sorted(theirs)
    for (e, role), want in sorted(theirs.items()):
        rows = case.rows or ours[(e, role)].shape[0]
        assert want.dtype == case.dtype and tuple(want.shape) == (rows, ours[(e, role)].shape[1]), (e, role)
        diff = ours[(e, role)][:rows].to(want.dtype).float() != want.float()
        assert not bool(diff.any()), f"{case.fixture} expert {e} {role}: {int(diff.sum())} of {diff.numel()} differ"


# ------------------------------------------------------------------------------- the layer, weight-only schemes


@dataclass(frozen=True)
class WeightOnly:
    """A weight-only fixture's layer on the torch reference, in ``dtype``, against the float64 MoE on the
    producer's own weights; ``tol`` None: the layer's tolerance (the producer's 16-bit rounding of code x scale
    is within it), a float: a tighter bound where the producer's dequantisation is float32 like ours."""

    fixture: str
    dtype: str
    tol: float | None = None
    triton: bool = True  # also the Triton kernel in the interpreter (the 8-bit GPTQ files: their tile tests)


WEIGHT_ONLY = [
    *[WeightOnly(f"gptqmodel/{n}", "float16") for n in (
        "qwen3-gptq-w4-sym", "qwen3-gptq-w4-asym", "qwen3-gptq-w4-sym-v2", "qwen3-gptq-w4-asym-actorder-v2",
        "mixtral-gptq-w4-sym")],
    *[WeightOnly(f"gptqmodel/{n}", "float16", triton=False)
      for n in ("qwen3-gptq-w8-sym-actorder", "qwen3-gptq-w8-asym", "qwen3-gptq-w8-asym-v2")],
    WeightOnly("autoawq/qwen3-awq-w4-gemm", "float16"),
    WeightOnly("autoround/qwen3-autoround-w4-sym", "float16", triton=False),
    WeightOnly("autoround/qwen3-autoround-w4-asym", "float16"),
    *[WeightOnly(f"compressed_tensors_presets/{n}", "float32")
      for n in ("w4a16-g128", "w4a16-channel", "w4a16-asym-g64-actorder-weight", "w8a16-asym-g32")],
    WeightOnly("fp4/modelopt-qwen3-nvfp4", "float32", 1e-4),  # ModelOpt's float32: float32 sums differ only
    *[WeightOnly(f"fp4/{n}", "float32")
      for n in ("ct-qwen3-nvfp4", "ct-qwen3-nvfp4a16", "ct-qwen3-mxfp4", "ct-qwen3-mxfp4a16")],
]
TRITON_WEIGHT_ONLY = [c for c in WEIGHT_ONLY if c.triton]


def silu_moe_float64(weights: dict[tuple[int, str], torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                     topk: torch.Tensor) -> torch.Tensor:
    """The SiLU-gated MoE (Qwen3-MoE's and Mixtral's experts, no bias) in float64 on ``weights[(e, role)]``."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e, h = int(ids[t, j]), x[t].double()
            act = torch.nn.functional.silu(weights[(e, "gate")].double() @ h) * (weights[(e, "up")].double() @ h)
            out[t] += float(topk[t, j]) * (weights[(e, "down")].double() @ act)
    return out


def routing_through(kept: list[int], experts: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing whose first expert of every token is one the producer's dequantisation was kept for."""
    g = torch.Generator().manual_seed(seed)
    first = torch.tensor(kept)[torch.randint(len(kept), (tokens,), generator=g)]
    second = (first + torch.randint(1, experts, (tokens,), generator=g)) % experts
    w = torch.rand(tokens, 2, generator=g) + 0.1
    return torch.stack([first, second], 1).to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


@pytest.mark.parametrize("case", WEIGHT_ONLY, ids=[c.fixture for c in WEIGHT_ONLY])
def test_reference_layer_matches_float64_moe_on_the_producers_weights(case: WeightOnly) -> None:
    """The built layer (torch reference) against the float64 MoE on the producer's own dequantised weights (ours
    for the experts whose dequantisation the fixture did not keep: equal to the producer's by the test above),
    every token routed through at least one of the producer's."""
    layer = moe_registry.build(checkpoint(case.fixture), platform="cpu", layer=0, dtype=case.dtype,
                               kernel="torch-reference")
    theirs = producer_dequantisation(case.fixture)
    weights = {**our_weights(case.fixture, torch.float64), **theirs}
    experts = 1 + max(e for e, _ in weights)
    ids, topk = routing_through(sorted({e for e, _ in theirs}), experts, 9, seed=6)
    x = torch.randn(9, layer.weights.hidden_size, generator=torch.Generator().manual_seed(5))
    x = x.to(getattr(torch, case.dtype))
    err = _rel(layer.kernel(x, topk, ids), silu_moe_float64(weights, x, ids, topk))
    assert 0 < err <= (case.tol or layer.tolerance), f"{case.fixture}: relative error {err:.2e}"



@pytest.mark.parametrize("case", TRITON_WEIGHT_ONLY, ids=[c.fixture for c in TRITON_WEIGHT_ONLY])
def test_triton_kernel_in_the_interpreter_matches_float64_moe_on_the_producers_weights(case: WeightOnly) -> None:
    """The Triton fused kernel (interpreter, float16 activations, its default tiles) on our conversion of the
    producer's file, within the scheme's float16 tolerance of the float64 MoE on the producer's own weights."""
    pytest.importorskip("triton")
    from moe_registry_kernels.triton.experts import TritonExperts

    from moe_registry.layer.experts import ExpertsConfig

    layer = moe_registry.build(checkpoint(case.fixture), platform="cpu", layer=0, dtype=case.dtype,
                               kernel="torch-reference")
    theirs = producer_dequantisation(case.fixture)
    weights = {**our_weights(case.fixture, torch.float64), **theirs}
    ids, topk = routing_through(sorted({e for e, _ in theirs}), 1 + max(e for e, _ in weights), 5, seed=8)
    x = torch.randn(5, layer.weights.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.float16)
    got = TritonExperts(layer.weights, ExpertsConfig()).apply(x, topk, ids)
    assert layer.report.scheme is not None
    tol = moe_registry.load_registry().scheme(layer.report.scheme.scheme).tolerance["float16"]
    err = _rel(got, silu_moe_float64(weights, x, ids, topk))
    assert got.dtype == torch.float16 and 0 < err <= tol, f"{case.fixture}: relative error {err:.2e} > {tol}"


# ------------------------------------------------------------------------- the producers' own linears


@dataclass(frozen=True)
class Linears:
    """A fixture whose ref.safetensors holds its producer's own quantized linears' outputs on fixed inputs
    (``experts.{e}.{role}.output`` for the first ``experts``), and how that linear quantises its 2-D input
    (``activation_qdq.qdq``'s names; None: weight-only)."""

    fixture: str
    linear_act: str | None
    experts: int


LINEARS = [
    Linears("fp8/llmc-fp8", "ct_static", 2),
    Linears("fp8/llmc-fp8-dynamic", "ct_whole", 2),
    Linears("fp8/llmc-fp8-block", "ct_group128", 2),
    Linears("fp8/modelopt-fp8", "modelopt_static", 2),
    Linears("quark/qwen3-w8a8-int8-channel", "int8_token_bf16_scale", 4),
    Linears("quark/qwen3-w8a8-int8-tensor", "int8_tensor", 4),
    Linears("modelopt/qwen3-mxfp8", "mxfp8", 4),
    Linears("compressed_tensors/qwen3-w8a8-int8", "int8_whole_bf16", 4),
    Linears("compressed_tensors/qwen3-w4a16", None, 4),
    Linears("compressed_tensors/qwen3-w4a8", "int8_whole_bf16", 4),
]


@pytest.mark.parametrize("case", LINEARS, ids=[c.fixture for c in LINEARS])
def test_producer_linears_reproduced_in_float64(case: Linears) -> None:
    """Each kept expert projection: the producer's own quantized linear on fixed inputs equals the float64 linear
    on our weights with its activation quantisation (its own static input scale where it has one), to its
    bfloat16 output rounding. This pins down how each producer quantises activations."""
    ref = load_file(str(FIXTURES / case.fixture / "ref.safetensors"))
    stored = {k: v for f in sorted(checkpoint(case.fixture).glob("*.safetensors"))
              for k, v in load_file(str(f)).items()}
    ours = our_weights(case.fixture, torch.float64)
    for e in range(case.experts):
        for role in ROLES:
            x = ref["intermediate_states" if role == "down" else "hidden_states"]
            scale = stored.get(f"model.layers.0.mlp.experts.{e}.{role}_proj.input_scale")
            got = qdq(case.linear_act, x, scale) @ ours[(e, role)].T
            want = ref[f"experts.{e}.{role}.output"]
            assert _rel(got, want) < 5e-3, f"{case.fixture} expert {e} {role}: {_rel(got, want):.2e}"


# ------------------------------------------------------------------------------------- the fixtures


FIXTURE_BYTES = {  # each producer's fixtures as committed, at most (block-128 fp8 needs 128 x 128 weights: ~230 kB)
    ("gptqmodel",): 1_500_000,
    ("autoawq",): 256 * 1024,
    ("autoround",): 512 * 1024,
    ("compressed_tensors_presets",): 1024 * 1024,
    ("fp4",): 1024 * 1024,
    ("fp8",): 1_750_000,
    ("quark", "modelopt", "compressed_tensors"): 1024 * 1024,
}


@pytest.mark.parametrize(("folders", "limit"), FIXTURE_BYTES.items(), ids=["+".join(f) for f in FIXTURE_BYTES])
def test_fixtures_stay_small(folders: tuple[str, ...], limit: int) -> None:
    total = sum(p.stat().st_size for sub in folders for p in (FIXTURES / sub).rglob("*") if p.is_file())
    assert 0 < total < limit, total
