"""Expert parallelism over torch.distributed, on CPUs over gloo: the
all-gather / reduce-scatter PrepareFinalize across 2 and 4 processes gives the single-process layer's
output within float32 round-off, with tokens sharded over the ranks (one rank with none), experts
placed contiguously or round-robin, and experts that receive no tokens."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from moe_registry_kernels.reference import ReferenceExperts
from safetensors.torch import load_file, save_file

import moe_registry
from moe_registry.core.errors import ConfigError
from moe_registry.core.keys import parse_quant_key
from moe_registry.formats.weights import ExpertWeights, ProjectionWeights
from moe_registry.layer.all2all import (
    AllGatherReduceScatter,
    AllGatherReduceScatterBatched,
    ExpertParallelError,
    ExpertPlacement,
    RowLayout,
)
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.modular import FusedMoEKernel, LocalPrepareFinalize
from moe_registry.oracle.select import select
from moe_registry.situation.config import read_model_config
from moe_registry.situation.describe import Flags, situation_for_model
from moe_registry.spec.loader import load_registry

E, TOP_K, H, INTER = 8, 2, 32, 16


@dataclass(frozen=True)
class Case:
    world: int
    round_robin: bool
    shards: tuple[int, ...]  # tokens per rank (a 0: a rank with no tokens)
    max_tokens: int
    activation: str = "silu"


CASES = {
    "2-contiguous": Case(2, False, (5, 3), 8),
    "2-round-robin-empty-rank": Case(2, True, (0, 6), 6),
    "4-contiguous-empty-rank": Case(4, False, (3, 0, 4, 1), 4),
    "4-round-robin-gelu": Case(4, True, (2, 2, 3, 1), 3, "gelu"),
}


def _problem(case: Case) -> tuple[ExpertWeights, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random unquantized experts and routing; expert E-1 receives no token."""
    g = torch.Generator().manual_seed(7)
    unq = parse_quant_key("unquantized")
    weights = ExpertWeights(ProjectionWeights(torch.randn(E, 2 * INTER, H, generator=g) / H ** 0.5),
                            ProjectionWeights(torch.randn(E, H, INTER, generator=g) / INTER ** 0.5), unq, unq)
    m = sum(case.shards)
    hidden = torch.randn(m, H, generator=g)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:TOP_K] for _ in range(m)])
    topk_weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=-1)
    return weights, hidden, topk_weights, ids


DISPATCHER = {"standard": AllGatherReduceScatter, "batched": AllGatherReduceScatterBatched}


