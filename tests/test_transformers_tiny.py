"""Tiny random transformers models, as ``save_pretrained`` wrote them, run by our loader and kernels
and compared with transformers' own MoE block (tests/fixtures/transformers/tiny, written by
tools/make_transformers_tiny.py; versions in VERSIONS_tiny.json).

Each fixture keeps the first MoE layer's router and routed-expert tensors with their saved names
and layout (per expert, or fused 3-D for gpt-oss and Llama 4), and io.safetensors: hidden_states,
transformers' routed-experts output (shared experts zeroed) and its topk_ids/topk_weights.

Tolerances (relative error ‖out − transformers‖ / ‖transformers‖):

- torch reference, float32: 1e-5. Both sides compute in float32 from the same bfloat16-exact weights
  and differ only in summation order (measured ~1e-7); any misread layout (gate/up swapped or
  interleaved the wrong way, a transposed fused tensor, a missing bias) is O(1).
- Triton kernel under the interpreter, float16: 5e-3 (the unquantized scheme's float16 tolerance):
  the float16 inputs, GEMM outputs and activation are rounded to 2^-11 each (measured ~5e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moe_registry.builder import LayerBuild, MoELayer, build
from moe_registry.experts import ExpertsConfig

TINY = Path(__file__).parent / "fixtures" / "transformers" / "tiny"
FIXTURES = sorted(p.name for p in TINY.iterdir() if (p / "io.safetensors").is_file())
FP32_TOL = 1e-5
FP16_TOL = 5e-3
# Families whose routing needs a word the family-spec language does not have yet.
GAPS: dict[str, str] = {}  # model type -> why it cannot match yet (strict xfail); none left


def _io(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(TINY / name / "io.safetensors"))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _build(name: str, **kw: object) -> LayerBuild:
    kw = {"platform": "cpu", "dtype": "float32", "kernel": "torch-reference", **kw}
    return build(TINY / name, **kw)  # type: ignore[arg-type]


def _gap(name: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.xfail(reason=GAPS[name], strict=True)] if name in GAPS else []


CASES = [pytest.param(n, marks=_gap(n), id=n) for n in FIXTURES]


def test_fixtures_are_small_and_versioned() -> None:
    versions = json.loads((TINY.parent / "VERSIONS_tiny.json").read_text())
    assert versions["transformers"].startswith("5.")
    assert set(FIXTURES) <= set(versions["families"]) and len(FIXTURES) >= 6
    total = sum(f.stat().st_size for f in TINY.rglob("*") if f.is_file())
    assert total < 2 * 1024 * 1024, total


def test_fused_families_are_kept_fused_as_saved() -> None:
    """gpt-oss and Llama 4 are saved as 3-D tensors [E, H, 2I] and [E, I, H]; the fixture keeps them so."""
    for name, prefix in (("gpt_oss", "model.layers.0.mlp.experts"),
                         ("llama4_text", "model.layers.0.feed_forward.experts")):
        with safe_open(str(TINY / name / "model.safetensors"), framework="pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
        assert shapes[f"{prefix}.gate_up_proj"] == [8, 64, 32] and shapes[f"{prefix}.down_proj"] == [8, 16, 64]
        assert not any(".experts.0." in k for k in shapes)


@pytest.mark.parametrize("name", CASES)
def test_given_routing_matches_transformers(name: str) -> None:
    """transformers' own topk ids/weights through our loader and reference: the expert weights are read right."""
    io = _io(name)
    layer = _build(name)
    out = layer.kernel(io["hidden_states"], io["topk_weights"].float(), io["topk_ids"].int())
    assert _rel(out, io["output"]) < FP32_TOL


@pytest.mark.parametrize("name", CASES)
def test_own_routing_matches_transformers(name: str) -> None:
    """Our router (from the family spec) picks transformers' experts with its weights, and the layer matches."""
    io = _io(name)
    layer = _build(name)
    routing = MoELayer(layer).route(io["hidden_states"])
    ids, order = routing.topk_ids.long().sort(-1)
    want_ids, want_order = io["topk_ids"].long().sort(-1)
    assert torch.equal(ids, want_ids)
    weights = routing.topk_weights.gather(1, order)
    assert torch.allclose(weights, io["topk_weights"].float().gather(1, want_order), rtol=1e-5, atol=1e-6)
    assert _rel(MoELayer(layer)(io["hidden_states"]), io["output"]) < FP32_TOL


