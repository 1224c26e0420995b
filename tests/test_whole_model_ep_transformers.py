"""transformers' own expert parallelism carrying the registry's experts: a model transformers loads with
``experts_implementation="moe_registry"`` and ``distributed_config=DistributedConfig(tp_size=2, ep_size=2)`` in two
gloo ranks (as torchrun starts them) runs each rank's shard of the experts on the registry's kernel, through
transformers' ``all_reduce`` and ``all_to_all`` dispatches, with the single-process model's logits and greedy
tokens; ``build(ep=2, ep_rank=r)``, what load_model builds for that dispatch, holds rank r's experts on local ids.
The tests that need transformers' dispatch are skipped by a feature check; the first test asserts the feature is
there on the transformers versions that have it, so they cannot all be skipped there."""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")  # the dev extra installs it; the core does not need it

from greedy_ties import BF16_BUDGET, assert_same_greedy_up_to_near_ties  # noqa: E402
from make_transformers_whole import make_whole_model  # noqa: E402  (tools/, on sys.path from conftest)

from moe_registry.whole.interface import NAME, register_experts_implementation  # noqa: E402
from moe_registry.whole.transformers_ep import REGISTRY, resolve, transformers_dispatch  # noqa: E402

FIRST_WITH_DISPATCH = (5, 24)  # the first transformers these tests are known to run their dispatch on
NEEDS_DISPATCH = pytest.mark.skipif(
    transformers_dispatch() is None,
    reason="the installed transformers has no expert-parallel dispatch (transformers.distributed.expert_parallel)")
FP32_TOL = 1e-5  # the same float32 sums as one process, in another order (tensor-parallel attention, the reduce)
NEW_TOKENS = 6
GENERATE = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])


def test_dispatch_detected_where_transformers_has_it() -> None:
    detected = transformers_dispatch() is not None
    if _version() >= FIRST_WITH_DISPATCH:
        assert detected, f"transformers {transformers.__version__}: its expert-parallel dispatch was not detected"
    # load_model's default follows the detection: transformers' all_to_all where it is there, the project's
    # dispatcher elsewhere and for experts called with scaled rows (not transformers' experts contract)
    assert resolve(None, 2, "contract") == ("all_to_all" if detected else REGISTRY)
    assert resolve(None, 2, "scaled_rows") == REGISTRY
    assert resolve(None, 1, "contract") == ""


def _prompts() -> torch.Tensor:
    """One batch both ranks hold (transformers' tensor-parallel ranks share their batch)."""
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(5))


def _rank(rank: int, init: str, model_dir: str, out_dir: str, ep_implementation: str, on_gpus: bool = False) -> None:
    from transformers.distributed.configuration_utils import DistributedConfig

    if on_gpus:  # transformers binds each rank to the GPU its LOCAL_RANK names, as torchrun sets it
        os.environ["LOCAL_RANK"] = str(rank)
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpus else "gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        register_experts_implementation()
        # float32, compared tightly; on the GPUs also bfloat16 (bf16_*), where the oracle picks a GPU kernel
        runs = {"": torch.float32, **({"bf16_": torch.bfloat16} if on_gpus else {})}
        for prefix, dtype in runs.items():
            config = DistributedConfig(tp_size=2, ep_size=2, ep_implementation=ep_implementation)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, experts_implementation=NAME, distributed_config=config).eval()
            prompts = _prompts().to(model.device)
            with torch.no_grad():
                logits = model(prompts).logits
            tokens = model.generate(prompts, **GENERATE)
            held = [m.__dict__["_moe_registry_experts"] for m in model.modules()
                    if "_moe_registry_experts" in m.__dict__]
            save_file({"logits": logits.float().cpu().contiguous(), "tokens": tokens.cpu().contiguous()},
                      str(Path(out_dir) / f"{prefix}rank{rank}.safetensors"))
            Path(out_dir, f"{prefix}rank{rank}.json").write_text(json.dumps(
                [{"experts": h.num_experts, "resident": h.resident_bytes, "repr": repr(h),
                  "report": h.report.to_text()} for h in held]))
    finally:
        dist.destroy_process_group()


