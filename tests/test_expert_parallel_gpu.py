"""Expert parallelism over NCCL on two GPUs of one host (``pytest -m gpu`` on a
machine with two GPUs): the all-gather / reduce-scatter PrepareFinalize with the Triton experts, in the
standard and the batched format, gives the single-process layer's output, eagerly and replayed from a CUDA
graph; every CUDA kernel spec that claims the backend runs it through ``build`` on a checkpoint a producer wrote;
``moe-registry run`` under torchrun on two GPUs writes the single-process output.

Tolerance: each rank's partial sums are rounded to the activation dtype before the reduce-scatter adds them
(vLLM's reduce-scatter does the same), so the result differs from one process's by a 16-bit rounding per
partial: 1e-2 relative in bfloat16, 2e-3 in float16."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torchrun_launch import clean_env, torchrun

import moe_registry
from moe_registry.core.keys import parse_quant_key
from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.all2all import AllGatherReduceScatter, AllGatherReduceScatterBatched, ExpertPlacement
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.modular import FusedMoEKernel, LocalPrepareFinalize
from moe_registry.spec.loader import load_registry

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs of one host")]

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the shared hosts (KINDS.md)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
RANK_SECONDS = 150
FIX = Path(__file__).parent / "fixtures"
CT_W4A16 = FIX / "compressed_tensors_presets" / "w4a16-g128"  # llm-compressor, 4 experts, H=128
QWEN = FIX / "transformers" / "tiny" / "qwen3_moe"  # transformers, 8 experts, H=64
GPU_EP_KERNELS = sorted(name for name, k in load_registry().kernels.items()
                        if "allgather_reducescatter" in k.spec.parallel.all2all
                        and any(p.device == "cuda" for p in k.spec.platforms))


@dataclass(frozen=True)
class Case:
    """A layer split over two GPUs: its weight key, sizes, each rank's tokens and the placement."""

    weight: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    shards: tuple[int, int]
    round_robin: bool
    dtype: torch.dtype
    activation_format: str = "standard"


CASES = {
    "bf16-contiguous": Case("unquantized", 8, 2, 256, 128, (5, 3), False, torch.bfloat16),
    "awq-round-robin-empty-rank": Case("uint4 scale:float16:group(128):static zp:group", 8, 2, 256, 128, (0, 6),
                                       True, torch.float16),
    "qwen3-shaped-bf16": Case("unquantized", 128, 8, 2048, 768, (64, 64), False, torch.bfloat16),
    "batched-bf16-round-robin": Case("unquantized", 8, 2, 256, 128, (5, 3), True, torch.bfloat16, "batched"),
    "batched-qwen3-shaped-bf16": Case("unquantized", 128, 8, 2048, 768, (1, 64), False, torch.bfloat16, "batched"),
}
DISPATCHER = {"standard": AllGatherReduceScatter, "batched": AllGatherReduceScatterBatched}


