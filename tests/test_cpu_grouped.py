"""What the conformance suite does not check for torch-cpu-grouped: both row classes (experts with few rows on
torch's GEMV, the others on oneDNN) in one bfloat16 call against the reference, the backend flag each grouped
GEMM sees and its restoration, resident bytes equal to the checkpoint's, and the oracle's choice on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_registry_kernels.cpu_grouped import GEMV_ROWS, CpuGroupedExperts
from moe_registry_kernels.quant_ref import make_random_expert_weights
from moe_registry_kernels.reference import reference_moe, reference_moe_batched

from moe_registry.cli.main import main as cli_main
from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.spec.loader import load_registry

UNQUANTIZED = parse_quant_key("unquantized")
TOLERANCE = load_registry().scheme("unquantized").tolerance
E, H, INTER = 16, 256, 128
ROOT = Path(__file__).resolve().parent.parent


def _weights(dtype: torch.dtype, bias: bool = False):  # type: ignore[no-untyped-def]
    return make_random_expert_weights(UNQUANTIZED, UNQUANTIZED, num_experts=E, hidden=H, intermediate=INTER,
                                      dtype=dtype, bias=bias, seed=3)


def _routing(m: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token; expert 0 takes tokens 1..GEMV_ROWS+2 (more rows than GEMV_ROWS: the class a
    foreign pair must not sort into), token 0's first pair goes to another rank (-1); with m * top_k < 3 * E some
    other expert has at most GEMV_ROWS rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(m)])
    many = range(1, GEMV_ROWS + 3)
    for t in many:
        ids[t] = torch.where(ids[t] == 0, ids[t, 0], ids[t])
        ids[t, 0] = 0
    ids[0, 0] = -1
    return torch.rand(m, top_k, generator=gen) + 0.1, ids.to(torch.int32)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("activation,bias,on_input", [("silu", False, False), ("swigluoai", True, False),
                                                      ("gelu", True, True)])
def test_both_row_classes_match_the_reference(dtype: str, activation: str, bias: bool, on_input: bool) -> None:
    w = _weights(getattr(torch, dtype), bias)
    config = ExpertsConfig(activation=activation, apply_router_weight_on_input=on_input)
    top_k = 1 if on_input else 2
    hidden = torch.randn(11, H, generator=torch.Generator().manual_seed(1)).to(getattr(torch, dtype))
    topk_weights, topk_ids = _routing(11, top_k)
    got = CpuGroupedExperts(w, config).apply(hidden, topk_weights, topk_ids)
    assert got.dtype == hidden.dtype
    err = _rel(got, reference_moe(hidden, topk_weights, topk_ids, w, config))
    assert err <= TOLERANCE[dtype], f"{dtype}: {err:.2e} > {TOLERANCE[dtype]}"


def test_batched_format_with_both_row_classes_matches_the_reference() -> None:
    w = _weights(torch.bfloat16, bias=True)
    counts = torch.tensor([0, 1, GEMV_ROWS, GEMV_ROWS + 1, 6] + [1] * (E - 5))
    x = torch.randn(E, 6, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = CpuGroupedExperts(w, ExpertsConfig()).apply_batched(x, counts)
    want = reference_moe_batched(x, counts, w, ExpertsConfig())
    assert _rel(got, want) <= TOLERANCE["bfloat16"]
    assert not got[0].any() and not got[1, 1:].any()  # rows past a count stay zero


def test_few_row_experts_run_with_onednn_off_and_the_flag_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each grouped GEMM sees oneDNN off exactly when its experts all have at most GEMV_ROWS rows (bfloat16), and
    the caller's setting is back after the call."""
    seen: list[tuple[int, bool]] = []
    grouped_mm = torch._grouped_mm

    def spy(x: torch.Tensor, w: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
        sizes = torch.diff(offs, prepend=offs.new_zeros(1))
        seen.append((int(sizes.max()), torch._C._get_mkldnn_enabled()))
        return grouped_mm(x, w, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    experts = CpuGroupedExperts(_weights(torch.bfloat16), ExpertsConfig())
    # expert 3: GEMV_ROWS + 1 rows, expert 1: GEMV_ROWS, experts 8 and 9 one each, one pair on another rank
    ids = torch.tensor([[3] * (GEMV_ROWS + 1) + [-1], [1] * GEMV_ROWS + [8, 9]]).T
    experts.apply(torch.randn(GEMV_ROWS + 2, H).to(torch.bfloat16), torch.ones(ids.shape), ids)
    assert seen == [(GEMV_ROWS, False)] * 2 + [(GEMV_ROWS + 1, True)] * 2
    assert torch._C._get_mkldnn_enabled()
    seen.clear()
    experts.apply(torch.randn(1, H).to(torch.bfloat16), torch.ones(1, 4), torch.tensor([[0, 5, 6, 9]]))
    assert seen == [(1, False)] * 2
    seen.clear()  # float32 never turns it off
    CpuGroupedExperts(_weights(torch.float32), ExpertsConfig()).apply(torch.randn(1, H), torch.ones(1, 1),
                                                                      torch.tensor([[2]]))
    assert seen == [(1, True)] * 2


def test_the_flag_is_put_back_when_the_gemm_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("grouped gemm failed")

    monkeypatch.setattr(torch, "_grouped_mm", fail)
    with pytest.raises(RuntimeError, match="grouped gemm failed"):
        CpuGroupedExperts(_weights(torch.bfloat16), ExpertsConfig()).apply(
            torch.randn(1, H).to(torch.bfloat16), torch.ones(1, 2), torch.tensor([[0, 1]]))
    assert torch._C._get_mkldnn_enabled()


def test_only_foreign_pairs_and_no_tokens_give_zeros() -> None:
    experts = CpuGroupedExperts(_weights(torch.bfloat16), ExpertsConfig())
    out = experts.apply(torch.randn(2, H).to(torch.bfloat16), torch.ones(2, 2), torch.full((2, 2), -1))
    assert out.shape == (2, H) and out.dtype == torch.bfloat16 and not out.any()
    assert experts.apply(torch.randn(0, H).to(torch.bfloat16), torch.ones(0, 2), torch.zeros(0, 2)).shape == (0, H)


@pytest.mark.parametrize("ids,seen", [([[0, E]], f"[0, {E}]"), ([[-2, 1]], "[-2, 1]")])
def test_expert_ids_out_of_range_are_refused(ids: list[list[int]], seen: str) -> None:
    experts = CpuGroupedExperts(_weights(torch.bfloat16), ExpertsConfig())
    with pytest.raises(ValueError, match=rf"topk_ids must be in \[0, {E}\) or -1 \(a foreign expert\), "
                                         rf"got values in \{seen}"):
        experts.apply(torch.randn(1, H).to(torch.bfloat16), torch.ones(1, 2), torch.tensor(ids))


def test_quantized_weights_are_refused() -> None:
    key = parse_quant_key("uint4b8 scale:float16:group(128):static")
    w = make_random_expert_weights(key, UNQUANTIZED, num_experts=2, hidden=H, intermediate=INTER)
    with pytest.raises(ValueError, match="torch-cpu-grouped runs unquantized weights, got uint4b8"):
        CpuGroupedExperts(w, ExpertsConfig())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_holds_the_checkpoint_tensors_and_nothing_more(dtype: torch.dtype) -> None:
    """The kernel reads the converted (checkpoint-dtype) tensors through views: everything it reaches is those
    tensors' bytes, no float32 copy of 16-bit weights."""
    w = _weights(dtype)
    checkpoint = (w.w13.weight.numel() + w.w2.weight.numel()) * dtype.itemsize
    experts = CpuGroupedExperts(w, ExpertsConfig())
    assert experts.resident_weight_bytes() == checkpoint
    assert experts._w13.untyped_storage().data_ptr() == w.w13.weight.untyped_storage().data_ptr()
    del w
    assert reachable_tensor_bytes(experts) == checkpoint


def test_the_oracle_picks_it_for_an_unquantized_model_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    config = ROOT / "examples" / "configs" / "mixtral" / "mixtral-8x7b-instruct-v0.1"
    assert cli_main(["explain", str(config), "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "kernel      torch-cpu-grouped" in out
    assert "+ torch-reference     eligible  all constraints met" in out

