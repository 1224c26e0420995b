"""Whole models on the decode hot path: an experts call reads nothing back on the host (so a CUDA graph can hold
it), the kernel's id checks stay for the layer API, and ``cuda_graphs`` replays captured graphs with the eager
call's outputs.

The host-read tests trace what a loaded layer's experts run for a call (the layout check and the kernel's call: what
a captured graph holds, and what the compiled step's opaque op runs) with ``torch.compile(fullgraph=True)`` (backend
eager, on the CPU): any ``int(tensor)``/``bool(tensor)`` on the path breaks the graph and fails the trace. The
layer's kernel is the torch reference, whose own loops read ids on the host, so its GEMMs are replaced by a gather
over the same dequantised weights (every pair's expert indexed on the device); outputs are held to the reference's, 1e-5
relative (float32, summation order only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from make_transformers_whole import make_whole_model  # noqa: E402  (tools/, on sys.path from conftest)
from moe_registry_kernels.activations import act_and_mul  # noqa: E402

from moe_registry.core.errors import ConfigError  # noqa: E402
from moe_registry.whole.experts_module import RegistryExperts, graph_bucket  # noqa: E402
from moe_registry.whole.load import load_model  # noqa: E402

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_whole_model("qwen3_moe", tmp_path_factory.mktemp("whole") / "qwen3_moe", layers=3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _gather_on_device(experts: RegistryExperts) -> None:
    """The layer's kernel computes each (token, slot) pair from its expert's weights picked by index on the
    device: the reference's numbers without its host-side grouping."""
    inner = experts.kernel.experts
    dense, activation = inner.dense, inner.config.activation

    def apply(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("mh,mknh->mkn", hidden.float(), dense.w13[topk_ids])
        y = torch.einsum("mki,mkhi->mkh", act_and_mul(h, activation), dense.w2[topk_ids])
        return (y * topk_weights[..., None]).sum(1).to(hidden.dtype)

    inner.apply = apply


def _layer(path: Path) -> RegistryExperts:
    model = load_model(path, dtype="float32", kernel="torch-reference")
    return next(m for m in model.modules() if isinstance(m, RegistryExperts))


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=g)


