"""Whole models under expert parallelism: ``load_model(..., ep=2)`` in two gloo ranks (as torchrun starts them)
gives each rank half of each layer's experts and the single-process model's logits and greedy tokens, with each
rank running its own prompt, on the project's dispatcher and on transformers' own (where the installed transformers
has it); the load report names the one that ran. Without a process group, with a group of another size, with
experts that do not split over the ranks or with a dispatch that cannot run there, it is one line."""

from __future__ import annotations

import json
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

from moe_registry.core.errors import ConfigError  # noqa: E402
from moe_registry.whole import transformers_ep  # noqa: E402
from moe_registry.whole.load import load_model  # noqa: E402
from moe_registry.whole.transformers_ep import transformers_dispatch  # noqa: E402

# transformers' own dispatch where the installed transformers has it (test_whole_model_ep_transformers.py asserts
# that it does from the version that brought it): checked by feature, never by version
NEEDS_DISPATCH = pytest.mark.skipif(
    transformers_dispatch() is None,
    reason="the installed transformers has no expert-parallel dispatch (transformers.distributed.expert_parallel)")

FP32_TOL = 1e-5  # the same float32 sums as one process, in another order (the reduce adds two partial sums)
NEW_TOKENS = 8
# every rank makes the same number of model calls (each experts call is a collective): no early stop at EOS
GENERATE = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}


def _prompts() -> torch.Tensor:
    """One prompt per rank, of different lengths' worth of content (the same shape: generate's calls line up)."""
    return torch.randint(0, 128, (2, 1, 10), generator=torch.Generator().manual_seed(3))


def _rank(rank: int, init: str, model_dir: str, out_dir: str, on_gpus: bool = False,
          ep_implementation: str | None = None) -> None:
    backend, device = ("nccl", f"cuda:{rank}") if on_gpus else ("gloo", "cpu")
    if on_gpus:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        # the float32 reference kernel, compared tightly; on the GPUs also the oracle's kernel in bfloat16 (bf16_*)
        runs = {"": {"dtype": "float32", "kernel": "torch-reference"}, **({"bf16_": {}} if on_gpus else {})}
        for prefix, options in runs.items():
            model = load_model(model_dir, device=device, ep=2, max_tokens=16, ep_implementation=ep_implementation,
                               **options)
            prompt = _prompts()[rank].to(device)
            with torch.no_grad():
                logits = model(prompt).logits
            tokens = model.generate(prompt, **GENERATE)
            save_file({"logits": logits.float().cpu().contiguous(), "tokens": tokens.cpu().contiguous()},
                      str(Path(out_dir) / f"{prefix}rank{rank}.safetensors"))
            report = model.moe_registry_report
            Path(out_dir, f"{prefix}rank{rank}.json").write_text(json.dumps(
                {"text": report.to_text(), "resident": report.experts_resident_bytes,
                 "stored": report.experts_checkpoint_bytes, "ep_implementation": report.ep_implementation,
                 "modules": [repr(m) for m in model.modules() if type(m).__name__ == "RegistryExperts"]}))
    finally:
        dist.destroy_process_group()


# what moves the tokens, in the load report's words
SAYS = {"moe_registry": "every rank's tokens are gathered, and their sums reduced back (ep_implementation "
                        "'moe_registry': the allgather_reducescatter dispatcher)",
        "all_to_all": "transformers' expert parallelism moves the tokens (ep_dispatch_experts, ep_implementation "
                      "'all_to_all': AllToAllEP)"}


# DeepSeek-V3 (shared experts, grouped routing, a dense first layer) with as many key/value heads as query heads:
# transformers' SDPA attention fails on its tiny config's grouped heads at batch 1. CI runs each dispatch on
# qwen3_moe and the project's on deepseek_v3; transformers' dispatch on deepseek_v3 runs no other code of ours
# (tools/run_slow_tests.sh runs it)
DEEPSEEK = ("deepseek_v3", {"num_key_value_heads": 4})


@pytest.mark.parametrize(("family", "fields", "ep_implementation"), [
    ("qwen3_moe", {}, "moe_registry"), pytest.param("qwen3_moe", {}, "all_to_all", marks=NEEDS_DISPATCH),
    (*DEEPSEEK, "moe_registry"), pytest.param(*DEEPSEEK, "all_to_all", marks=[NEEDS_DISPATCH, pytest.mark.slow])])
def test_two_ranks_equal_one_process(family: str, fields: dict[str, int], ep_implementation: str,
                                     tmp_path: Path) -> None:
    model_dir = make_whole_model(family, tmp_path / family, layers=3, **fields)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(init, str(model_dir), str(tmp_path), False, ep_implementation), nprocs=2, join=True)
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
        assert f"expert parallel: rank {rank} of 2 holds 1/2 of each layer's experts; {SAYS[ep_implementation]}" \
            in report["text"]
        assert report["ep_implementation"] == ep_implementation
        if ep_implementation != "moe_registry":  # each experts module says whose experts it holds
            first = rank * 4
            assert report["modules"] and all(
                f"expert parallel: rank {rank} of 2, experts {first}-{first + 3} of 8, ids from transformers' "
                f"ep_dispatch_experts (ep_implementation {ep_implementation!r})" in m for m in report["modules"])
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
    for dispatch in ("moe_registry", None):  # checked before the process group is looked for
        with pytest.raises(ConfigError, match=rf"^ep=3: {re.escape(str(model_dir / 'config.json'))} gives 8 experts "
                                              r"per MoE layer, which do not split evenly over 3 ranks; wanted ep "
                                              r"dividing 8$"):
            load_model(model_dir, ep=3, ep_implementation=dispatch)
    with pytest.raises(ConfigError, match=r"^ep_implementation=2: wanted a name, e\.g\. 'moe_registry' or "
                                          r"'all_to_all'$"):
        load_model(model_dir, ep=2, ep_implementation=2)  # type: ignore[arg-type]


