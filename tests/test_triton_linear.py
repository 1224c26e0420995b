"""The Triton kernel's one-projection form (``TritonLinear``): one GEMM launch on row blocks sliced from the table
the linear holds. The conformance suite holds its numerics per scheme; here the rows past the first table, the
one-row block, and the one-line error of a call the table cannot hold (on the CPU, under Triton's interpreter)."""

import importlib.util

import pytest
import torch
from moe_registry_kernels.quant_ref import quantize_weight_to_layout
from moe_registry_kernels.reference import reference_linear

from moe_registry.core.keys import parse_quant_key

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

GPTQ = parse_quant_key("uint4b8 scale:float16:group(128):static")
UNQ = parse_quant_key("unquantized")


def _projection(n: int = 64, k: int = 256):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    return quantize_weight_to_layout(torch.randn(1, n, k, generator=gen) / 16, GPTQ, dtype=torch.float16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rows_past_the_first_table_grow_it_and_match_the_reference(rows: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from moe_registry_kernels.triton import linear

    monkeypatch.setattr(linear, "TABLE_ROWS", 16)
    proj = _projection()
    lin = linear.TritonLinear(proj, GPTQ, UNQ)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).half()
    out = lin.apply(x)
    assert out.shape == (rows, 64) and out.dtype == torch.float16
    assert _rel(out, reference_linear(x, proj, GPTQ, UNQ)) < 2e-3
    assert lin._rows.rows >= rows + 256  # grown from 16 rows: every call leaves 256 rows of headroom


def test_a_call_past_its_row_table_is_refused_in_one_line() -> None:
    from moe_registry_kernels.triton import linear

    lin = linear.TritonLinear(_projection(), GPTQ, UNQ)
    small = linear.RowTable(16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^the linear's row table holds 16 rows, the call has 40$"):
        linear.linear(torch.zeros(40, 256, dtype=torch.float16), *lin._tensors, small.table, *lin._keys)