def _rank(rank: int, case: Case, fmt: str, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=case.world,
                            timeout=timedelta(seconds=60))
    try:
        weights, hidden, topk_weights, ids = _problem(case)
        placement = ExpertPlacement(E, case.world, rank, round_robin=case.round_robin)
        experts = ReferenceExperts(weights.subset(placement.local_experts()),
                                   ExpertsConfig(case.activation, activation_format=fmt))  # type: ignore[arg-type]
        kernel = FusedMoEKernel(DISPATCHER[fmt](placement, case.max_tokens), experts)
        lo = sum(case.shards[:rank])
        hi = lo + case.shards[rank]
        out = kernel(hidden[lo:hi], topk_weights[lo:hi], ids[lo:hi])
        save_file({"out": out.contiguous()}, str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fmt", sorted(DISPATCHER))
@pytest.mark.parametrize("name", sorted(CASES))
def test_expert_parallel_layer_equals_the_single_process_layer(name: str, fmt: str, tmp_path: Path) -> None:
    case = CASES[name]
    mp.spawn(_rank, args=(case, fmt, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=case.world)
    weights, hidden, topk_weights, ids = _problem(case)
    whole = FusedMoEKernel(LocalPrepareFinalize(), ReferenceExperts(weights, ExpertsConfig(case.activation)))
    expected = whole(hidden, topk_weights, ids)
    got = torch.cat([load_file(str(tmp_path / f"rank{r}.safetensors"))["out"] for r in range(case.world)])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(expected, torch.zeros_like(expected))


def _rank_that_dies(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=5))
    if rank == 1:
        os._exit(0)  # gone before the layer's first collective, without a word to the group
    case = Case(2, False, (2, 2), 2)
    weights, hidden, topk_weights, ids = _problem(case)
    placement = ExpertPlacement(E, 2, 0)
    try:  # the first collective: the ranks' agreement on the layer, as the dispatcher is made
        kernel = FusedMoEKernel(AllGatherReduceScatter(placement, 2),
                                ReferenceExperts(weights.subset(placement.local_experts()), ExpertsConfig()))
        kernel(hidden[:2], topk_weights[:2], ids[:2])
        message = "no error"
    except ExpertParallelError as err:
        message = str(err)
    Path(out_dir, "rank0.txt").write_text(message)
    os._exit(0)  # the group cannot be destroyed cleanly with a dead member


def test_a_rank_that_dies_fails_the_others_with_one_line(tmp_path: Path) -> None:
    started = time.monotonic()
    mp.spawn(_rank_that_dies, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    message = (tmp_path / "rank0.txt").read_text()
    assert message.startswith("expert parallelism: rank 0 of 2: all_gather failed (a rank died or did not answer "
                              "within the process group's timeout): "), message
    assert "\n" not in message
    assert time.monotonic() - started < 60


def _rank_that_disagrees(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        AllGatherReduceScatter(ExpertPlacement(E, 2, rank), 4 if rank == 0 else 8, agreement="mixtral awq-w4a16")
        message = "no error"
    except ExpertParallelError as err:
        message = str(err)
    Path(out_dir, f"rank{rank}.txt").write_text(message)
    dist.destroy_process_group()


def test_ranks_that_disagree_on_the_layer_fail_together(tmp_path: Path) -> None:
    mp.spawn(_rank_that_disagrees, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == (
            "expert parallelism: ranks 1 build another layer than rank 0 (config, scheme, kernel, placement or "
            "max_tokens differ); wanted every rank to run the same layer")


FIX = Path(__file__).parent / "fixtures"
# llm-compressor checkpoints of one shape (4 experts, top-2, hidden 128), then an unquantized one of that shape
# (_unquantized_like); each kernel runs the first it can
FIXTURES = (FIX / "compressed_tensors_presets" / "w4a16-g128", FIX / "compressed_tensors_presets" / "w8a16-asym-g32",
            FIX / "fp8" / "llmc-fp8-block", FIX / "fp8" / "llmc-fp8-dynamic")
CLAIMS = {name: k.spec for name, k in load_registry().kernels.items()
          if "allgather_reducescatter" in k.spec.parallel.all2all}
EP_KERNELS = sorted(name for name, spec in CLAIMS.items() if any(p.device == "cpu" for p in spec.platforms))


def _unquantized_like(fixture: Path, out: Path) -> Path:
    """``fixture``'s config without its quantization_config, its router and random bfloat16 experts, in ``out``."""
    config = json.loads((fixture / "config.json").read_text())
    del config["quantization_config"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(5)
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    tensors = {"model.layers.0.mlp.gate.weight": load_file(str(fixture / "model.safetensors"))[
        "model.layers.0.mlp.gate.weight"]}
    for e in range(config["num_local_experts"]):
        for name, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight"] = (
                torch.randn(shape, generator=g) / shape[1] ** 0.5).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _fixture_for(kernel: str, work: Path) -> Path:
    registry = load_registry()
    for path in (*FIXTURES, _unquantized_like(FIXTURES[0], work / "unquantized")):
        situation = situation_for_model(read_model_config(path, registry), registry, Flags(platform="cpu",
                                                                                            dtype="float32"))
        if select(registry, situation, pin=kernel, raise_on_failure=False).chosen == kernel:
            return path
    raise AssertionError(f"no fixture here runs on {kernel}; add one to FIXTURES")


def _inputs(m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(m, 128, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(m)])
    return hidden, torch.softmax(torch.randn(m, 2, generator=g), dim=-1), ids


def _rank_builds(rank: int, kernel: str, fixture: str, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        layer = moe_registry.build(fixture, platform="cpu", layer=0, dtype="float32", kernel=kernel, ep=2,
                                   all2all="allgather_reducescatter", max_tokens=4)
        hidden, topk_weights, ids = _inputs(7)
        lo, hi = (0, 4) if rank == 0 else (4, 7)
        out = layer.kernel(hidden[lo:hi], topk_weights[lo:hi], ids[lo:hi])
        save_file({"out": out.contiguous(), "local": torch.tensor([layer.weights.num_experts]),
                   "routed": torch.tensor([layer.kernel.experts.config.routed_experts or 0])},
                  str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kernel", EP_KERNELS)
def test_every_kernel_claiming_the_backend_runs_it_through_build(kernel: str, tmp_path: Path) -> None:
    """What a kernel spec claims, this runs: build(ep=2, all2all=allgather_reducescatter) in two gloo ranks,
    on a checkpoint llm-compressor wrote (the first of FIXTURES the kernel runs; an unquantized one of their shape
    for a kernel of unquantized weights), equals the single-process layer.
    Each rank's experts know the router picks among all 4 (ExpertsConfig.routed_experts); the whole layer's, its own."""
    fixture = _fixture_for(kernel, tmp_path)
    mp.spawn(_rank_builds, args=(kernel, str(fixture), f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    whole = moe_registry.build(fixture, platform="cpu", layer=0, dtype="float32", kernel=kernel)
    expected = whole.kernel(*_inputs(7))
    parts = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert [int(p["local"]) for p in parts] == [2, 2]  # each rank holds its half of the experts
    assert [int(p["routed"]) for p in parts] == [4, 4] and whole.kernel.experts.config.routed_experts is None
    torch.testing.assert_close(torch.cat([p["out"] for p in parts]), expected, rtol=1e-5, atol=1e-5)


def test_every_claim_of_the_backend_is_run_by_a_test() -> None:
    """Kernels that run on the CPU run it above (gloo); CUDA kernels in tests/test_expert_parallel_gpu.py (NCCL,
    two GPUs). A kernel for neither device claiming it would be run by no test."""
    assert "triton-fused-moe" in CLAIMS and "torch-reference" in EP_KERNELS
    for name, spec in CLAIMS.items():
        assert {p.device for p in spec.platforms} & {"cpu", "cuda"}, name


def _rank_triton(rank: int, fmt: str, init: str, out_dir: str) -> None:
    from moe_registry_kernels.triton.experts import TritonBatchedExperts, TritonExperts

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        case = CASES["2-contiguous"]
        weights, hidden, topk_weights, ids = _problem(case)
        placement = ExpertPlacement(E, 2, rank)
        local = weights.subset(placement.local_experts())
        cls = TritonBatchedExperts if fmt == "batched" else TritonExperts
        experts = cls(ExpertWeights(*(replace(p, weight=p.weight.half()) for p in (local.w13, local.w2)),
                                    local.weight_key, local.activation_key),
                      ExpertsConfig(activation_format=fmt))  # type: ignore[arg-type]
        kernel = FusedMoEKernel(DISPATCHER[fmt](placement, case.max_tokens), experts)
        mine = slice(0, 5) if rank == 0 else slice(5, 8)
        out = kernel(hidden[mine].half(), topk_weights[mine], ids[mine].int())
        save_file({"out": out.float().contiguous()}, str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on CPU tensors runs in its interpreter (GPU: tests/test_expert_parallel_gpu.py)")
@pytest.mark.parametrize("fmt", sorted(DISPATCHER))
def test_triton_experts_take_the_gathered_rows_and_foreign_ids(fmt: str, tmp_path: Path) -> None:
    """The Triton experts (in Triton's interpreter) behind the dispatcher: padding rows, foreign ids (-1) and the
    byte-packed gather as the GPU sees them."""
    pytest.importorskip("triton")
    mp.spawn(_rank_triton, args=(fmt, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    weights, hidden, topk_weights, ids = _problem(CASES["2-contiguous"])
    expected = FusedMoEKernel(LocalPrepareFinalize(), ReferenceExperts(weights, ExpertsConfig()))(
        hidden, topk_weights, ids)
    got = torch.cat([load_file(str(tmp_path / f"rank{r}.safetensors"))["out"] for r in range(2)])
    rel = float((got - expected).norm() / expected.norm())
    assert rel < 5e-3, rel  # float16 activations and weights (tests/test_triton_interpreter.py's bound)


def test_a_token_row_packs_ids_weights_and_hidden_aligned() -> None:
    hidden = torch.randn(3, 5).half()
    weights, ids = torch.rand(3, 3), torch.tensor([[1, -1, 7]] * 3)  # int64 ids travel as int32
    layout = RowLayout.of(5, 3, torch.float16)
    assert [(f.offset, f.width) for f in (layout.ids, layout.weights, layout.hidden)] == [(0, 3), (12, 3), (24, 5)]
    assert layout.row_bytes == 36  # 34 bytes padded to the widest element (4 bytes)
    assert RowLayout.of(5, 3, torch.float64).hidden.offset == 0  # a wider hidden dtype goes first
    rows = torch.zeros(3, layout.row_bytes, dtype=torch.uint8)
    for field, t in ((layout.ids, ids), (layout.weights, weights), (layout.hidden, hidden)):
        field.of(rows).copy_(t)
    assert torch.equal(layout.ids.of(rows), ids.int()) and torch.equal(layout.weights.of(rows), weights)
    assert torch.equal(layout.hidden.of(rows), hidden)


def test_build_with_a_dispatch_and_no_process_group_says_how_to_start_the_ranks() -> None:
    with pytest.raises(ConfigError, match=r"^ep=2, all2all allgather_reducescatter: no torch.distributed process "
                                          r"group; start the 2 ranks with torchrun --nproc-per-node 2"):
        moe_registry.build(FIXTURES[0], platform="cpu", layer=0, dtype="float32", ep=2,
                           all2all="allgather_reducescatter")


def test_placement_owns_each_expert_once() -> None:
    for round_robin in (False, True):
        owned = [ExpertPlacement(E, 4, r, round_robin).local_experts().tolist() for r in range(4)]
        assert sorted(e for experts in owned for e in experts) == list(range(E))
        for r, experts in enumerate(owned):
            assert all(ExpertPlacement(E, 4, r, round_robin).owner(e) == r for e in experts)
            assert ExpertPlacement(E, 4, r, round_robin).local_ids()[experts].tolist() == list(range(len(experts)))
    assert ExpertPlacement(E, 4, 1, round_robin=True).local_experts().tolist() == [1, 5]


def test_a_world_size_that_does_not_divide_the_experts_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^8 experts do not split evenly over 3 ranks; wanted a world size "
                                         r"that divides 8$"):
        ExpertPlacement(E, 3, 0)


def test_without_a_process_group_it_says_how_to_start_the_ranks() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="needs a torch.distributed process group: start the ranks with torchrun"):
        AllGatherReduceScatter(ExpertPlacement(E, 2, 0), 4)