def test_llama4_fused_experts_read_right_with_weight_on_input() -> None:
    """Llama 4's concatenated [E, H, 2I] experts, with the router weight applied to the input as its
    modeling code does, match transformers (independently of the missing family routing word)."""
    from moe_registry_kernels.reference import reference_moe

    io = _io("llama4_text")
    layer = _build("llama4_text")
    config = ExpertsConfig(activation="silu", apply_router_weight_on_input=True)
    out = reference_moe(io["hidden_states"], io["topk_weights"].float(), io["topk_ids"].int(),
                        layer.weights, config, torch.float32)
    assert _rel(out, io["output"]) < FP32_TOL
    # the sigmoid top-1 routing of the family spec gives transformers' ids and weights
    routing = MoELayer(layer).route(io["hidden_states"])
    assert torch.equal(routing.topk_ids.long(), io["topk_ids"].long())
    assert torch.allclose(routing.topk_weights, io["topk_weights"].float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss", "granitemoe"])
def test_triton_interpreter_float16_matches_transformers(name: str) -> None:
    """The Triton kernel (interpreter, float16) on a per-expert family and two fused ones ([E, in, out]
    interleaved with biases and swigluoai; [E, out, in] concatenated)."""
    io = _io(name)
    layer = build(TINY / name, platform="cuda:9.0", dtype="float16", kernel="triton-fused-moe", device="cpu")
    assert type(layer.kernel.experts).__name__ == "TritonExperts"
    out = layer.kernel(io["hidden_states"].half(), io["topk_weights"].float(), io["topk_ids"].int())
    assert _rel(out.float(), io["output"]) < FP16_TOL


def test_gpt_oss_reads_interleaved_gate_up_and_biases() -> None:
    """w13 rows [0, I) are gate_up_proj's even columns, [I, 2I) its odd ones; biases follow."""
    layer = _build("gpt_oss")
    raw = load_file(str(TINY / "gpt_oss" / "model.safetensors"))
    gu = raw["model.layers.0.mlp.experts.gate_up_proj"].float()        # [E, H, 2I]
    w13 = layer.weights.w13.weight                                      # [E, 2I, H]
    assert torch.equal(w13[:, :16], gu[:, :, 0::2].transpose(1, 2))
    assert torch.equal(w13[:, 16:], gu[:, :, 1::2].transpose(1, 2))
    bias = raw["model.layers.0.mlp.experts.gate_up_proj_bias"].float()
    assert torch.equal(layer.weights.w13.bias, torch.cat((bias[:, 0::2], bias[:, 1::2]), 1))
    assert torch.equal(layer.weights.w2.weight, raw["model.layers.0.mlp.experts.down_proj"].float().transpose(1, 2))
    assert layer.tensors.router_bias is not None


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_run_command_on_tiny_model(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``moe-registry run <dir> --layer L --inputs io.safetensors`` loads the layer as transformers saved it."""
    from moe_registry.cli import main

    d = TINY / name
    code = main(["run", str(d), "--layer", "0", "--inputs", str(d / "io.safetensors"), "--platform", "cpu",
                 "--dtype", "float32", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code == 0 and body["result"]["ok"] and body["result"]["tokens"] == 16


def test_fused_layout_alternatives_read_both_producers(tmp_path: Path) -> None:
    """transformers 5 saves Qwen3-VL-MoE experts [E, out, in]; the Hub's Qwen releases store them
    [E, in, out] (transformers transposes on load). A family listing both layouts reads either; one
    listing only the first refuses the other with the shapes seen and wanted."""
    import shutil

    from safetensors.torch import save_file

    from moe_registry.errors import CheckpointError

    src = TINY / "qwen3_vl_moe"
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    tensors = load_file(str(hub / "model.safetensors"))
    prefix = "model.language_model.layers.0.mlp.experts"
    for t in ("gate_up_proj", "down_proj"):
        tensors[f"{prefix}.{t}"] = tensors[f"{prefix}.{t}"].transpose(1, 2).contiguous()
    save_file(tensors, str(hub / "model.safetensors"), metadata={"format": "pt"})
    io = _io("qwen3_vl_moe")
    for d in (src, hub):  # the shipped spec lists both layouts
        layer = build(d, platform="cpu", dtype="float32", kernel="torch-reference")
        out = layer.kernel(io["hidden_states"], io["topk_weights"].float(), io["topk_ids"].int())
        assert _rel(out, io["output"]) < FP32_TOL
    spec = tmp_path / "specs"
    spec.mkdir()
    family = (Path(__file__).parent.parent / "specs" / "models" / "qwen3-vl-moe.yaml").read_text()
    assert "layout: [[E, out, in], [E, in, out]]" in family
    (spec / "qwen3-vl-moe.yaml").write_text(family.replace("layout: [[E, out, in], [E, in, out]]",
                                                           "layout: [E, out, in]"))
    with pytest.raises(CheckpointError, match=r"gate_up_proj: shape \[8, 64, 32\]; expected \[8, 32, 64\]"):
        build(hub, platform="cpu", dtype="float32", kernel="torch-reference", spec_dirs=[spec])


def test_naming_both_ways_reads_per_expert_and_fused(tmp_path: Path) -> None:
    """A family naming experts both per expert and fused reads whichever the checkpoint holds:
    transformers 5.23 saves Qwen3.5-MoE per expert; the same weights stacked as 3-D tensors read the same."""
    import shutil

    from safetensors.torch import save_file

    spec = tmp_path / "specs"
    spec.mkdir()
    family = (Path(__file__).parent.parent / "specs" / "models" / "qwen3.5-moe.yaml").read_text()
    per_expert = "  expert: mlp.experts.{expert}\n  projections: {gate: gate_proj, up: up_proj, down: down_proj}\n"
    if "expert: mlp.experts.{expert}" not in family:
        family = family.replace("  fused:\n", per_expert + "  fused:\n")
    (spec / "qwen3.5-moe.yaml").write_text(family)
    src = TINY / "qwen3_5_moe"
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    t = load_file(str(src / "model.safetensors"))
    p = "model.language_model.layers.0.mlp.experts"
    stacked = {k: v for k, v in t.items() if ".experts." not in k}
    stacked[f"{p}.gate_up_proj"] = torch.stack(
        [torch.cat((t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"])) for e in range(8)])
    stacked[f"{p}.down_proj"] = torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    save_file(stacked, str(fused / "model.safetensors"), metadata={"format": "pt"})
    io = _io("qwen3_5_moe")
    for d in (src, fused):
        layer = build(d, platform="cpu", dtype="float32", kernel="torch-reference", spec_dirs=[spec])
        out = layer.kernel(io["hidden_states"], io["topk_weights"].float(), io["topk_ids"].int())
        assert _rel(out, io["output"]) < FP32_TOL, d.name
    assert layer.tensors.names.fused is not None


def test_fused_naming_words_are_validated() -> None:
    """The fused words refuse layouts that are not [E, in, out] / [E, out, in] and a naming with no experts."""
    from pydantic import ValidationError

    from moe_registry.spec_models import Naming

    fused = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
    one = Naming(router="mlp.gate", fused={**fused, "layout": ["E", "in", "out"]})
    assert one.fused is not None and one.fused.layouts == (("E", "in", "out"),)
    two = Naming(router="mlp.gate", fused={**fused, "layout": [["E", "out", "in"], ["E", "in", "out"]]})
    assert two.fused is not None and two.fused.layouts[1] == ("E", "in", "out")
    assert two.modules(3, [0]) == ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj")
    with pytest.raises(ValidationError, match=r"fused.layout \['E', 'in', 'in'\]: wanted"):
        Naming(router="mlp.gate", fused={**fused, "layout": ["E", "in", "in"]})
    with pytest.raises(ValidationError, match="gate_up_order"):
        Naming(router="mlp.gate", fused={**fused, "layout": ["E", "in", "out"], "gate_up_order": "zipped"})
    with pytest.raises(ValidationError, match="naming needs expert"):
        Naming(router="mlp.gate")
