"""The memory a built torch-cpu-packed layer really holds: every tensor reachable from what ``build`` and
``load_layer`` return (the kernel, the report, the config, closures), each storage once, stays within a
quarter of the checkpoint's bytes for the expert weights; the converted and checkpoint tensors are read
again only when asked for."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from moe_registry_kernels.cpu_packed import packed_checkpoint_bytes
from moe_registry_kernels.reference import reference_moe
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.layer.build import build
from moe_registry.layer.moe_layer import load_layer
from moe_registry.layer.resident import reachable_tensor_bytes

# example checkpoint -> what it is (int4 AWQ, GPTQ int4 sym with and without act-order, GPTQ int8 groups)
PACKED = ["mixtral-awq", "qwen3-gptq-int4", "qwen3-gptq-int4-actorder", "qwen2-gptq-int8"]


@pytest.mark.parametrize("name", PACKED)
def test_built_layer_holds_no_more_than_the_packed_weights(example: Callable[[str], Path], name: str) -> None:
    # bfloat16: the packed ops' own dtype, where torch-cpu-dot8 comes first (its codes, float32 scales and a zero
    # byte per group where the checkpoint has zero points: 1.04x the checkpoint's bytes at group 128)
    layer = build(example(name), layer=1, platform="cpu", dtype="bfloat16", prefer="torch-cpu-packed")
    assert layer.report.chosen == "torch-cpu-packed"
    dot8 = build(example(name), layer=1, platform="cpu", dtype="bfloat16")
    assert dot8.report.chosen == "torch-cpu-dot8"
    assert reachable_tensor_bytes(dot8) <= 1.25 * packed_checkpoint_bytes(dot8.weights)
    held = reachable_tensor_bytes(layer)
    module_held = reachable_tensor_bytes(load_layer(example(name), layer=1, platform="cpu", dtype="bfloat16"))
    packed = packed_checkpoint_bytes(layer.weights)
    assert held <= 1.25 * packed, f"{name}: the built layer holds {held} bytes, the checkpoint {packed}"
    assert module_held <= 1.25 * packed, f"{name}: load_layer's module holds {module_held} bytes, checkpoint {packed}"


def test_weights_and_tensors_are_read_again_and_still_agree(example: Callable[[str], Path]) -> None:
    """``weights``/``tensors`` are not held but still give the converted and checkpoint tensors: the kernel
    matches the float64 reference computed from them."""
    layer = build(example("mixtral-awq"), layer=1, platform="cpu")
    assert layer.built.converted is None
    assert len(layer.tensors.experts) == 8 and layer.router_tensors.experts == ()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    r = moe_registry.load_layer(example("mixtral-awq"), layer=1, platform="cpu").route(x)
    out = layer.kernel(x, r.topk_weights, r.topk_ids)
    ref = reference_moe(x, r.topk_weights, r.topk_ids, layer.weights, layer.kernel.experts.config)
    assert float((out.double() - ref).norm() / ref.norm()) < layer.tolerance


def test_a_built_fused_layer_keeps_no_stacked_expert_tensors() -> None:
    """A fused family's experts are read stacked over experts; the built layer keeps only its router's tensors."""
    fused = Path(__file__).parent / "fixtures" / "transformers" / "tiny" / "gpt_oss"
    layer = build(fused, layer=0, platform="cpu", dtype="float32")
    assert layer.tensors.stacked and layer.router_tensors.router is not None
    kept = layer.router_tensors
    assert kept.experts == () and kept.stacked == {} and kept.stacked_wide == {} and kept.layer_wide == ()


def test_the_walk_sees_converted_weights_a_kernel_keeps(example: Callable[[str], Path]) -> None:
    """The yardstick is honest: the reference keeps float32 dense weights (8x the int4 bytes), and the
    walk counts them."""
    layer = build(example("mixtral-awq"), layer=1, platform="cpu", kernel="torch-reference")
    assert layer.built.converted is not None  # the reference holds the converted tensors themselves
    assert reachable_tensor_bytes(layer) > 6 * packed_checkpoint_bytes(layer.weights)


def test_walk_follows_closures_and_counts_each_storage_once() -> None:
    t = torch.zeros(1000)
    views = (t[:10], t[5:], t.view(10, 100))

    def closure() -> object:
        return views

    assert reachable_tensor_bytes({"a": [closure], "b": (t,)}) == 4000
    assert reachable_tensor_bytes(lambda: None) == 0


def _rank_measures(rank: int, model_dir: str, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        layer = build(model_dir, layer=1, platform="cpu", ep=2, all2all="allgather_reducescatter", max_tokens=4)
        held = reachable_tensor_bytes(layer)
        weights = layer.weights
        save_file({"held": torch.tensor([held]), "packed": torch.tensor([packed_checkpoint_bytes(weights)]),
                   "experts": torch.tensor([weights.num_experts]),
                   "kept": torch.tensor([layer.built.converted is not None])}, str(Path(out_dir) / f"rank{rank}.st"))
    finally:
        dist.destroy_process_group()


def test_an_expert_parallel_rank_holds_only_its_packed_share(example: Callable[[str], Path], tmp_path: Path) -> None:
    """build(ep=2): each rank reads its own experts and keeps only the packed copy of them."""
    model_dir = str(example("mixtral-awq"))
    mp.spawn(_rank_measures, args=(model_dir, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    for r in range(2):
        got = load_file(str(tmp_path / f"rank{r}.st"))
        assert int(got["experts"]) == 4 and not bool(got["kept"])
        held, packed = int(got["held"]), int(got["packed"])
        assert held <= 1.25 * packed, f"rank {r}: holds {held} bytes, its experts' checkpoint {packed}"
