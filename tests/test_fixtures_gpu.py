"""Every committed checkpoint written by a producer (transformers' tiny models, GPTQModel, AutoAWQ, Quark,
ModelOpt, llm-compressor) built on the GPU as the oracle chooses, in bfloat16 and float16, and held to
its scheme's tolerance against the float64 reference on the same converted weights (which the CPU
tests hold bit-equal to each producer's own dequantisation). Run with ``pytest -m gpu``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moe_registry
from moe_registry.layer.moe_layer import MoELayer

pytestmark = pytest.mark.gpu

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CHECKPOINTS = sorted(p.parent for p in FIXTURES.rglob("model.safetensors"))


def _id(path: Path) -> str:
    return str(path.relative_to(FIXTURES)).removesuffix("/checkpoint")


@pytest.mark.parametrize("tokens", [3, 200])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("path", CHECKPOINTS, ids=[_id(p) for p in CHECKPOINTS])
def test_producer_checkpoint_on_the_gpu(path: Path, dtype: str, tokens: int) -> None:
    from moe_registry_kernels.reference import reference_moe

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    layer = moe_registry.build(path, platform="auto", dtype=dtype, device="cuda")
    eligible = {k.kernel for k in layer.report.kernels if k.eligible}
    if any(k.startswith("triton-") for k in eligible):  # a Triton kernel can run it: the oracle must pick one
        assert layer.report.chosen.startswith("triton-"), layer.report.to_text()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, layer.model.shape.hidden, generator=gen).to("cuda", getattr(torch, dtype))
    routing = MoELayer(layer).route(x)
    out = layer.kernel(x, routing.topk_weights, routing.topk_ids)
    torch.cuda.synchronize()
    ref = reference_moe(x.cpu(), routing.topk_weights.cpu(), routing.topk_ids.cpu(), layer.weights.to("cpu"),
                        layer.kernel.experts.config, torch.float64)
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert torch.isfinite(out).all()
    assert err <= layer.tolerance, f"{_id(path)} {dtype} M={tokens} on {layer.report.chosen}: {err:.3e}"


@pytest.mark.parametrize("path", CHECKPOINTS, ids=[_id(p) for p in CHECKPOINTS])
def test_converted_on_the_gpu_as_on_the_cpu(path: Path) -> None:
    """A layer built for the GPU is converted there (build moves the checkpoint's tensors first): its
    converted weights must be bit-equal to the same converter's on the CPU, for the same chosen kernel."""
    from moe_registry.formats.weights import ProjectionWeights

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu = moe_registry.build(path, platform="auto", dtype="bfloat16", device="cuda", keep_weights=True)
    platform = str(gpu.report.situation.runtime.platform)
    cpu = moe_registry.build(path, platform=platform, dtype="bfloat16", device="cpu", keep_weights=True)
    assert cpu.report.chosen == gpu.report.chosen
    assert gpu.weights.device.type == "cuda" and cpu.weights.device.type == "cpu"
    for proj in ("w13", "w2"):
        on_gpu, on_cpu = getattr(gpu.weights, proj), getattr(cpu.weights, proj)
        for field in ProjectionWeights.__dataclass_fields__:
            a, b = getattr(on_gpu, field), getattr(on_cpu, field)
            assert (a is None) == (b is None), f"{_id(path)} {proj}.{field}"
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape, f"{_id(path)} {proj}.{field}"
                bits = (a.cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # fp8 and NaN too
                assert torch.equal(*bits), f"{_id(path)} {proj}.{field} differs"
