"""Whole models under expert parallelism: ``load_model(..., ep=2)`` in two gloo ranks (as torchrun starts them)
gives each rank half of each layer's experts and the single-process model's logits and greedy tokens, with each
rank running its own prompt; without a process group, or with a group of another size, it is one line."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")  # the dev extra installs it; the core does not need it

from make_transformers_whole import make_whole_model  # noqa: E402  (tools/, on sys.path from conftest)

from moe_registry.core.errors import ConfigError  # noqa: E402
from moe_registry.whole.load import load_model  # noqa: E402

FP32_TOL = 1e-5  # the same float32 sums as one process, in another order (the reduce adds two partial sums)
NEW_TOKENS = 8
# every rank makes the same number of model calls (each experts call is a collective): no early stop at EOS
GENERATE = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}


def _prompts() -> torch.Tensor:
    """One prompt per rank, of different lengths' worth of content (the same shape: generate's calls line up)."""
    return torch.randint(0, 128, (2, 1, 10), generator=torch.Generator().manual_seed(3))


def _rank(rank: int, init: str, model_dir: str, out_dir: str, on_gpus: bool = False) -> None:
    backend, device = ("nccl", f"cuda:{rank}") if on_gpus else ("gloo", "cpu")
    if on_gpus:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        # on the GPUs: the oracle's kernel in bfloat16; on the CPU: the float32 reference, to compare tightly
        options = {"device": device} if on_gpus else {"dtype": "float32", "kernel": "torch-reference"}
        model = load_model(model_dir, ep=2, max_tokens=16, **options)
        prompt = _prompts()[rank].to(device)
        with torch.no_grad():
            logits = model(prompt).logits
        tokens = model.generate(prompt, **GENERATE)
        save_file({"logits": logits.float().cpu().contiguous(), "tokens": tokens.cpu().contiguous()},
                  str(Path(out_dir) / f"rank{rank}.safetensors"))
        report = model.moe_registry_report
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"text": report.to_text(), "resident": report.experts_resident_bytes,
             "stored": report.experts_checkpoint_bytes}))
    finally:
        dist.destroy_process_group()


# DeepSeek-V3 (shared experts, grouped routing, a dense first layer) with as many key/value heads as query heads:
# transformers' SDPA attention fails on its tiny config's grouped heads at batch 1
@pytest.mark.parametrize(("family", "fields"), [("qwen3_moe", {}), ("deepseek_v3", {"num_key_value_heads": 4})])
def test_two_ranks_equal_one_process(family: str, fields: dict[str, int], tmp_path: Path) -> None:
    model_dir = make_whole_model(family, tmp_path / family, layers=3, **fields)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(init, str(model_dir), str(tmp_path)), nprocs=2, join=True)
    single = load_model(model_dir, dtype="float32", kernel="torch-reference")
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        prompt = _prompts()[rank]
        with torch.no_grad():
            want = single(prompt).logits
        rel = float((got["logits"].double() - want.double()).norm() / want.double().norm())
        assert rel < FP32_TOL, (rank, rel)
        tokens = single.generate(prompt, **GENERATE)
        assert torch.equal(got["tokens"], tokens), (rank, got["tokens"].tolist(), tokens.tolist())
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert f"expert parallel: rank {rank} of 2 holds 1/2 of each layer's experts" in report["text"]
        whole = single.moe_registry_report
        assert report["stored"] == sum(p.checkpoint_bytes // 2 for p in whole.layers)
        assert report["resident"] < whole.experts_resident_bytes * 0.6


def test_ep_without_a_process_group_says_how_to_start_the_ranks(tmp_path: Path) -> None:
    model_dir = make_whole_model("qwen3_moe", tmp_path / "m", layers=2)
    with pytest.raises(ConfigError, match=r"^ep=2: no torch\.distributed process group; start 2 ranks \(torchrun "
                                          r"--nproc-per-node 2 \.\.\.\) that each call "):
        load_model(model_dir, ep=2)
    with pytest.raises(ConfigError, match=r"^ep=0: wanted a positive integer$"):
        load_model(model_dir, ep=0)
    with pytest.raises(ConfigError, match=r"^cuda_graphs=True with ep=2: "):
        load_model(model_dir, ep=2, cuda_graphs=True, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs of one host")
def test_two_gpus_equal_one_gpu(tmp_path: Path) -> None:
    """Two GPUs over NCCL, each rank half of each layer's experts on the oracle's GPU kernel in bfloat16: the logits
    within bfloat16's budget of one GPU's (the same kernel; the sums only differ in order) and the same greedy
    tokens."""
    model_dir = make_whole_model("qwen3_moe", tmp_path / "qwen3_moe", layers=3)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(init, str(model_dir), str(tmp_path), True), nprocs=2, join=True)
    single = load_model(model_dir, device="cuda:0")
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        prompt = _prompts()[rank].to("cuda:0")
        with torch.no_grad():
            want = single(prompt).logits.float().cpu()
        rel = float((got["logits"].double() - want.double()).norm() / want.double().norm())
        assert rel < 1e-2, (rank, rel)
        tokens = single.generate(prompt, **GENERATE).cpu()
        assert torch.equal(got["tokens"], tokens), (rank, got["tokens"].tolist(), tokens.tolist())
