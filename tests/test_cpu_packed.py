"""What the conformance suite does not check for the torch-cpu-packed kernel: resident weight bytes stay
near the checkpoint's, only routed experts are computed, and the oracle chooses it for cpu with the
reference as the fallback."""

from __future__ import annotations

import pytest
import torch
from moe_registry_kernels.cpu_packed import CpuPackedExperts, packed_checkpoint_bytes
from moe_registry_kernels.quant_ref import make_random_expert_weights
from moe_registry_kernels.reference import reference_moe

from moe_registry.cli.main import main as cli_main
from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.experts import ExpertsConfig

KEYS = [
    ("uint4 scale:float16:group(128):static zp:group", "unquantized"),
    ("uint4 scale:float16:group(32):static zp:group", "unquantized"),
    ("uint4b8 scale:float16:channel:static", "unquantized"),
    ("uint4b8 scale:float16:group(64):static", "unquantized"),
    ("uint8b128 scale:float16:group(128):static", "unquantized"),
    ("uint8b128 scale:float16:channel:static", "unquantized"),
    ("fp8e4m3 scale:e8m0:block(1x32):static", "unquantized"),
    ("fp8e4m3 scale:float32:block(128x128):static", "fp8e4m3 scale:float32:group(128):dynamic"),
]


def _weights(wkey: str, akey: str, **kw):
    return make_random_expert_weights(parse_quant_key(wkey), parse_quant_key(akey), num_experts=kw.get("e", 4),
                                      hidden=256, intermediate=384, dtype=torch.bfloat16, seed=5)


@pytest.mark.parametrize("wkey,akey", KEYS, ids=[k[0] for k in KEYS])
def test_resident_bytes_within_a_quarter_of_the_checkpoint(wkey: str, akey: str) -> None:
    w = _weights(wkey, akey)
    experts = CpuPackedExperts(w, ExpertsConfig())
    ratio = experts.resident_weight_bytes() / packed_checkpoint_bytes(w)
    assert 0.99 <= ratio <= 1.25, f"{wkey}: resident / checkpoint bytes = {ratio:.3f}"
    # the Experts object does not pin the nk tensors it was built from
    assert experts.weights.w13.weight.untyped_storage().nbytes() <= 8


def test_checkpoint_bytes_of_awq_group128() -> None:
    w = _weights(*KEYS[0])
    e, h, i = 4, 256, 384
    elems = e * 3 * h * i
    assert packed_checkpoint_bytes(w) == elems // 2 + elems // 128 * 2 + elems // 128 // 2


def test_only_routed_experts_are_computed() -> None:
    w = _weights(*KEYS[0], e=8)
    experts = CpuPackedExperts(w, ExpertsConfig())
    calls: list[tuple[int, int, int]] = []
    gemm = experts._gemm

    def spy(which: int, e: int, x: torch.Tensor) -> torch.Tensor:
        calls.append((which, e, x.shape[0]))
        return gemm(which, e, x)

    experts._gemm = spy  # type: ignore[method-assign]
    ids = torch.tensor([[5, 2], [2, 5], [5, 7]], dtype=torch.int32)
    topk_w = torch.full((3, 2), 0.5)
    x = torch.randn(3, 256).bfloat16()
    out = experts.apply(x, topk_w, ids)
    # each hit expert once per projection, on exactly its tokens, in expert order
    assert calls == [(0, 2, 2), (1, 2, 2), (0, 5, 3), (1, 5, 3), (0, 7, 1), (1, 7, 1)]
    ref = reference_moe(x, topk_w, ids, w, ExpertsConfig())
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


def test_foreign_experts_add_nothing() -> None:
    w = _weights(*KEYS[5])
    experts = CpuPackedExperts(w, ExpertsConfig())
    x = torch.randn(2, 256).bfloat16()
    ids = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int32)
    out = experts.apply(x, torch.ones(2, 2), ids)
    assert bool((out[1] == 0).all()) and float(out[0].float().norm()) > 0


RUNTIME = ("platform: cpu\ndtype: bfloat16\nnum_experts: 8\ntop_k: 2\nhidden: 1024\nintermediate: {inter}\n"
           "quantization_config: {{quant_method: awq, bits: 4, group_size: 128, zero_point: true, version: gemm}}\n")


def test_explain_cpu_chooses_packed_with_reference_as_fallback(tmp_path, capsys) -> None:
    rt = tmp_path / "rt.yaml"
    rt.write_text(RUNTIME.format(inter=512))
    assert cli_main(["explain", str(rt)]) == 0
    out = capsys.readouterr().out
    assert "kernel      torch-cpu-packed" in out
    packed = next(ln for ln in out.splitlines() if "+ torch-cpu-packed" in ln)
    reference = next(ln for ln in out.splitlines() if "+ torch-reference" in ln)
    assert "chosen" in packed and "eligible" in reference
    assert out.index(packed) < out.index(reference)


def test_explain_cpu_falls_back_to_reference_when_packed_cannot_run(tmp_path, capsys) -> None:
    """An intermediate size the int4 op cannot take (not a multiple of 16): the reference runs it."""
    rt = tmp_path / "rt.yaml"
    rt.write_text(RUNTIME.format(inter=520))
    assert cli_main(["explain", str(rt)]) == 0
    out = capsys.readouterr().out
    assert "kernel      torch-reference" in out
    packed = next(ln for ln in out.splitlines() if "torch-cpu-packed" in ln)
    assert "rejected" in packed and "multiple of 16" in out
