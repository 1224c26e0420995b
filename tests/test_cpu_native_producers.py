"""The compiled CPU kernel (torch-cpu-native) on files the producers wrote, built as the oracle picks it on a CPU
(explain shows it chosen, the torch reference eligible after it), against a float64 MoE on the PRODUCER'S own
dequantisation (ref.safetensors), one token (register kernel) and more rows per expert than SMALL_M (exactly
dequantised tiles and a matmul):

- FP4 (tests/fixtures/fp4): transformers' gpt-oss MXFP4 (its reader's dequantised weights and its routing; the
  MLP written from modeling_gpt_oss), ModelOpt NVFP4 and llm-compressor NVFP4 / NVFP4A16 / MXFP4 / MXFP4A16
  (experts 0 and 1 dequantised by the producer);
- uint8 with zero points: GPTQModel's asymmetric 8-bit (v1 and v2 zero points; every expert dequantised by the
  library, float16) and llm-compressor's W8A16 asym preset (expert 0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_registry_kernels.cpu_native import SMALL_M
from safetensors.torch import load_file

import moe_registry
from moe_registry.cli.main import main

FIXTURES = Path(__file__).parent / "fixtures"
FP4 = FIXTURES / "fp4"
QWEN_FP4 = ["modelopt-qwen3-nvfp4", "ct-qwen3-nvfp4", "ct-qwen3-nvfp4a16", "ct-qwen3-mxfp4", "ct-qwen3-mxfp4a16"]
GPTQ8 = ["qwen3-gptq-w8-asym", "qwen3-gptq-w8-asym-v2"]
CT8 = FIXTURES / "compressed_tensors_presets" / "w8a16-asym-g32"
TOKENS = (1, SMALL_M + 4)
DIRS = {**{n: FP4 / n for n in [*QWEN_FP4, "gpt-oss-mxfp4"]},
        **{n: FIXTURES / "gptqmodel" / n / "checkpoint" for n in GPTQ8}, "ct-w8a16-asym-g32": CT8}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _build(path: Path):
    layer = moe_registry.build(path, platform="cpu", layer=0, dtype="float32")
    assert layer.report.chosen == "torch-cpu-native"
    return layer


def _swiglu_moe64(w: dict[tuple[int, str], torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                  topk: torch.Tensor) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) W_down^T per routed pair, float64, on weights [N, K] per (expert, role)."""
    x, out = x.double(), torch.zeros(x.shape[0], w[(int(ids[0, 0]), "down")].shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a = torch.nn.functional.silu(w[(e, "gate")] @ x[t]) * (w[(e, "up")] @ x[t])
            out[t] += float(topk[t, j]) * (w[(e, "down")] @ a)
    return out


def _routing(m: int, experts: list[int], top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pick = torch.tensor(experts)
    ids = torch.stack([pick[torch.randperm(len(experts), generator=g)[:top_k]] for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, top_k, generator=g) + 0.1
    return ids, (w / w.sum(-1, keepdim=True)).float()


def _hidden(m: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(m, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(DIRS))
def test_explain_on_cpu_chooses_native_with_the_reference_as_fallback(name: str, capsys) -> None:
    """In float32 (the integer-dot kernel's declared error exceeds the schemes' 1e-2 there: passed over)."""
    assert main(["explain", str(DIRS[name]), "--platform", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "kernel      torch-cpu-native" in out
    native, ref = (next(ln for ln in out.splitlines() if f"+ {k} " in ln)
                   for k in ("torch-cpu-native", "torch-reference"))
    assert "chosen" in native and "eligible" in ref and out.index(native) < out.index(ref)


@pytest.mark.parametrize("name", QWEN_FP4)
def test_fp4_matches_float64_moe_on_the_producers_dequantisation(name: str) -> None:
    """ModelOpt dequantises in float32 and compressed-tensors' MXFP4 in bfloat16, both our values exactly (powers of
    two times e2m1 fit bfloat16): float32 sums apart only; its NVFP4 bfloat16 weights are up to 2^-9 from ours:
    there the scheme's tolerance."""
    ref, layer = load_file(str(FP4 / name / "ref.safetensors")), _build(FP4 / name)
    theirs = {(e, r): ref[f"experts.{e}.{r}.dequant"].double() for e in (0, 1) for r in ("gate", "up", "down")}
    tol = layer.tolerance if name.startswith("ct-qwen3-nvfp4") else 1e-5
    for m in TOKENS:
        ids, w = _routing(m, [0, 1], 2, seed=m)
        x = ref["hidden_states"].float().repeat(-(-m // 8), 1)[:m] if m > 1 else ref["hidden_states"][:1].float()
        err = _rel(layer.kernel(x, w, ids), _swiglu_moe64(theirs, x, ids, w))
        assert err <= tol, f"{name} M={m}: {err:.2e} > {tol}"


def test_gpt_oss_mxfp4_matches_float64_moe_on_transformers_weights() -> None:
    """transformers' Mxfp4Config(dequantize=True) weights (bit-equal to ours) and its routing; modeling_gpt_oss's
    clamped swiglu with biases, written out here in float64."""
    ref = load_file(str(FP4 / "gpt-oss-mxfp4" / "ref.safetensors"))
    ckpt = load_file(str(FP4 / "gpt-oss-mxfp4" / "model.safetensors"))
    layer = _build(FP4 / "gpt-oss-mxfp4")
    prefix = "model.layers.0.mlp.experts."
    gate_up, down = ref["experts.gate_up_proj"].double(), ref["experts.down_proj"].double()  # [E, in, out]
    gu_b, down_b = ckpt[prefix + "gate_up_proj_bias"].double(), ckpt[prefix + "down_proj_bias"].double()
    x0, ids0, w0 = ref["hidden_states"].float(), ref["layer.topk_ids"], ref["layer.topk_weights"].float()
    for m in TOKENS:
        reps = -(-m // x0.shape[0])
        x, ids, w = (t.repeat(reps, 1)[:m] for t in (x0, ids0, w0))
        want = torch.zeros(m, x.shape[1], dtype=torch.float64)
        for t in range(m):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                gu = x[t].double() @ gate_up[e] + gu_b[e]
                gate, up = gu[::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
                want[t] += float(w[t, j]) * (((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ down[e] + down_b[e])
        err = _rel(layer.kernel(x, w, ids), want)
        assert err < 1e-5, f"M={m}: {err:.2e}"


@pytest.mark.parametrize("name", GPTQ8)
def test_gptq_asym_int8_matches_float64_moe_on_the_librarys_dequantisation(name: str) -> None:
    """GPTQModel's own dequantised weights of every expert (float16: scale * (q - zero), one rounding)."""
    ref = load_file(str(FIXTURES / "gptqmodel" / name / "ref.safetensors"))
    roles = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    theirs = {(e, r): ref[f"model.layers.0.mlp.experts.{e}.{p}.weight"].double() for e in range(4)
              for r, p in roles.items()}
    layer = _build(DIRS[name])
    for m in TOKENS:
        ids, w = _routing(m, [0, 1, 2, 3], 2, seed=m)
        x = _hidden(m, 64, seed=m + 1)
        err = _rel(layer.kernel(x, w, ids), _swiglu_moe64(theirs, x, ids, w))
        # the library's float16 rounding of each weight (2^-11) alone: 4.3e-4 measured; a zero point off by
        # one gives 2.1e-2
        assert 0 < err <= 2e-3, f"{name} M={m}: {err:.2e} > 2e-3"


def test_compressed_tensors_asym_int8_matches_float64_moe_on_the_producers_expert() -> None:
    """llm-compressor's W8A16 asym preset: its dequantisation of expert 0 (bfloat16), every token routed there."""
    ref = load_file(str(CT8 / "ref.safetensors"))
    theirs = {(0, r): ref[f"experts.0.{r}.dequant"].double() for r in ("gate", "up", "down")}
    layer = _build(CT8)
    for m in TOKENS:
        ids, w = torch.zeros(m, 1, dtype=torch.int32), torch.ones(m, 1)
        x = _hidden(m, 128, seed=m + 2)
        err = _rel(layer.kernel(x, w, ids), _swiglu_moe64(theirs, x, ids, w))
        # the producer's bfloat16 rounding of each weight (2^-8) alone: 3.6e-3 measured
        assert err <= 8e-3, f"M={m}: {err:.2e} > 8e-3"