@NEEDS_DISPATCH
@pytest.mark.parametrize("ep_implementation", ["all_reduce", "all_to_all"])
def test_transformers_expert_parallel_runs_registry_experts(ep_implementation: str, tmp_path: Path) -> None:
    """Each rank's experts module holds its 4 of 8 experts (half the single process's packed bytes) and takes the
    ids transformers' dispatch hands it: local ids, and, under all_reduce, ``num_experts`` for another rank's pair."""
    model_dir = make_whole_model("qwen3_moe", tmp_path / "qwen3_moe", layers=3)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(init, str(model_dir), str(tmp_path), ep_implementation), nprocs=2, join=True)
    register_experts_implementation()
    single = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                               experts_implementation=NAME).eval()
    prompts = _prompts()
    with torch.no_grad():
        want = single(prompts).logits
    tokens = single.generate(prompts, **GENERATE)
    whole = [m.__dict__["_moe_registry_experts"] for m in single.modules() if "_moe_registry_experts" in m.__dict__]
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        rel = float((got["logits"].double() - want.double()).norm() / want.double().norm())
        assert rel < FP32_TOL, (rank, rel)
        assert torch.equal(got["tokens"], tokens), (rank, got["tokens"].tolist(), tokens.tolist())
        held = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(held) == len(whole) == 3
        for h, w in zip(held, whole, strict=True):
            assert (h["experts"], w.num_experts) == (4, 8)
            assert h["resident"] * 2 == w.resident_bytes
            assert (f"expert parallel: 4 of 8 experts on this rank, ids from transformers' ep_dispatch_experts "
                    f"(ep_implementation {ep_implementation!r})") in h["repr"]
            assert re.search(r"tp=1 ep=2 dp=1 all2all=none", h["report"]), h["report"]
            assert "8 experts (local 4)" in h["report"], h["report"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs of one host")
@NEEDS_DISPATCH
@pytest.mark.parametrize("ep_implementation", ["all_reduce", "all_to_all"])
def test_transformers_expert_parallel_on_two_gpus_equals_one_gpu(ep_implementation: str, tmp_path: Path) -> None:
    """Two GPUs over NCCL, transformers' tensor-parallel attention and its expert-parallel dispatch, each rank's 4 of
    8 experts on the registry's kernel: in float32 one GPU's logits and greedy tokens (the model with the
    registry's experts); in bfloat16, on the oracle's GPU kernel, the logits within bfloat16's budget of one GPU's
    and the same greedy tokens up to near ties; each rank's report names the kernel and its 4 experts."""
    model_dir = make_whole_model("qwen3_moe", tmp_path / "qwen3_moe", layers=3)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(init, str(model_dir), str(tmp_path), ep_implementation, True), nprocs=2, join=True)
    register_experts_implementation()
    prompts = _prompts().to("cuda:0")
    for prefix, dtype, budget, kernel in (("", torch.float32, FP32_TOL, r"torch-reference"),
                                          ("bf16_", torch.bfloat16, BF16_BUDGET, r"triton-\S+")):
        single = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, experts_implementation=NAME, device_map="cuda:0").eval()
        with torch.no_grad():
            want = single(prompts).logits.float().cpu()
        tokens = single.generate(prompts, **GENERATE).cpu()
        for rank in range(2):
            got = load_file(str(tmp_path / f"{prefix}rank{rank}.safetensors"))
            rel = float((got["logits"].double() - want.double()).norm() / want.double().norm())
            print(f"rank {rank} {ep_implementation} {dtype}: two GPUs vs one {rel:.2e}")
            assert rel < budget, (rank, dtype, rel)
            if dtype == torch.float32:
                assert torch.equal(got["tokens"], tokens), (rank, got["tokens"].tolist(), tokens.tolist())
            else:
                assert_same_greedy_up_to_near_ties(single, got["tokens"], tokens, rank)
            held = json.loads((tmp_path / f"{prefix}rank{rank}.json").read_text())
            assert len(held) == 3
            for h in held:
                assert h["experts"] == 4 and "8 experts (local 4)" in h["report"], h["report"]
                assert re.search(rf"^kernel\s+{kernel}$", h["report"], re.M), h["report"]
                assert (f"ids from transformers' ep_dispatch_experts (ep_implementation {ep_implementation!r})"
                        in h["repr"])


def test_build_holds_one_ranks_experts_for_a_caller_that_moves_the_tokens(tmp_path: Path) -> None:
    """``build(ep=2, ep_rank=1)`` without an all2all (what load_model builds under transformers' dispatch): the
    kernel holds experts 4-7 and takes their local ids 0-3, giving the full layer's output on those experts."""
    from moe_registry.core.errors import ConfigError
    from moe_registry.layer.build import build

    model_dir = make_whole_model("qwen3_moe", tmp_path / "m", layers=2)
    options = {"layer": 1, "platform": "cpu", "dtype": "float32", "kernel": "torch-reference"}
    full = build(model_dir, **options).kernel
    local = build(model_dir, ep=2, ep_rank=1, **options)
    assert (full.num_experts, local.kernel.num_experts) == (8, 4)
    assert "8 experts (local 4)" in local.report.to_text()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 64, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)]).to(torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    torch.testing.assert_close(local.kernel(hidden, weights, ids), full(hidden, weights, ids + 4), rtol=0, atol=0)
    with pytest.raises(ConfigError, match=r"^ep_rank=1 with all2all allgather_reducescatter: the dispatcher's rank is "
                                          r"the process group's; wanted ep_rank only without an all2all$"):
        build(model_dir, ep=2, ep_rank=1, all2all="allgather_reducescatter", **options)
