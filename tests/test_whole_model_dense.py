"""A quantized non-expert linear dequantised once (moe_registry/whole/dense_linear.py) reads every producer's
format as the experts' own conversion does: one expert's down projection of each producer fixture, given as a
plain linear's tensors (suffix -> tensor), dequantises to exactly the float weight the layer's converted experts
dequantise to. A misnamed tensor or a wrong role would raise or differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_registry_kernels.cpu_dot8 import Dot8Linear
from moe_registry_kernels.dequant import dequantize

from moe_registry.checkpoint.tensor_index import open_checkpoint
from moe_registry.core.errors import CheckpointError
from moe_registry.layer.build import build
from moe_registry.spec.loader import load_registry
from moe_registry.whole.dense_linear import convert_linear, dequantize_linear

FIXTURES = Path(__file__).parent / "fixtures"
# one producer fixture per checkpoint format (per-expert tensors)
CASES = ["compressed_tensors/qwen3-w4a16", "compressed_tensors/qwen3-w8a8-int8",
         "compressed_tensors_presets/w4a16-asym-g64-actorder-weight", "fp4/ct-qwen3-nvfp4", "fp4/ct-qwen3-mxfp4",
         "fp4/modelopt-qwen3-nvfp4", "fp8/llmc-fp8-block", "fp8/modelopt-fp8", "modelopt/qwen3-mxfp8",
         "quark/qwen3-w8a8-int8-channel"]


def _down_tensors(path: Path) -> tuple[object, dict[str, torch.Tensor], str]:
    layer = build(path, platform="cpu", dtype="float32", kernel="torch-reference", keep_weights=True)
    names = layer.router_tensors.names
    assert names.expert_prefix is not None and names.projections is not None
    prefix = f"{names.expert_prefix.format(expert=0)}.{names.projections['down']}"
    index = open_checkpoint(path)
    tensors = {k[len(prefix) + 1:]: index.load(k) for k in index.tensors if k.startswith(prefix + ".")}
    return layer, tensors, prefix


@pytest.mark.parametrize("case", CASES)
def test_linear_dequantises_as_the_experts_do(case: str) -> None:
    layer, tensors, prefix = _down_tensors(FIXTURES / case)
    got = dequantize_linear(convert_linear(load_registry(()), layer.report, tensors, prefix), torch.float32)  # type: ignore[attr-defined]
    want = dequantize(layer.weights.w2, layer.weights.weight_key)[0]  # type: ignore[attr-defined]
    assert got.shape == want.shape and torch.equal(got, want)


def test_linear_not_in_the_schemes_format_names_the_module() -> None:
    layer, tensors, prefix = _down_tensors(FIXTURES / "fp8" / "modelopt-fp8")
    tensors.pop("weight_scale")
    with pytest.raises(CheckpointError, match=rf"^{prefix}: its tensors \(.*\) are not stored as scheme modelopt-fp8 "
                                              r"stores them: "):
        dequantize_linear(convert_linear(load_registry(()), layer.report, tensors, prefix), torch.float32)  # type: ignore[attr-defined]


@pytest.mark.parametrize("rows,cols", [(576, 320), (48, 64)])
def test_block_fp8_linear_with_partial_blocks_dequantises_block_by_block(rows: int, cols: int) -> None:
    """DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168] with block scales [5, 56]: its Linear sizes the scale grid
    by ceil division, so the last row block covers 64 rows. A dense linear is one projection, nothing fused, so it
    dequantises block by block, partial blocks included, as DeepSeek's own weight_dequant does (each block's
    scale times its codes); only the experts' gate and up, fused into w13, need whole row blocks."""
    layer, _, _ = _down_tensors(FIXTURES / "fp8" / "transformers-fp8-block")
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(rows, cols, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) + 0.5
    module = "model.layers.0.self_attn.kv_a_proj_with_mqa"
    registry = load_registry(())
    converted = convert_linear(registry, layer.report, {"weight": weight, "weight_scale_inv": scale},  # type: ignore[attr-defined]
                               module)
    want = weight.float() * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    assert torch.equal(dequantize_linear(converted, torch.float32), want)
    # run packed on the CPU's default kernel (its activations fp8 per 128-column group, as the scheme binds them)
    packed = Dot8Linear(converted.w2, converted.weight_key, converted.activation_key)
    x = torch.randn(5, cols, generator=gen)
    ref = x @ want.t()
    assert float((packed.apply(x) - ref).norm() / ref.norm()) < registry.scheme("fp8-block128").tolerance["float32"]