def _direct(experts):  # type: ignore[no-untyped-def]
    """The experts' call as a captured graph and the compiled step's op run it: layout check, then the kernel."""
    def call(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        experts.kernel.check_layout(x, w, ids)
        return experts._call(x, ids, w)
    return call


def test_experts_call_reads_nothing_on_the_host(qwen3: Path) -> None:
    """The whole call (layout check, kernel) traces as one graph and gives the reference's output."""
    experts = _layer(qwen3)
    x = torch.randn(6, experts.hidden_dim, generator=torch.Generator().manual_seed(0))
    ids, w = _routing(6, experts.num_experts, 2, 1)
    want = experts(x, ids, w)
    _gather_on_device(experts)
    torch._dynamo.reset()
    got = torch.compile(_direct(experts), backend="eager", fullgraph=True)(x, ids, w)
    assert _rel(got, want) < FP32_TOL


def test_expert_parallel_sentinels_are_dropped_on_the_device(qwen3: Path) -> None:
    """Under transformers' expert parallelism a slot naming another rank's expert adds nothing, and the
    substitution reads nothing on the host (one graph)."""
    experts = _layer(qwen3)
    experts._is_expert_parallel = True
    x = torch.randn(5, experts.hidden_dim, generator=torch.Generator().manual_seed(2))
    ids, w = _routing(5, experts.num_experts, 2, 3)
    alone = experts(x, ids[:, :1], w[:, :1])
    _gather_on_device(experts)
    foreign = torch.cat([ids[:, :1], torch.full((5, 1), experts.num_experts)], 1)
    torch._dynamo.reset()
    got = torch.compile(_direct(experts), backend="eager", fullgraph=True)(x, foreign, w)
    assert _rel(got, alone) < FP32_TOL


def test_layout_is_still_checked_and_the_layer_api_keeps_its_id_checks(qwen3: Path) -> None:
    """The whole-model call checks shapes (one line naming what is wrong); the kernel's own call, the layer API,
    still refuses ids out of range."""
    experts = _layer(qwen3)
    ids, w = _routing(2, experts.num_experts, 2, 4)
    with pytest.raises(ValueError, match=rf"^hidden has H = 3 but the experts have hidden size {experts.hidden_dim}$"):
        experts(torch.randn(2, 3), ids, w)
    experts.kernel.validate = True
    with pytest.raises(ValueError, match=rf"^topk_ids must be in \[0, {experts.num_experts}\)"):
        experts.kernel(torch.randn(2, experts.hidden_dim), w, ids + experts.num_experts)


def test_cuda_graphs_need_a_cuda_device(qwen3: Path) -> None:
    with pytest.raises(ConfigError, match=r"^cuda_graphs=True: the model is loaded to cpu; CUDA graphs need a CUDA "
                                          r"device$"):
        load_model(qwen3, cuda_graphs=True)
    model = load_model(qwen3, dtype="float32")
    assert model.moe_registry_report.graph_tokens == 0
    assert all(m.graph_tokens == 0 for m in model.modules() if isinstance(m, RegistryExperts))


def test_graph_buckets_pad_at_most_an_eighth() -> None:
    """Every count up to the limit replays a bucket at least as large, padded by less than 1/8 of it (none up to
    16), within the limit; a doubling of the count holds at most 8 buckets."""
    limit = 2048
    buckets = [graph_bucket(t, limit) for t in range(1, limit + 1)]
    assert buckets[:16] == list(range(1, 17))
    assert all(t <= b <= limit and (b - t) * 8 < t for t, b in zip(range(1, limit + 1), buckets, strict=True))
    for octave in range(3, 11):
        assert len({b for b in buckets if 2 ** octave < b <= 2 ** (octave + 1)}) <= 8
    assert graph_bucket(300, limit) == 320 and graph_bucket(512, limit) == 512 and graph_bucket(2047, limit) == 2048
    assert graph_bucket(300, 310) == 310


# --- on the GPU (the device machine: pytest -m gpu tests/test_whole_model_graphs.py) ---------------------------


@pytest.mark.gpu
def test_captured_graphs_replay_the_eager_outputs(qwen3: Path) -> None:
    """With cuda_graphs on (the CUDA default), decode's experts calls replay graphs captured per token count;
    logits and greedy tokens equal the model with graphs off (the same kernels, launched directly)."""
    graphs = load_model(qwen3, device="cuda")
    direct = load_model(qwen3, device="cuda", cuda_graphs=False)
    assert graphs.moe_registry_report.graph_tokens > 0 and "replay a CUDA graph" in graphs.moe_registry_report.to_text()
    vocab = graphs.config.vocab_size
    prompt = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(5)).cuda()
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = direct.generate(prompt, **kwargs)
        got = graphs.generate(prompt, **kwargs)
        again = graphs.generate(prompt, **kwargs)  # every call a replay now
        logits_got, logits_want = graphs(want).logits, direct(want).logits
    assert torch.equal(got, want) and torch.equal(again, want)
    assert _rel(logits_got, logits_want) < 1e-3
    layers = [m for m in graphs.modules() if isinstance(m, RegistryExperts)]
    assert all(2 in m.captured for m in layers)  # decode: 2 tokens a step
    assert all(not m.captured for m in direct.modules() if isinstance(m, RegistryExperts))


@pytest.mark.gpu
def test_static_cache_compiled_decode_matches_eager(qwen3: Path) -> None:
    """transformers' static cache with its compiled forward (CUDA graphs of the whole decode step) holds the
    registry's experts: the same greedy tokens as the eager model."""
    model = load_model(qwen3, device="cuda")
    prompt = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(6)).cuda()
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(prompt, **kwargs)
        got = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_bucketed_graphs_replay_the_direct_outputs(qwen3: Path) -> None:
    """Calls of counts that are not buckets replay their bucket's graph, padded with zero rows weighted 0: each
    layer equals the same layer launched directly (whose tiles may differ: the bucket's count picks them), the
    rows a larger call left behind change nothing, and every layer's graphs share one arena."""
    model = load_model(qwen3, device="cuda")
    layers = [m for m in model.modules() if isinstance(m, RegistryExperts)]
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for tokens in (300, 290, 17, 2048, 9):
            x = torch.randn(tokens, layers[0].hidden_dim, generator=gen).to("cuda", model.dtype)
            ids, w = _routing(tokens, layers[0].num_experts, layers[0].top_k, tokens)
            ids, w = ids.cuda(), w.cuda()
            for layer in layers:
                got = layer(x, ids, w)
                want = layer._call(x, ids, w.float()).to(x.dtype)
                assert _rel(got, want) < 1e-2, (tokens, layer.layer)
    assert all(m.captured == (9, 18, 320, 2048) for m in layers)
    arenas = {id(call.arena) for m in layers for call in m._graphs.values()}
    assert len(arenas) == 1