def test_ep_with_a_group_of_another_size_says_both(tmp_path: Path) -> None:
    model_dir = make_whole_model("qwen3_moe", tmp_path / "m", layers=2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        for dispatch in ("moe_registry", None):
            with pytest.raises(ConfigError, match=r"^ep=2, but the process group has 1 ranks; wanted 2$"):
                load_model(model_dir, ep=2, ep_implementation=dispatch)
        # without expert parallelism the group is not read, and the dispatch named for it is not used
        report = load_model(model_dir, ep=1, ep_implementation="all_to_all").moe_registry_report
        assert (report.ep_size, report.ep_implementation) == (1, "")
        assert "expert parallel" not in report.to_text()
    finally:
        dist.destroy_process_group()


@NEEDS_DISPATCH
def test_ep_refuses_dispatches_it_cannot_run(tmp_path: Path) -> None:
    """A name transformers has not registered, and transformers' all_reduce, which runs each rank's experts on one
    batch every rank holds (load_model's ranks hold their own tokens: it would add other ranks' sums to this
    rank's): refused before the process group is looked for, naming what fits."""
    model_dir = make_whole_model("qwen3_moe", tmp_path / "m", layers=2)
    with pytest.raises(ConfigError, match=r"^ep_implementation='alltoall': not a registered dispatch; wanted one of "
                                          r"'moe_registry', .*'all_to_all'"):
        load_model(model_dir, ep=2, ep_implementation="alltoall")
    with pytest.raises(ConfigError, match=r"^ep_implementation='all_reduce': transformers' AllReduceEP needs every "
                                          r"rank to hold the same batch, and load_model's ranks run their own tokens; "
                                          r"wanted one of 'moe_registry', .*'all_to_all'"):
        load_model(model_dir, ep=2, ep_implementation="all_reduce")


def test_ep_on_a_transformers_without_its_dispatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where transformers has no expert-parallel dispatch, naming one is one line and the default is the
    project's dispatcher."""
    monkeypatch.setattr(transformers_ep, "transformers_dispatch", lambda: None)
    model_dir = make_whole_model("qwen3_moe", tmp_path / "m", layers=2)
    with pytest.raises(ConfigError, match=rf"^ep_implementation='all_to_all': transformers "
                                          rf"{re.escape(transformers.__version__)} has no expert-parallel dispatch "
                                          r"\(transformers\.distributed\.expert_parallel\.EPImplementation\); "
                                          r"wanted ep_implementation='moe_registry'$"):
        load_model(model_dir, ep=2, ep_implementation="all_to_all")
    assert transformers_ep.resolve(None, 2, "contract") == "moe_registry"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs of one host")
@pytest.mark.parametrize("ep_implementation", ["moe_registry", pytest.param("all_to_all", marks=NEEDS_DISPATCH)])
def test_two_gpus_equal_one_gpu(ep_implementation: str, tmp_path: Path) -> None:
    """Two GPUs over NCCL, each rank half of each layer's experts, the tokens moved by the project's dispatcher or
    by transformers' AllToAllEP: in float32 (the reference kernel) one GPU's logits and greedy tokens; in bfloat16
    on the oracle's GPU kernel, the logits within bfloat16's budget of one GPU's and the same greedy tokens up to
    near ties."""
    model_dir = make_whole_model("qwen3_moe", tmp_path / "qwen3_moe", layers=3)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(init, str(model_dir), str(tmp_path), True, ep_implementation), nprocs=2, join=True)
    single32 = load_model(model_dir, device="cuda:0", dtype="float32", kernel="torch-reference", cuda_graphs=False)
    single = load_model(model_dir, device="cuda:0")
    for rank in range(2):
        prompt = _prompts()[rank].to("cuda:0")
        got32, got = (load_file(str(tmp_path / f"{p}rank{rank}.safetensors")) for p in ("", "bf16_"))
        with torch.no_grad():
            want32, want = (m(prompt).logits.float().cpu() for m in (single32, single))
        print(f"rank {rank} {ep_implementation}: float32 two GPUs vs one {_rel(got32['logits'], want32):.2e}; "
              f"bfloat16 two GPUs vs one {_rel(got['logits'], want):.2e}, two vs float32 "
              f"{_rel(got['logits'], want32):.2e}, one vs float32 {_rel(want, want32):.2e}")
        assert _rel(got32["logits"], want32) < FP32_TOL, (rank, _rel(got32["logits"], want32))
        assert torch.equal(got32["tokens"], single32.generate(prompt, **GENERATE).cpu()), rank
        assert _rel(got["logits"], want) < BF16_BUDGET, (rank, _rel(got["logits"], want))
        assert_same_greedy_up_to_near_ties(single, got["tokens"], single.generate(prompt, **GENERATE).cpu(), rank)
        for prefix, kernel in (("", "torch-reference"), ("bf16_", single.moe_registry_report.layers[0].kernel)):
            report = json.loads((tmp_path / f"{prefix}rank{rank}.json").read_text())
            assert report["ep_implementation"] == ep_implementation and SAYS[ep_implementation] in report["text"]
            assert all(f"kernel={kernel}" in m for m in report["modules"]), (kernel, report["modules"])
    assert single.moe_registry_report.layers[0].kernel.startswith("triton-")