def _problem(case: Case, device: torch.device) -> tuple[ExpertWeights, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same random experts and routing on every rank (drawn on the CPU, then moved)."""
    from moe_registry_kernels.quant_ref import quantize_weight_to_layout

    g = torch.Generator().manual_seed(11)
    e, h, i = case.experts, case.hidden, case.intermediate
    wkey, unq = parse_quant_key(case.weight), parse_quant_key("unquantized")
    w13 = quantize_weight_to_layout(torch.randn(e, 2 * i, h, generator=g) / h ** 0.5, wkey, dtype=case.dtype)
    w2 = quantize_weight_to_layout(torch.randn(e, h, i, generator=g) / i ** 0.5, wkey, dtype=case.dtype)
    weights = ExpertWeights(w13, w2, wkey, unq).to(device)
    m = sum(case.shards)
    hidden = torch.randn(m, h, generator=g).to(device, case.dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:case.top_k] for _ in range(m)]).to(device, torch.int32)
    topk_weights = torch.softmax(torch.randn(m, case.top_k, generator=g), dim=-1).to(device)
    return weights, hidden, topk_weights, ids


def _init(rank: int, init: str, backend: str = "nccl") -> torch.device:
    """This rank's GPU and process group; a rank still running after RANK_SECONDS prints its stack and exits,
    so a collective that never completes fails the test instead of hanging it."""
    faulthandler.dump_traceback_later(RANK_SECONDS, exit=True)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60),
                            device_id=device if backend == "nccl" else None)
    return device


def _replayed(kernel: FusedMoEKernel, first: tuple[torch.Tensor, ...], other: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The layer captured in a CUDA graph (collectives included) on ``first``, replayed on ``other``. The graph is
    gone when this returns: a process group cannot be destroyed while a live graph holds its communicator."""
    static = [t.clone() for t in first]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = kernel(*static)
    for buffer, value in zip(static, other, strict=True):
        buffer.copy_(value)
    graph.replay()
    out = graphed.clone()
    torch.cuda.synchronize()
    graph.reset()
    return out


def _ep_rank(rank: int, case: Case, init: str, out_dir: str) -> None:
    from moe_registry_kernels.triton.experts import TritonBatchedExperts, TritonExperts

    device = _init(rank, init)
    try:
        weights, hidden, topk_weights, ids = _problem(case, device)
        placement = ExpertPlacement(case.experts, 2, rank, round_robin=case.round_robin)
        dispatcher = DISPATCHER[case.activation_format](placement, max(case.shards))
        cls = TritonBatchedExperts if case.activation_format == "batched" else TritonExperts
        experts = cls(weights.subset(placement.local_experts()),
                      ExpertsConfig(activation_format=case.activation_format))  # type: ignore[arg-type]
        kernel = FusedMoEKernel(dispatcher, experts)
        unchecked = FusedMoEKernel(dispatcher, experts, validate=False)  # the checks read ids on the host
        lo = sum(case.shards[:rank])
        mine = slice(lo, lo + case.shards[rank])
        eager = kernel(hidden[mine], topk_weights[mine], ids[mine])
        other = torch.roll(hidden, 1, 0)[mine], torch.roll(topk_weights, 1, 0)[mine], torch.roll(ids, 1, 0)[mine]
        replayed = _replayed(unchecked, (hidden[mine], topk_weights[mine], ids[mine]), other)
        again = kernel(*other)
        torch.cuda.synchronize()
        save_file({"eager": eager.cpu().contiguous(), "replayed": replayed.cpu(), "again": again.cpu().contiguous()},
                  str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_experts_over_nccl_equal_the_single_process_layer_eager_and_graphed(name: str, tmp_path: Path) -> None:
    from moe_registry_kernels.triton.experts import TritonExperts

    case = CASES[name]
    mp.spawn(_ep_rank, args=(case, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    weights, hidden, topk_weights, ids = _problem(case, torch.device("cuda", 0))
    whole = FusedMoEKernel(LocalPrepareFinalize(), TritonExperts(weights, ExpertsConfig()))
    expected = whole(hidden, topk_weights, ids).cpu()
    rolled = whole(torch.roll(hidden, 1, 0), torch.roll(topk_weights, 1, 0), torch.roll(ids, 1, 0)).cpu()
    parts = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    eager, replayed, again = (torch.cat([p[k] for p in parts]) for k in ("eager", "replayed", "again"))
    assert eager.shape == expected.shape and not torch.equal(expected, torch.zeros_like(expected))
    assert _relative(eager, expected) <= TOLERANCE[case.dtype]
    assert _relative(again, rolled) <= TOLERANCE[case.dtype]
    # the graph replays the new inputs (stale ones would be ~100% off; atomics may reorder a sum)
    assert _relative(replayed, again) <= TOLERANCE[case.dtype]


def _inputs(m: int, hidden: int, experts: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(m)])
    return x.to(device, torch.bfloat16), torch.softmax(torch.randn(m, 2, generator=g), -1).to(device), ids.to(device)


def _build_rank(rank: int, kernel: str, init: str, out_dir: str) -> None:
    device = _init(rank, init, backend="cpu:gloo,cuda:nccl")  # what run under torchrun starts
    try:
        layer = moe_registry.build(CT_W4A16, layer=0, dtype="bfloat16", kernel=kernel, ep=2, device=device,
                                   all2all="allgather_reducescatter", max_tokens=4)
        x, w, ids = _inputs(7, 128, 4, device)
        mine = slice(0, 4) if rank == 0 else slice(4, 7)
        out = layer.kernel(x[mine], w[mine], ids[mine])
        save_file({"out": out.cpu().contiguous(), "local": torch.tensor([layer.weights.num_experts]),
                   "chosen": torch.tensor([layer.report.chosen == kernel])},
                  str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kernel", GPU_EP_KERNELS)
def test_every_cuda_kernel_claiming_the_backend_runs_it_through_build(kernel: str, tmp_path: Path) -> None:
    """What a kernel spec claims, this runs: build(ep=2) on two GPUs, on a checkpoint llm-compressor wrote."""
    mp.spawn(_build_rank, args=(kernel, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    device = torch.device("cuda", 0)
    whole = moe_registry.build(CT_W4A16, layer=0, dtype="bfloat16", kernel=kernel, device=device)
    expected = whole.kernel(*_inputs(7, 128, 4, device)).cpu()
    parts = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    assert [int(p["local"]) for p in parts] == [2, 2] and all(bool(p["chosen"]) for p in parts)
    assert _relative(torch.cat([p["out"] for p in parts]), expected) <= TOLERANCE[torch.bfloat16]


def test_run_under_torchrun_on_two_gpus_writes_the_single_process_output(tmp_path: Path) -> None:
    inputs, one, ep = tmp_path / "in.safetensors", tmp_path / "one.safetensors", tmp_path / "ep.safetensors"
    save_file({"hidden_states": torch.randn(9, 64, generator=torch.Generator().manual_seed(1))}, str(inputs))
    common = ["--dtype", "bfloat16", "--inputs", str(inputs), "--repeat", "3", "--json"]
    single = subprocess.run([sys.executable, "-m", "moe_registry", "run", str(QWEN), *common, "--save-output",
                             str(one)], capture_output=True, text=True, env=clean_env(), timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    proc = torchrun(2, "-m", "moe_registry", "run", str(QWEN), "--ep", "2", *common, "--save-output", str(ep),
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    body = json.loads(proc.stdout)
    result = body["result"]
    assert body["report"]["chosen_kernel"] in GPU_EP_KERNELS
    assert (result["world_size"], result["tokens"], result["device"]) == (2, 9, "cuda:0")
    assert result["ok"] and [r["experts"] for r in result["ranks"]] == [4, 4]
    assert sum(r["pairs"] for r in result["ranks"]) == 9 * 2
    got, expected = load_file(str(ep))["output"], load_file(str(one))["output"]
    assert _relative(got, expected) <= TOLERANCE[torch.bfloat16]
