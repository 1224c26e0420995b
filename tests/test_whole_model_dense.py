"""A quantized non-expert linear dequantised once (moe_registry/whole/dense_linear.py) reads every producer's
format as the experts' own conversion does: one expert's down projection of each producer fixture, given as a
plain linear's tensors (suffix -> tensor), dequantises to exactly the float weight the layer's converted experts
dequantise to. A misnamed tensor or a wrong role would raise or differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
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
