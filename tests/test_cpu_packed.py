"""What the conformance suite does not check for the torch-cpu-packed kernel: resident weight bytes stay
near the checkpoint's, only routed experts are computed, and the oracle chooses it for cpu with the
reference as the fallback."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_registry_kernels.cpu_packed import CpuPackedExperts, packed_checkpoint_bytes
from moe_registry_kernels.quant_ref import make_random_expert_weights
from moe_registry_kernels.reference import reference_moe

from moe_registry.cli.main import main as cli_main
from moe_registry.core.keys import parse_quant_key
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.resident import reachable_tensor_bytes

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
    del w  # what the Experts object itself keeps reachable, the nk tensors gone
    walked = reachable_tensor_bytes(experts) / packed_checkpoint_bytes(_weights(wkey, akey))
    assert walked <= 1.25, f"{wkey}: reachable / checkpoint bytes = {walked:.3f}"
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


def test_explain_cpu_takes_packed_after_dot8_with_reference_as_fallback(tmp_path, capsys) -> None:
    """bfloat16 on the CPU: the integer-dot kernel first (its declared error fits the scheme's bfloat16
    tolerance), the packed op next, the reference last, each eligible."""
    rt = tmp_path / "rt.yaml"
    rt.write_text(RUNTIME.format(inter=512))
    assert cli_main(["explain", str(rt)]) == 0
    out = capsys.readouterr().out
    assert "kernel      torch-cpu-dot8" in out
    dot8, packed, reference = (next(ln for ln in out.splitlines() if f"+ {k} " in ln)
                               for k in ("torch-cpu-dot8", "torch-cpu-packed", "torch-reference"))
    assert "chosen" in dot8 and "eligible" in packed and "eligible" in reference
    assert out.index(dot8) < out.index(packed) < out.index(reference)


def test_explain_cpu_falls_back_to_reference_when_packed_cannot_run(tmp_path, capsys) -> None:
    """An intermediate size the int4 op cannot take (not a multiple of 16): the reference runs it."""
    rt = tmp_path / "rt.yaml"
    rt.write_text(RUNTIME.format(inter=520))
    assert cli_main(["explain", str(rt)]) == 0
    out = capsys.readouterr().out
    assert "kernel      torch-reference" in out
    packed = next(ln for ln in out.splitlines() if ln.startswith("  - torch-cpu-packed"))
    assert "rejected" in packed and "multiple of 16" in out


# unquantized activations: fp8 activation codes flip on float32 rounding differences (1e-4 here), which
# would hide a scale applied to the wrong block (the conformance suite runs the claimed fp8 activations)
FP8_BLOCK = ("fp8e4m3 scale:float32:block(128x128):static", "unquantized")
FP8_MX = ("fp8e4m3 scale:e8m0:block(1x32):static", "unquantized")


@pytest.mark.parametrize("tokens", [3, 160], ids=["scales-on-activations", "scales-on-weight-tiles"])
@pytest.mark.parametrize("tile", [None, 1 << 14], ids=["one-tile", "many-tiles"])
@pytest.mark.parametrize("keys", [FP8_BLOCK, FP8_MX], ids=["block128", "mx"])
def test_fp8_paths_match_the_reference(monkeypatch, keys, tile, tokens: int) -> None:
    """Both ways of applying fp8 scales (folded into the activations below 128 rows per expert, multiplied
    into the weight tile otherwise), over one or several tiles, with a partial 128-row block (N = 400)
    and a partial column group (K = 200): float32-exact against the float64 reference."""
    import moe_registry_kernels.cpu_packed as cp

    if tile is not None:
        monkeypatch.setattr(cp, "FP8_TILE_ELEMENTS", tile)
    w = make_random_expert_weights(parse_quant_key(keys[0]), parse_quant_key(keys[1]), num_experts=2, hidden=256,
                                   intermediate=200, dtype=torch.float32, seed=3)
    experts = CpuPackedExperts(w, ExpertsConfig())
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 0]] * tokens, dtype=torch.int32)
    topk_w = torch.full((tokens, 2), 0.5)
    out = experts.apply(x, topk_w, ids)
    ref = reference_moe(x, topk_w, ids, w, ExpertsConfig())
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_fp8_huge_scales_take_the_unscaled_tile_path() -> None:
    """Scales whose product with 2^120 overflows float32 (e8m0 up to 2^127) still compute exactly."""
    w = make_random_expert_weights(parse_quant_key(FP8_MX[0]), parse_quant_key(FP8_MX[1]), num_experts=2,
                                   hidden=64, intermediate=64, dtype=torch.float32, seed=4)
    big = torch.full_like(w.w13.scale, 127 + 20)  # 2^20 per block
    w = dataclasses.replace(w, w13=dataclasses.replace(w.w13, scale=big))
    experts = CpuPackedExperts(w, ExpertsConfig())
    assert experts.w13.unscale and not experts.w2.unscale
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * 1e-6
    ids = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
    topk_w = torch.full((5, 2), 0.5)
    ref = reference_moe(x, topk_w, ids, w, ExpertsConfig())
    assert float((experts.apply(x, topk_w, ids).double() - ref).norm() / ref.norm()) < 1e-5
