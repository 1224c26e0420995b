"""Tiny random transformers models, as ``save_pretrained`` wrote them, run by our loader and kernels
and compared with transformers' own MoE block (tests/fixtures/transformers/tiny, written by
tools/make_transformers_tiny.py; versions in VERSIONS_tiny.json).

Each fixture keeps the first MoE layer's router and routed-expert tensors with their saved names
and layout (per expert, fused 3-D for gpt-oss, Llama 4 and others, 2-D stacked for DBRX), and io.safetensors:
hidden_states, transformers' routed-experts output (shared experts and JetMoE's output bias zeroed) and its
topk_ids/topk_weights (times any factor the block applies after its experts, Step-3.7's).

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

from moe_registry.layer.build import LayerBuild, build
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.moe_layer import MoELayer

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
    assert total < 2.5 * 1024 * 1024, total  # 30 families of ~65 KB


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
def test_run_command_on_tiny_model(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``moe-registry run <dir> --layer L --inputs FILE`` loads the layer as transformers saved it and, on
    transformers' hidden states and routing, writes transformers' routed-experts output."""
    from safetensors.torch import save_file

    from moe_registry.cli.main import main

    io = _io(name)
    inputs, out = tmp_path / "inputs.safetensors", tmp_path / "out.safetensors"
    save_file({k: io[k].contiguous() for k in ("hidden_states", "topk_ids", "topk_weights")}, str(inputs))
    code = main(["run", str(TINY / name), "--layer", "0", "--inputs", str(inputs), "--platform", "cpu",
                 "--dtype", "float32", "--kernel", "torch-reference", "--save-output", str(out), "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code == 0 and body["result"]["ok"] and body["result"]["tokens"] == 16
    assert _rel(load_file(str(out))["output"], io["output"]) < FP32_TOL


def test_fused_layout_alternatives_read_both_producers(tmp_path: Path) -> None:
    """transformers 5 saves Qwen3-VL-MoE experts [E, out, in]; the Hub's Qwen releases store them
    [E, in, out] (transformers transposes on load). A family listing both layouts reads either; one
    listing only the first refuses the other with the shapes seen and wanted."""
    import shutil

    from safetensors.torch import save_file

    from moe_registry.core.errors import CheckpointError

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

    from moe_registry.spec.models import Naming

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


def test_dbrx_reads_2d_stacked_experts() -> None:
    """DBRX saves w1/v1/w2 as [E*I, H]: expert e is rows [e*I, (e+1)*I); w1 (gate) and v1 (up) are
    F.linear weights, w2 is read as x @ w2[e] (naming.fused layout [E*out, in], down_layout [E*in, out])."""
    layer = _build("dbrx")
    raw = load_file(str(TINY / "dbrx" / "model.safetensors"))
    mlp = "transformer.blocks.0.ffn.experts.mlp"
    w1, v1, w2 = (raw[f"{mlp}.{t}"].float().view(8, 16, 64) for t in ("w1", "v1", "w2"))
    assert torch.equal(layer.weights.w13.weight, torch.cat((w1, v1), 1))
    assert torch.equal(layer.weights.w2.weight, w2.transpose(1, 2))
    assert layer.model.routing["renormalize"] == 1  # moe_normalize_expert_weights: the 1-norm


def test_step_reads_separate_3d_gate_and_up() -> None:
    """Step-3.7 (the Step-3.5 decoder) is saved as moe.gate_proj/up_proj [E, I, H] and down_proj [E, H, I]
    (no gate_up tensor), router moe.gate and correction bias moe.router_bias."""
    layer = _build("step3p7")
    raw = load_file(str(TINY / "step3p7" / "model.safetensors"))
    moe = "model.layers.1.moe"
    gate, up = raw[f"{moe}.gate_proj.weight"].float(), raw[f"{moe}.up_proj.weight"].float()
    assert torch.equal(layer.weights.w13.weight, torch.cat((gate, up), 1))
    assert torch.equal(layer.weights.w2.weight, raw[f"{moe}.down_proj.weight"].float())
    assert layer.tensors.correction_bias is not None


def test_gpt_oss_swiglu_limit_other_than_the_kernels_is_refused(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """transformers clamps gpt-oss's swiglu at config.swiglu_limit; the kernels here at 7. Another limit is
    reported not run (explain) and refused by run, one line naming the field, the value seen and wanted."""
    import shutil

    from moe_registry.cli.main import main
    from moe_registry.situation.config import read_model_config
    from moe_registry.spec.loader import load_registry

    d = tmp_path / "gpt_oss"
    shutil.copytree(TINY / "gpt_oss", d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["swiglu_limit"] == 7.0
    registry = load_registry()
    assert read_model_config(d, registry).not_runnable == ()
    del cfg["swiglu_limit"]  # absent: transformers' default, 7.0
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_model_config(d, registry).not_runnable == ()
    (d / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": 10.0}))
    reasons = read_model_config(d, registry).not_runnable
    assert len(reasons) == 1 and reasons[0].startswith("swiglu_limit = 10.0; wanted 7.0"), reasons
    code = main(["run", str(d), "--layer", "0", "--platform", "cpu", "--dtype", "float32"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and "swiglu_limit = 10.0; wanted 7.0" in err, err


def test_stacked_naming_words_are_validated() -> None:
    """gate/up apart or gate_up, never both or half; 2-D stacked layouts and down_layout are checked."""
    from pydantic import ValidationError

    from moe_registry.spec.models import Naming

    apart = {"gate": "w1", "up": "v1", "down": "w2"}
    n = Naming(router="r", fused={**apart, "layout": ["E*out", "in"], "down_layout": ["E*in", "out"]})
    assert n.fused is not None and n.fused.gate_up_names == ("w1", "v1")
    assert n.modules(0, [0]) == ("model.layers.0.w1", "model.layers.0.v1", "model.layers.0.w2")
    with pytest.raises(ValidationError, match="fused needs gate_up"):
        Naming(router="r", fused={**apart, "gate_up": "gu", "layout": ["E", "out", "in"]})
    with pytest.raises(ValidationError, match="fused needs gate_up"):
        Naming(router="r", fused={"gate": "w1", "down": "w2", "layout": ["E", "out", "in"]})
    with pytest.raises(ValidationError, match=r"fused.down_layout \['in', 'E\*out'\]: wanted"):
        Naming(router="r", fused={**apart, "layout": ["E*out", "in"], "down_layout": ["in", "E*out"]})
    with pytest.raises(ValidationError, match="gate_up_bias needs fused.gate_up"):
        Naming(router="r", fused={**apart, "layout": ["E", "out", "in"], "gate_up_bias": "b"})
