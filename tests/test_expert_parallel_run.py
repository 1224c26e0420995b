"""Expert parallelism end to end: a rank reads only its own experts' tensors (per-expert
names, fused slices) yet gets the single-process layer's layer-wide input_scale; ``build``/``load_layer`` in gloo
ranks equal the single-process layer; ``run`` under torchrun (2 and 4 ranks) writes the single-process output and
reports per-rank experts, pairs, bytes and time; bad world sizes and ``--ep`` without torchrun are one line."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torchrun_launch import torchrun

import moe_registry
from moe_registry.checkpoint import tensor_index
from moe_registry.checkpoint.read import LAYER_WIDE, read_layer
from moe_registry.checkpoint.tensor_index import open_checkpoint
from moe_registry.cli import main as cli
from moe_registry.formats.stacked import experts_of, layer_wide_of
from moe_registry.oracle.select import select
from moe_registry.situation.config import read_model_config
from moe_registry.situation.describe import Flags, situation_for_model
from moe_registry.spec.loader import load_registry

FIX = Path(__file__).parent / "fixtures"
QUARK = FIX / "quark" / "qwen3-w8a8-int8-tensor"  # per expert, static input_scale differing per expert (Quark 0.13)
GPT_OSS = FIX / "transformers" / "tiny" / "gpt_oss"  # fused 3-D [E, ...] weights and biases (transformers)
MXFP4 = FIX / "fp4" / "gpt-oss-mxfp4"  # fused, every tensor stacked over experts (checkpoint.fused_names)
QWEN = FIX / "transformers" / "tiny" / "qwen3_moe"  # 8 experts, per expert (transformers)
BUILDS = {"quark": QUARK, "gpt_oss": GPT_OSS, "mxfp4": MXFP4}


class Spy:
    """Wraps safetensors.safe_open in moe_registry.checkpoint.tensor_index (the checkpoint's reader): records each
    tensor read whole (get_tensor) and each slice read (get_slice(...)[...]); headers (shapes, dtypes) are not
    reads."""

    def __init__(self, monkeypatch_setattr) -> None:  # type: ignore[no-untyped-def]
        self.reads: list[tuple[str, object]] = []
        real = tensor_index.safe_open
        spy = self

        class Handle:
            def __init__(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
                self._h = real(*a, **k)

            def __enter__(self):  # type: ignore[no-untyped-def]
                self._f = self._h.__enter__()
                return self

            def __exit__(self, *a):  # type: ignore[no-untyped-def]
                return self._h.__exit__(*a)

            def keys(self):  # type: ignore[no-untyped-def]
                return self._f.keys()

            def get_tensor(self, name: str) -> torch.Tensor:
                spy.reads.append((name, None))
                return self._f.get_tensor(name)

            def get_slice(self, name: str):  # type: ignore[no-untyped-def]
                sl = self._f.get_slice(name)

                class Slice:
                    def get_shape(self):  # type: ignore[no-untyped-def]
                        return sl.get_shape()

                    def get_dtype(self):  # type: ignore[no-untyped-def]
                        return sl.get_dtype()

                    def __getitem__(self, index):  # type: ignore[no-untyped-def]
                        spy.reads.append((name, (index.start, index.stop)))
                        return sl[index]
                return Slice()

        monkeypatch_setattr(tensor_index, "safe_open", Handle)


def _inputs_for(model_dir: Path, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = read_model_config(model_dir, load_registry()).shape
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(m, shape.hidden, generator=g)
    ids = torch.stack([torch.randperm(shape.num_experts, generator=g)[:shape.top_k] for _ in range(m)])
    return hidden, torch.softmax(torch.randn(m, shape.top_k, generator=g), dim=-1), ids


def _foreign_weight_reads(reads: list[tuple[str, object]], local: list[int], per_expert_prefix: str) -> list[str]:
    """Reads of another expert's tensors other than its layer-wide scalars (per-expert names), or slices
    outside this rank's rows (fused tensors stacked along dim 0, one row block per expert)."""
    bad = []
    for name, index in reads:
        expert, _, rest = name.removeprefix(per_expert_prefix).partition(".")
        if name.startswith(per_expert_prefix) and expert.isdigit():
            if int(expert) not in local and rest.rsplit(".", 1)[-1] not in LAYER_WIDE:
                bad.append(name)
        elif ".experts." in name and index is None:
            bad.append(f"{name} (whole)")
        elif ".experts." in name:
            lo, hi = index  # type: ignore[misc]
            if (lo, hi) != (min(local), max(local) + 1):
                bad.append(f"{name}[{lo}:{hi}]")
    return bad


def _rank_builds(rank: int, init: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        saved = {}
        for what, model_dir in BUILDS.items():
            mp_ = pytest.MonkeyPatch()
            spy = Spy(mp_.setattr)
            layer = moe_registry.build(model_dir, platform="cpu", dtype="float32", kernel="torch-reference", ep=2,
                                       all2all="allgather_reducescatter", max_tokens=4)
            mp_.undo()
            hidden, topk_weights, ids = _inputs_for(model_dir, 7)
            lo, hi = (0, 4) if rank == 0 else (4, 7)
            saved[f"{what}.out"] = layer.kernel(hidden[lo:hi], topk_weights[lo:hi], ids[lo:hi]).contiguous()
            for proj in ("w13", "w2"):
                scale = getattr(layer.weights, proj).input_scale
                if scale is not None:
                    saved[f"{what}.{proj}.input_scale"] = scale
            n = read_model_config(model_dir, load_registry()).shape.num_experts // 2
            local = list(range(rank * n, (rank + 1) * n))  # contiguous placement
            prefix = "model.layers.0.mlp.experts."
            Path(out_dir, f"{what}.rank{rank}.json").write_text(json.dumps(
                {"bad": _foreign_weight_reads(spy.reads, local, prefix), "reads": len(spy.reads)}))
        # load_layer: the router inside, each rank its own tokens; ep alone picks the dispatcher
        module = moe_registry.load_layer(QWEN, platform="cpu", dtype="float32", ep=2, max_tokens=3)
        hidden = _inputs_for(QWEN, 5)[0]
        saved["load_layer.out"] = module(hidden[:3] if rank == 0 else hidden[3:]).contiguous()
        save_file(saved, str(Path(out_dir) / f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def test_each_rank_reads_only_its_experts_and_equals_the_single_process_layer(tmp_path: Path) -> None:
    """Quark per-expert (input_scale differs per expert: rank 1's own largest down scale is below expert 0's),
    transformers fused 3-D and stacked MXFP4: 2 gloo ranks through build, and load_layer(ep=2)."""
    mp.spawn(_rank_builds, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    parts = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    for what, model_dir in BUILDS.items():
        for r in range(2):
            spied = json.loads((tmp_path / f"{what}.rank{r}.json").read_text())
            assert spied["reads"] > 0 and spied["bad"] == [], (what, r, spied)
        whole = moe_registry.build(model_dir, platform="cpu", dtype="float32", kernel="torch-reference")
        expected = whole.kernel(*_inputs_for(model_dir, 7))
        torch.testing.assert_close(torch.cat([p[f"{what}.out"] for p in parts]), expected, rtol=1e-5, atol=1e-5)
        for proj in ("w13", "w2"):
            scale = getattr(whole.weights, proj).input_scale
            for p in parts:
                assert (scale is None) == (f"{what}.{proj}.input_scale" not in p)
                if scale is not None:
                    assert torch.equal(p[f"{what}.{proj}.input_scale"], scale), (what, proj)
    module = moe_registry.load_layer(QWEN, platform="cpu", dtype="float32")
    torch.testing.assert_close(torch.cat([p["load_layer.out"] for p in parts]), module(_inputs_for(QWEN, 5)[0]),
                               rtol=1e-5, atol=1e-5)


def _reader_args(model_dir: Path):  # type: ignore[no-untyped-def]
    registry = load_registry()
    model = read_model_config(model_dir, registry)
    situation = situation_for_model(model, registry, Flags(platform="cpu", dtype="float32"))
    report = select(registry, situation)
    assert report.scheme is not None and situation.layer is not None and situation.runtime.shape is not None
    return (open_checkpoint(model_dir), registry.families[model.family].spec, situation.layer,
            registry.scheme(report.scheme.scheme), report.scheme.bindings, situation.runtime.shape)


@pytest.mark.parametrize("model_dir", [QUARK, GPT_OSS, MXFP4], ids=["per-expert", "fused", "fused-stacked"])
def test_the_reader_gives_the_subset_of_the_whole_layer(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """read_layer(experts=(3, 1)) holds exactly experts 3 and 1 of the whole read, in that order, reads no
    other expert's weights (per name or slice), and every expert's layer-wide scalars."""
    args = _reader_args(model_dir)
    whole = read_layer(*args)
    spy = Spy(monkeypatch.setattr)
    part = read_layer(*args, experts=(3, 1))
    mine, every = experts_of(part), experts_of(whole)
    assert part.expert_ids == (3, 1) and len(mine) == 2
    for got, e in zip(mine, (3, 1), strict=True):
        assert got.keys() == every[e].keys()
        for role in got:
            assert got[role].keys() == every[e][role].keys() and got[role]
            for t in got[role]:
                assert torch.equal(got[role][t], every[e][role][t]), (e, role, t)
    names = [n for n, _ in spy.reads]
    assert not [n for n in names if ".experts.0." in n or ".experts.2." in n
                if n.rsplit(".", 1)[-1] not in LAYER_WIDE]
    assert [i for n, i in spy.reads if i is not None and i not in ((3, 4), (1, 2))] == []
    if model_dir == QUARK:
        wide = layer_wide_of(part)
        assert len(wide) == 4
        assert all(set(w[r]) == {"input_scale"} for w in wide for r in ("gate", "up", "down"))
        assert torch.equal(wide[0]["down"]["input_scale"], every[0]["down"]["input_scale"])


@pytest.mark.parametrize("model_dir", [QUARK, GPT_OSS, MXFP4], ids=["per-expert", "fused", "fused-stacked"])
def test_the_reader_opens_each_file_once_per_layer(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's tensors are read with one open (one header parse) per file, and the files are closed after it:
    a later read opens its file again."""
    args = _reader_args(model_dir)
    opened: list[str] = []
    real = tensor_index.safe_open

    def counted(path, *a, **k):  # type: ignore[no-untyped-def]
        opened.append(path)
        return real(path, *a, **k)

    monkeypatch.setattr(tensor_index, "safe_open", counted)
    index = args[0]
    tensors = read_layer(*args)
    files = {str(i.file) for i in index.tensors.values()}
    assert experts_of(tensors) and len(opened) == len(set(opened)) and set(opened) <= files and opened
    first = opened[0]
    index.load(next(n for n, i in index.tensors.items() if str(i.file) == first))
    assert opened.count(first) == 2


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    return torchrun(n, "-m", "moe_registry", "run", *args)


def _single(tmp_path: Path, inputs: Path, capsys: pytest.CaptureFixture[str]) -> torch.Tensor:
    out = tmp_path / "one.safetensors"
    assert cli.main(["run", str(QWEN), "--platform", "cpu", "--dtype", "float32", "--inputs", str(inputs),
                     "--save-output", str(out), "--repeat", "1", "--threads", "1", "--json"]) == 0
    capsys.readouterr()
    return load_file(str(out))["output"]


@pytest.mark.parametrize("ranks,tokens,placement", [(2, 5, "contiguous"), (4, 3, "contiguous"), (2, 5, "round_robin")],
                         ids=["2-ranks", "4-ranks-one-without-tokens", "2-ranks-round-robin"])
def test_run_under_torchrun_writes_the_single_process_output(ranks: int, tokens: int, placement: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    inputs = tmp_path / "in.safetensors"
    hidden = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
    save_file({"hidden_states": hidden}, str(inputs))
    saved = tmp_path / "ep.safetensors"
    proc = _torchrun(ranks, str(QWEN), "--ep", str(ranks), "--platform", "cpu", "--dtype", "float32", "--inputs",
                     str(inputs), "--save-output", str(saved), "--repeat", "2", "--threads", "1", "--json",
                     "--expert-placement", placement)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # rank 0 alone prints
    body = json.loads(lines[0])
    result = body["result"]
    assert body["exit_code"] == 0 and result["ok"] and result["relative_error"] < 1e-6
    assert (result["world_size"], result["tokens"], result["all2all"]) == (ranks, tokens, "allgather_reducescatter")
    share = -(-tokens // ranks)
    assert result["max_tokens"] == share
    per_rank = result["ranks"]
    assert [r["rank"] for r in per_rank] == list(range(ranks))
    assert [r["experts"] for r in per_rank] == [8 // ranks] * ranks
    assert [r["tokens"] for r in per_rank] == [max(0, min(share, tokens - r * share)) for r in range(ranks)]
    assert sum(r["pairs"] for r in per_rank) == tokens * 2  # top-2: each pair computed on exactly one rank
    # each rank computed the pairs of the experts the placement gives it (the routing as one process has it)
    ids = moe_registry.load_layer(QWEN, platform="cpu", dtype="float32").route(hidden).topk_ids.reshape(-1)
    owner = ids % ranks if placement == "round_robin" else ids // (8 // ranks)
    assert [r["pairs"] for r in per_rank] == torch.bincount(owner, minlength=ranks).tolist()
    # bytes each forward hands to the collectives: one byte row per padded token (the router's int32 ids, float32
    # router weights, float32 hidden), and the reduce-scatter of world x share rows;
    # sent = (world - 1) x gathered + (world - 1) / world x scattered
    gathered, scattered = share * (2 * 4 + 2 * 4 + 64 * 4), ranks * share * 64 * 4
    for r in per_rank:
        assert (r["bytes_gathered"], r["bytes_scattered"]) == (gathered, scattered)
        assert r["bytes_sent"] == (ranks - 1) * gathered + (ranks - 1) * scattered // ranks
        assert r["median_ms"] > 0
    got = load_file(str(saved))["output"]
    expected = _single(tmp_path, inputs, capsys)
    assert got.shape == (tokens, 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_run_under_torchrun_refuses_a_world_size_that_does_not_divide_the_experts() -> None:
    proc = _torchrun(3, str(QWEN), "--ep", "3", "--platform", "cpu", "--dtype", "float32", "--tokens", "3", "--json")
    assert proc.returncode != 0
    assert proc.stdout.splitlines() == ['{"error": "--ep: 8 experts do not split evenly over ep=3", "exit_code": 2}']


def test_run_with_ep_and_no_torchrun_says_how_to_start_the_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", str(QWEN), "--platform", "cpu", "--ep", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: --ep 2: run is one process and joins no process group; start 2 ranks (e.g. "
                          "`torchrun --nproc-per-node 2 ...`)")


def test_an_unknown_expert_placement_is_one_line_with_the_closest_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", str(QWEN), "--platform", "cpu", "--ep", "2", "--expert-placement", "roundrobin"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--expert-placement" in err and "roundrobin" in err and "round_robin" in err
