"""The Triton kernel package's shape: files of one job each, tools on its public surface, and the weight
layout's pack and unpack inverse of each other."""

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600


def test_no_kernel_source_file_is_over_600_lines():
    long = {p.name: n for p in (ROOT / "kernels").rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_tool_imports_a_private_kernel_name():
    """Tools use the Triton kernels' public names (api.py), so the package can be rearranged under them."""
    seen = []
    for path in (ROOT / "tools").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_registry_kernels.triton"):
                seen += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not seen, seen


@pytest.mark.parametrize("wkey", ["e2m1 scale:fp8e4m3:group(16):static scale2:float32:tensor:static",
                                  "e2m1 scale:e8m0:group(32):static", "uint4 scale:float16:group(128):static zp:group",
                                  "uint4b8 scale:float16:group(64):static", "fp8e4m3 scale:e8m0:block(1x32):static"])
def test_the_layout_unpacks_what_it_packs(wkey):
    pytest.importorskip("triton")
    from moe_registry_kernels.quant_ref import make_random_expert_weights
    from moe_registry_kernels.triton.layout import TritonWeightLayout
    from moe_registry_kernels.triton.variant import variant_from_keys

    from moe_registry.core.keys import parse_quant_key

    weights = make_random_expert_weights(parse_quant_key(wkey), parse_quant_key("unquantized"), num_experts=2,
                                         hidden=128, intermediate=64, dtype=torch.float16, seed=3)
    layout = TritonWeightLayout(variant_from_keys(wkey, "unquantized"))
    for p in (weights.w13, weights.w2):
        back = layout.unpack(layout.pack(p), p.scale2)
        for field in ("weight", "scale", "zero"):
            want, got = getattr(p, field), getattr(back, field)
            assert (want is None) == (got is None), field
            if want is not None:
                same = torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
                assert got.dtype == want.dtype and same, field
