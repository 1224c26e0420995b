"""Whole-model benchmark: one checkpoint per format loaded by ``moe_registry.load_model`` and by transformers' own
``from_pretrained``, side by side in one run: decode tokens/s at several batch sizes, prefill tokens/s, peak memory
and the experts' resident bytes against the checkpoint's expert bytes. Each side of each format runs in its own
process, so one side's memory never counts for the other's, and a side that fails or runs out of time costs only
its own rows.

Models: ``tiny`` (a tiny fixture family made whole, tools/make_transformers_whole.py) or ``qwen3-30b-a3b``
(Qwen3-30B-A3B's real layer shapes with random weights; ``--layers N`` decoder layers, ``--vocab`` to keep the
embedding small). Formats (random codes written as each format's producer lays them out, every decoder projection
quantized, router and lm_head left in bfloat16): ``bf16``; ``gptq`` and ``awq`` (int4, group 128); ``fp8-block``
(transformers' FineGrainedFP8, 128x128 blocks); ``nvfp4``, ``mxfp4`` and ``w8a8-int8`` (compressed-tensors).

Decode: the time from greedy ``generate``'s first new token to its last (``--new-tokens`` in all), over the steps
between, at each ``--batch`` size from a ``--context``-token prompt. Modes: ``eager`` (transformers' dynamic
cache; the registry's experts replay per-layer CUDA graphs on CUDA), ``direct`` (the registry with those graphs
off), ``static`` (transformers' static cache, whose decode steps transformers compiles into CUDA graphs on CUDA).
Prefill: one forward of ``--prefill`` tokens (batch 1, no cache). Memory: CUDA's peak allocated bytes (during the
load, and over the whole process), or on the CPU the peak RSS the load (and the load with the runs) adds.

transformers fetches some experts kernels from the Hugging Face Hub at run time (FineGrainedFP8's
``kernels-community/finegrained-fp8``); on a machine without network ``--hub-kernels DIR`` hands its transformers
sides local copies (tools/prepare_transformers.sh makes DIR from a checkout of the kernels' repository), so
transformers runs the kernel it would download. The record's header names each copy's source commit.

Every measurement is a JSON line appended to ``--out``/``<device>-whole-model.jsonl`` as soon as it is taken;
``--table FILE`` prints the markdown table of such a file (tools/perf_tables.py puts it in docs/performance.md).

    python tools/bench_model.py --model tiny --format bf16 gptq --threads 2 --batch 1 4 --prefill 64
    python tools/bench_model.py --model qwen3-30b-a3b --layers 2 --vocab 4096 --device cuda --out /tmp/bench
    python tools/bench_model.py --table /tmp/bench/cuda-whole-model.jsonl
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     intermediate_size=6144, moe_intermediate_size=768, num_local_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, max_position_embeddings=8192, rope_parameters={"rope_type": "default",
                                                                                         "rope_theta": 1e6})
FORMATS = ("bf16", "gptq", "awq", "fp8-block", "nvfp4", "mxfp4", "w8a8-int8")
MODES = ("eager", "direct", "static")
GROUP = 128  # gptq/awq group size where it divides the input size (else one group over the whole input)


# --- checkpoints: random codes in each format's layout --------------------------------------------------------


def _int32_words(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64, device=gen.device
                         ).to(torch.int32)


def _bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8, device=gen.device)


def _nibbles(value: int) -> int:
    """An int32 word holding ``value`` in each of its eight 4-bit fields."""
    word = sum(value << (4 * i) for i in range(8))
    return word - (1 << 32) if word >= 1 << 31 else word


def quantized_tensors(fmt: str, out_features: int, in_features: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear [out, in] in ``fmt``'s tensors (named by suffix), random codes and scales that give weights of
    a few hundredths: what the kernels read, at the real sizes, without a quantizer's minutes."""
    n, k = out_features, in_features
    g = GROUP if k % GROUP == 0 else k
    if fmt == "gptq":  # symmetric v1: zero points stored as 8 - 1
        return {"qweight": _int32_words((k // 8, n), gen), "qzeros": torch.full((k // g, n // 8), _nibbles(7),
                                                                                dtype=torch.int32),
                "scales": torch.full((k // g, n), 0.004, dtype=torch.float16),
                "g_idx": (torch.arange(k) // g).to(torch.int32)}
    if fmt == "awq":  # AutoAWQ GEMM: [in, out / 8] words, zero points 8
        return {"qweight": _int32_words((k, n // 8), gen), "qzeros": torch.full((k // g, n // 8), _nibbles(8),
                                                                               dtype=torch.int32),
                "scales": torch.full((k // g, n), 0.004, dtype=torch.float16)}
    if fmt == "fp8-block":
        codes = (torch.randn(n, k, generator=gen, device=gen.device) * 2).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale_inv": torch.full((-(-n // 128), -(-k // 128)), 0.01)}
    if fmt == "nvfp4":  # e2m1 codes (every byte is two valid codes) x e4m3 group scale / global scale
        return {"weight_packed": _bytes((n, k // 2), gen),
                "weight_scale": torch.ones(n, k // 16).to(torch.float8_e4m3fn),
                "weight_global_scale": torch.tensor([100.0]), "input_global_scale": torch.tensor([100.0])}
    if fmt == "mxfp4":  # e2m1 codes x 2^(e8m0 - 127) per 32
        return {"weight_packed": _bytes((n, k // 2), gen),
                "weight_scale": torch.full((n, k // 32), 127 - 7, dtype=torch.uint8)}
    if fmt == "w8a8-int8":
        return {"weight": torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8, device=gen.device),
                "weight_scale": torch.full((n, 1), 2.7e-4, dtype=torch.bfloat16)}
    raise ValueError(f"format {fmt!r}: wanted one of {', '.join(FORMATS)}")


def _compressed_tensors(fmt: str, weights: dict[str, Any], activations: dict[str, Any] | None,
                        ignore: list[str]) -> dict[str, Any]:
    """A compressed-tensors config as llm-compressor writes it (one group over every Linear)."""
    def args(a: dict[str, Any]) -> dict[str, Any]:
        return {"actorder": None, "block_structure": None, "observer": None, "observer_kwargs": {},
                "zp_dtype": None, "symmetric": True, **a}

    group = {"format": fmt, "targets": ["Linear"], "weights": args(weights), "output_activations": None,
             "input_activations": args(activations) if activations else None}
    return {"config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None, "ignore": ignore,
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}


def quantization_config(fmt: str, layers: int, in_features: int) -> dict[str, Any]:
    """``config.json``'s quantization_config for ``fmt`` (the router and lm_head left out)."""
    g = GROUP if in_features % GROUP == 0 else -1
    ignore = [f"model.layers.{i}.mlp.gate" for i in range(layers)] + ["lm_head"]
    fp4 = {"num_bits": 4, "type": "float", "dynamic": False}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ["mlp.gate"]}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                "modules_to_not_convert": None, "dequantize": False}
    if fmt == "nvfp4":
        nv = {**fp4, "group_size": 16, "strategy": "tensor_group", "scale_dtype": "torch.float8_e4m3fn"}
        return _compressed_tensors("nvfp4-pack-quantized", {**nv, "observer": "memoryless_minmax"},
                                   {**nv, "dynamic": "local", "observer": "static_minmax"}, ignore)
    if fmt == "mxfp4":
        mx = {**fp4, "group_size": 32, "strategy": "group", "scale_dtype": "torch.uint8"}
        return _compressed_tensors("mxfp4-pack-quantized", {**mx, "observer": "memoryless_minmax"},
                                   {**mx, "dynamic": True}, ignore)
    if fmt == "w8a8-int8":
        return _compressed_tensors("int-quantized", {"num_bits": 8, "type": "int", "dynamic": False, "group_size": None,
                                                     "strategy": "channel", "scale_dtype": None,
                                                     "observer": "memoryless_minmax"},
                                   {"num_bits": 8, "type": "int", "dynamic": True, "group_size": None,
                                    "strategy": "token", "scale_dtype": None}, ignore)
    raise ValueError(f"format {fmt!r}: wanted one of {', '.join(FORMATS)}")


def make_checkpoint(model: str, fmt: str, out: Path, layers: int, vocab: int | None, device: str = "cpu", *,
                    thin_source: bool = False) -> Path:
    """The benchmark checkpoint in ``fmt``: transformers' save_pretrained of a random bf16 model (made once, under
    ``out/bf16``), its decoder projections rewritten in ``fmt``; random numbers drawn on ``device``.
    ``thin_source``: thin the source (_thin) before a rewrite; it is then no bf16 checkpoint any more."""
    sys.path.insert(0, str(ROOT / "tools"))
    from make_transformers_whole import make_whole_model

    source = out / "bf16"
    if model == "tiny" and not (source / "config.json").is_file():
        # fp8's 128x128 scale blocks must not straddle gate and up: the tiny model's experts are 128 wide
        make_whole_model("qwen3_moe", source, layers=layers, moe_intermediate_size=128,
                         **({"vocab_size": vocab} if vocab else {}))
    elif not (source / "config.json").is_file():
        _random_qwen3(source, layers, vocab, device)
    if thin_source and fmt != "bf16":
        _thin(source)
    path = source if fmt == "bf16" else _rewrite(source, out / fmt, fmt, layers, device)
    if device.startswith("cuda"):  # the measuring children need the GPU memory this process drew the weights in
        gc.collect()
        torch.cuda.empty_cache()
    return path


def _random_qwen3(out: Path, layers: int, vocab: int | None, device: str) -> None:
    """Qwen3-30B-A3B's shapes with weights of std 0.02 (embeddings 1, norms 1): activations stay finite, so the
    router spreads tokens over the experts as a trained model's does, not onto the few a NaN would pick."""
    from make_transformers_whole import TINY, whole_config
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = {**whole_config(json.loads((TINY / "qwen3_moe" / "config.json").read_text()), layers), **QWEN3_30B_A3B}
    if vocab:
        raw["vocab_size"] = vocab
    raw.pop("transformers_version", None)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    gen = torch.Generator(device).manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.02, generator=gen)
    model.save_pretrained(str(out))


PROJECTION_SHAPES = "projection_shapes.json"  # a thinned source's decoder projections: name -> [shard, shape]


def _projection(name: str, shape: list[int]) -> bool:
    return name.endswith("_proj.weight") and len(shape) == 2


def _thin(src: Path) -> None:
    """The bf16 source reduced to what a rewrite copies from it: every tensor but the decoder projections, whose
    shards and shapes it records (a rewrite draws their codes at random). The source is no bf16 checkpoint after."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (src / PROJECTION_SHAPES).is_file():  # thinned for an earlier format
        return
    shapes: dict[str, list[Any]] = {}
    for f in sorted(src.glob("*.safetensors")):
        kept: dict[str, torch.Tensor] = {}
        with safe_open(str(f), "pt") as stored:
            for name in stored.keys():  # noqa: SIM118 (safe_open has no iteration)
                shape = stored.get_slice(name).get_shape()
                if _projection(name, shape):
                    shapes[name] = [f.name, shape]
                else:
                    kept[name] = stored.get_tensor(name)
        save_file(kept, str(f.with_suffix(".thin")), metadata={"format": "pt"})
        f.with_suffix(".thin").replace(f)
    (src / PROJECTION_SHAPES).write_text(json.dumps(shapes))


def _rewrite(src: Path, dst: Path, fmt: str, layers: int, device: str) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (dst / "config.json").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(0)
    thinned = json.loads((src / PROJECTION_SHAPES).read_text()) if (src / PROJECTION_SHAPES).is_file() else {}
    for f in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(f), "pt") as stored:
            names = [(name, stored.get_slice(name).get_shape()) for name in stored.keys()]  # noqa: SIM118
            names += [(name, shape) for name, (shard, shape) in thinned.items() if shard == f.name]
            for name, shape in sorted(names):
                if _projection(name, shape):
                    stem = name.removesuffix(".weight")
                    tensors.update({f"{stem}.{k}": v.cpu() for k, v in quantized_tensors(fmt, *shape, gen).items()})
                else:
                    tensors[name] = stored.get_tensor(name)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    for other in src.iterdir():
        if (other.suffix != ".safetensors" and other.name not in ("config.json", PROJECTION_SHAPES)
                and other.is_file()):
            shutil.copy(other, dst / other.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, layers, cfg["moe_intermediate_size"])
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# --- measuring, in a child process per (format, side) -----------------------------------------------------------


def _rss_peak() -> int:
    """This process's peak resident bytes (Linux VmHWM: reset at exec, unlike ru_maxrss, which a child started by
    fork and exec inherits from its parent's peak)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


class Clock:
    """Wall time of a call, the device's queue drained before and after."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def hub_kernels(folder: Path | None) -> dict[str, Any]:
    """The local copies of Hub kernels in ``folder`` (its ``kernels.json``: Hub name -> package and source)."""
    if folder is None:
        return {}
    index = folder / "kernels.json"
    if not index.is_file():
        raise SystemExit(f"--hub-kernels {folder}: no kernels.json there (tools/prepare_transformers.sh makes it)")
    return json.loads(index.read_text())


def install_hub_kernels(folder: Path | None) -> None:
    """Give transformers the local copies in ``folder`` where it would download them from the Hub: each package
    is imported and put in the table transformers' ``lazy_load_kernel`` reads first, and transformers' check for
    the ``kernels`` downloader is answered yes for the integrations that call it."""
    kernels = hub_kernels(folder)
    if not kernels:
        return
    from transformers.integrations import finegrained_fp8
    from transformers.integrations import hub_kernels as hub

    sys.path.insert(0, str(folder))
    for name, entry in kernels.items():
        hub._KERNEL_MODULE_MAPPING[name] = importlib.import_module(entry["package"])
    finegrained_fp8.is_kernels_available = lambda: True


def load(path: Path, side: str, device: str, hub_folder: Path | None = None) -> tuple[Any, dict[str, Any]]:
    """The model as ``side`` loads it (``registry``, ``transformers`` or ``transformers:<experts impl>``) and what
    the load did."""
    import transformers

    from moe_registry.whole.load import load_model

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    before = _rss_peak()
    start = time.perf_counter()
    if side == "registry":
        model = load_model(path, device=device)
        report = model.moe_registry_report
        facts: dict[str, Any] = {"experts_resident_bytes": report.experts_resident_bytes,
                                 "experts_checkpoint_bytes": report.experts_checkpoint_bytes,
                                 "kernels": sorted({p.kernel for p in report.layers}),
                                 "schemes": sorted({p.scheme for p in report.layers}),
                                 "graph_tokens": report.graph_tokens}
    else:
        install_hub_kernels(hub_folder)
        kwargs: dict[str, Any] = {"dtype": torch.bfloat16}
        if ":" in side:
            kwargs["experts_implementation"] = side.split(":", 1)[1]
        if importlib.util.find_spec("accelerate") is not None:  # transformers loads straight to the device with it
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), device_map=device, **kwargs)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(device)
        model.eval()
        facts = {"experts_implementation": getattr(model.config, "_experts_implementation", None),
                 "quantizer": type(getattr(model, "hf_quantizer", None)).__name__}
    facts["load_s"] = time.perf_counter() - start
    if device.startswith("cuda"):
        facts["load_peak_bytes"] = torch.cuda.max_memory_allocated()
    facts["load_peak_rss_bytes"] = _rss_peak() - before
    return model, facts


def _prefill_forward(model: Any, tokens: int) -> Callable[[], None]:
    """One forward of ``tokens`` random tokens (batch 1, no cache, last position's logits)."""
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, tokens),
                        generator=torch.Generator().manual_seed(1)).to(model.device)

    def forward() -> None:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return forward


def prefill_seconds(model: Any, tokens: int, clock: Clock, repeats: int = 5, least_seconds: float = 1.0) -> float:
    """Median time of one forward of ``tokens`` tokens (batch 1, no cache, last position's logits), over at least
    ``repeats`` forwards and ``least_seconds`` of them: a host-bound forward takes tens of milliseconds, and the
    median of three varied by up to 1.2x from one round to the next in one process (H200 host, 512 tokens)."""
    forward = _prefill_forward(model, tokens)
    for _ in range(2):  # the first call compiles this token count's kernels and captures its graphs
        clock(forward)
    times: list[float] = []
    while len(times) < repeats or sum(times) < least_seconds:
        times.append(clock(forward))
    return statistics.median(times)


def generate_inputs(model: Any, batch: int, context: int, new_tokens: int,
                    mode: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """A random prompt of ``batch`` x ``context`` tokens and greedy ``generate`` arguments for ``mode``."""
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (batch, context),
                        generator=torch.Generator().manual_seed(2)).to(model.device)
    kwargs: dict[str, Any] = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0,
                              "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    if mode == "static":
        kwargs["cache_implementation"] = "static"
    return ids, kwargs


def decode_step_seconds(model: Any, batch: int, context: int, new_tokens: int, mode: str,
                        clock: Clock) -> tuple[float, torch.Tensor]:
    """Seconds per decode step at ``batch`` (from the first new token to the last, over the steps between, the
    median of two runs) and the tokens generated."""
    from moe_registry.cli.generate import TokenClock

    ids, kwargs = generate_inputs(model, batch, context, new_tokens, mode)
    for _ in range(3 if mode == "static" else 1):  # compile, then CUDA graph warm-up and record, then replay
        clock(lambda: model.generate(ids, **kwargs))
    steps, made = [], None
    for _ in range(2):
        tick = TokenClock()  # puts: the prompt, then each new token as generate hands it out
        made = model.generate(ids, streamer=tick, **kwargs)
        steps.append((tick.times[-1] - tick.times[1]) / (new_tokens - 1))
    assert made is not None
    return statistics.median(steps), made[:, context:]


def measure(args: argparse.Namespace) -> None:
    """The child: load one side, then every prefill and decode cell, each line written as soon as it is taken."""
    out = Path(args.out_file)
    base = {"format": args.fmt, "side": args.side}

    def emit(kind: str, **fields: Any) -> None:
        with out.open("a") as f:
            f.write(json.dumps({"kind": kind, **base, **fields}) + "\n")

    clock = Clock(args.device)
    try:
        model, facts = load(Path(args.measure), args.side, args.device, args.hub_kernels)
    except Exception as err:  # noqa: BLE001 (any failure to load is the row's answer)
        emit("error", stage="load", error=_one_line(err))
        return
    emit("load", **facts)
    registry = args.side == "registry"
    eager_tokens: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        if registry and facts.get("graph_tokens"):
            _cell(emit, "check", {}, lambda: {"graphs_vs_direct_logits_rel_err": _graphs_error(model)})
        for tokens in args.prefill:
            _cell(emit, "prefill", {"tokens": tokens},
                  lambda t=tokens: {"tokens_per_s": t / prefill_seconds(model, t, clock)})
        if args.profile and args.prefill:  # before the decode cells, whose compiles may run past --side-timeout
            _cell(emit, "profile", {}, lambda: _profile_prefill(model, args, clock))
        for mode in args.modes:
            if mode == "direct" and not registry:
                continue
            _graphs(model, on=mode != "direct")
            for batch in args.batch:
                _cell(emit, "decode", {"mode": mode, "batch": batch},
                      lambda b=batch, m=mode: _decode_cell(model, b, args, m, clock, eager_tokens))
        if args.profile:
            _cell(emit, "profile", {}, lambda: _profile(model, args, clock))
    end = {"peak_bytes": torch.cuda.max_memory_allocated()} if args.device.startswith("cuda") else {}
    emit("end", run_peak_rss_bytes=_rss_peak(), **end)


def _decode_cell(model: Any, batch: int, args: argparse.Namespace, mode: str, clock: Clock,
                 eager_tokens: dict[int, torch.Tensor]) -> dict[str, Any]:
    """One decode cell; past the first mode, the share of its greedy tokens equal to the first mode's (on random
    weights a near tie may break either way in another kernel's rounding, on either side)."""
    step, tokens = decode_step_seconds(model, batch, args.context, args.new_tokens, mode, clock)
    cell = {"step_ms": step * 1e3, "tokens_per_s": batch / step}
    if batch in eager_tokens:
        cell["tokens_equal_first_mode"] = float((tokens == eager_tokens[batch]).float().mean())
    else:
        eager_tokens[batch] = tokens
    return cell


def _profile(model: Any, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """torch.profiler over one greedy generate (static mode where measured, else the last) at the first batch:
    the kernels' and the host's time per operator, written beside the record."""
    batch, mode = args.batch[0], "static" if "static" in args.modes else args.modes[-1]
    decode_step_seconds(model, batch, args.context, args.new_tokens, mode, clock)  # warm
    ids, kwargs = generate_inputs(model, batch, args.context, args.new_tokens, mode)
    name = Path(args.out_file).parent / f"profile-{args.fmt}-{args.side.replace(':', '-')}-{mode}-b{batch}.txt"
    # one prefill forward, then new_tokens - 1 steps
    found = _profiled(lambda: model.generate(ids, **kwargs), name, args.new_tokens, clock)
    counters = torch._dynamo.utils.counters  # what torch.compile made of the step: a break runs the rest eagerly
    return {"mode": mode, "batch": batch, **found, "graph_breaks": dict(counters["graph_break"]),
            "unique_graphs": counters["stats"]["unique_graphs"]}


def _profile_prefill(model: Any, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """torch.profiler over one prefill forward of the first prefill count, as ``prefill_seconds`` times it."""
    tokens = args.prefill[0]
    forward = _prefill_forward(model, tokens)
    clock(forward)  # warm
    name = Path(args.out_file).parent / f"profile-{args.fmt}-{args.side.replace(':', '-')}-prefill{tokens}.txt"
    return {"mode": "prefill", "batch": tokens, **_profiled(forward, name, 1, clock)}


def _profiled(fn: Callable[[], Any], name: Path, forwards: int, clock: Clock) -> dict[str, Any]:
    """Run ``fn`` (``forwards`` model forwards) under torch.profiler; the per-operator tables go to ``name``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = clock(fn)
    averages = prof.key_averages()
    name.write_text(averages.table(sort_by="self_cuda_time_total", row_limit=40) + "\n\n"
                    + averages.table(sort_by="self_cpu_time_total", row_limit=25))
    # the device's busy time against the wall time (a forward the device idles through is the host's)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # how the host put the kernels on the device: graph replays (one call runs a captured step) against single
    # launches (one host call each: a step the host launches kernel by kernel is bound by that count)
    host_calls = collections.Counter(e.name for e in prof.events() if e.name in _LAUNCH_CALLS)
    calls = {k: v / forwards for k, v in sorted(host_calls.items())}
    return {"file": name.name, "host_launch_calls_per_forward": calls,
            "wall_ms_per_forward": wall * 1e3 / forwards,
            "device_busy_ms_per_forward": sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / forwards,
            "kernels_per_forward": len(kernels) / forwards}


_LAUNCH_CALLS = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _graphs_error(model: Any) -> float:
    """Relative error of the logits with the per-layer experts graphs against without them (4 x 8 tokens)."""
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (4, 8),
                        generator=torch.Generator().manual_seed(3)).to(model.device)
    _graphs(model, on=False)
    want = model(input_ids=ids).logits.float()
    _graphs(model, on=True)
    model(input_ids=ids)  # captures
    got = model(input_ids=ids).logits.float()  # replays
    return float((got - want).norm() / want.norm())


def _graphs(model: Any, on: bool) -> None:
    """The registry's per-layer experts graphs on (as loaded) or off; transformers' model has none."""
    from moe_registry.whole.experts_module import RegistryExperts

    for m in model.modules():
        if isinstance(m, RegistryExperts):
            if not hasattr(m, "_loaded_graph_tokens"):
                m._loaded_graph_tokens = m.graph_tokens
            m.graph_tokens = m._loaded_graph_tokens if on else 0


def _cell(emit: Callable[..., None], kind: str, key: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> None:
    start = time.perf_counter()
    try:
        emit(kind, **key, **fn(), cell_s=round(time.perf_counter() - start, 1))
    except Exception as err:  # noqa: BLE001 (a cell that fails is recorded, the others still run)
        emit("error", stage=kind, **key, error=_one_line(err))


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


# --- the parent: checkpoints, children, the table --------------------------------------------------------------


def sides(fmt: str, device: str, experts: list[str]) -> list[str]:
    """The registry and transformers' own paths for ``fmt``: for bf16 on CUDA each of transformers' experts
    kernels in ``experts`` (the best one counts), else what transformers loads the checkpoint with."""
    if fmt == "bf16" and device.startswith("cuda"):
        return ["registry"] + [f"transformers:{impl}" for impl in experts]
    return ["registry", "transformers"]


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    import triton

    env: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "triton": triton.__version__, "python": platform.python_version(),
                           "compressed_tensors": importlib.util.find_spec("compressed_tensors") is not None}
    if args.hub_kernels is not None:
        env["hub_kernels"] = {name: entry["source"] for name, entry in hub_kernels(args.hub_kernels).items()}
    if args.device.startswith("cuda"):
        env["device"] = torch.cuda.get_device_name()
    else:
        env["device"] = _cpu_name()
        env["threads"] = args.threads or torch.get_num_threads()
    return env


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {len(__import__('os').sched_getaffinity(0))} cores"
    return platform.processor() or "cpu"


def run(args: argparse.Namespace) -> Path:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = out_dir / f"{args.device.split(':')[0]}-whole-model.jsonl"
    settings = {k: getattr(args, k) for k in ("model", "layers", "vocab", "device", "threads", "batch", "prefill",
                                              "context", "new_tokens", "modes", "transformers_experts", "profile",
                                              "sides")}
    settings["hub_kernels"] = args.hub_kernels is not None
    with record.open("a") as f:
        f.write(json.dumps({"kind": "header", "settings": settings, "env": environment(args)}) + "\n")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_model_"))
    # without --work, one checkpoint at a time is on disk beside the bf16 source's non-projection tensors: bf16 runs
    # first (every other format is rewritten from its source), the source is thinned before the first rewrite
    # (_thin), and each other format's checkpoint is removed once measured. A 48-layer bf16 Qwen3-30B-A3B is 57 GB, a
    # GPU machine's disk 64 GiB.
    formats = sorted(args.format, key=lambda fmt: fmt != "bf16")
    try:
        for fmt in formats:
            start = time.perf_counter()
            try:
                path = make_checkpoint(args.model, fmt, work, args.layers, args.vocab, args.device,
                                       thin_source=not args.work)
            except Exception as err:  # noqa: BLE001
                _append(record, {"kind": "error", "format": fmt, "side": "checkpoint", "error": _one_line(err)})
                continue
            # the checkpoint's dirty pages written back now: a side measured while the kernel flushes gigabytes
            # shares the host with it (the first side measured after a write ran its host-bound cells up to 1.5x
            # slower than the same code in a later process)
            os.sync()
            print(f"{fmt}: checkpoint {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            for side in sides(fmt, args.device, args.transformers_experts):
                if side.split(":", 1)[0] not in args.sides:
                    continue
                _child(args, path, fmt, side, record)
            if not args.work and fmt != "bf16":
                shutil.rmtree(path, ignore_errors=True)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return record


def _append(record: Path, line: dict[str, Any]) -> None:
    with record.open("a") as f:
        f.write(json.dumps(line) + "\n")


def run_side(cmd: list[str], log: Path, timeout: float) -> int | None:
    """Run one side's process, its output into ``log``; its return code, or None where ``timeout`` cut it off.

    The side runs in a process group of its own, stopped whole when it ends: a side cut off while torch.compile
    works leaves compile workers (processes of their own) busy for minutes, and the next side's host-bound cells
    shared the host with them (a 512-token prefill measured 1.6x slower right after such a cut)."""
    with log.open("w") as err:
        child = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode: int | None = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the workers of a side that ended too
            child.wait()
    return returncode


def _child(args: argparse.Namespace, path: Path, fmt: str, side: str, record: Path) -> None:
    cmd = [sys.executable, __file__, "--measure", str(path), "--side", side, "--fmt", fmt, "--out-file", str(record),
           "--device", args.device, "--context", str(args.context), "--new-tokens", str(args.new_tokens),
           "--batch", *map(str, args.batch), "--modes", *args.modes]
    cmd += ["--prefill", *map(str, args.prefill)]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    cmd += ["--profile"] if args.profile else []
    cmd += ["--hub-kernels", str(args.hub_kernels)] if args.hub_kernels is not None else []
    start = time.perf_counter()
    log = record.parent / f"{fmt}-{side.replace(':', '-')}.log"  # the child's messages (compile notes, warnings)
    returncode = run_side(cmd, log, args.side_timeout)
    if returncode is None:
        _append(record, {"kind": "error", "format": fmt, "side": side, "stage": "process",
                         "error": f"stopped after {args.side_timeout} s (--side-timeout)"})
    elif returncode != 0:
        last = (log.read_text().strip().splitlines() or ["no output"])[-1]
        _append(record, {"kind": "error", "format": fmt, "side": side, "stage": "process", "error": last[:300]})
    print(f"{fmt} {side}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def read_record(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, lines) of a record; a later header's settings win (one run appended per call)."""
    header: dict[str, Any] = {}
    lines = []
    for text in path.read_text().splitlines():
        if not text.strip():
            continue
        line = json.loads(text)
        if line["kind"] == "header":
            header = line
        else:
            lines.append(line)
    return header, lines


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}" if n >= 2**24 else f"{n / 2**20:.2f}"


def _best(cells: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    return max(cells, key=lambda c: c["tokens_per_s"], default=None)


def table(lines: list[dict[str, Any]], batches: list[int], prefills: list[int]) -> str:
    """Markdown: a row per format and side (transformers' experts kernels folded into its best per cell), decode
    tok/s per batch (best mode, named), prefill tok/s, peak memory, load seconds, experts' bytes; the registry's
    decode cells carry their ratio to transformers' best on the same checkpoint, or, where transformers cannot
    load it, to transformers' best on the bf16 checkpoint (marked bf16)."""
    formats = list(dict.fromkeys(line["format"] for line in lines))
    head = (["format", "loaded by"] + [f"decode tok/s, batch {b}" for b in batches]
            + [f"prefill tok/s, {p}" for p in prefills] + ["peak memory", "load", "experts resident / checkpoint"])
    rows = []

    def cells(fmt: str, registry: bool, kind: str, **key: Any) -> list[dict[str, Any]]:
        return [c for c in lines if c["format"] == fmt and c["kind"] == kind and (c["side"] == "registry") == registry
                and all(c.get(k) == v for k, v in key.items())]

    def transformers_ran(fmt: str) -> bool:
        return any(c["format"] == fmt and c["kind"] == "decode" and c["side"] != "registry" for c in lines)

    for fmt in formats:
        for registry in (True, False):
            loads = cells(fmt, registry, "load")
            errors = [c for c in cells(fmt, registry, "error") if c.get("stage") in ("load", "process")]
            who = "moe-registry" if registry else "transformers"
            if not loads:
                why = errors[0]["error"] if errors else "not run"
                rows.append([fmt, who, f"not loaded: {why}"] + [""] * (len(head) - 3))
                continue
            row = [fmt, who + ("" if registry else " (" + ", ".join(
                sorted({str(c.get("experts_implementation")) for c in loads})) + ")")]
            failed = cells(fmt, registry, "error")
            if failed and not cells(fmt, registry, "decode") and not cells(fmt, registry, "prefill"):
                rows.append(row + [f"loaded, but every run failed: {failed[0]['error']}"] + [""] * (len(head) - 3))
                continue
            for b in batches:
                best = _best(cells(fmt, registry, "decode", batch=b))
                if best is None:
                    row.append("-")
                    continue
                text = f"{best['tokens_per_s']:.0f} ({best['mode']})"
                if registry:
                    base_fmt = fmt if transformers_ran(fmt) else "bf16"
                    theirs = _best(cells(base_fmt, False, "decode", batch=b))
                    if theirs:
                        text += f", {best['tokens_per_s'] / theirs['tokens_per_s']:.2f}x" + (
                            "" if base_fmt == fmt else " bf16")
                row.append(text)
            for p in prefills:
                best = _best(cells(fmt, registry, "prefill", tokens=p))
                row.append(f"{best['tokens_per_s']:.0f}" if best else "-")
            peaks = [(c.get("peak_bytes") or c.get("run_peak_rss_bytes", 0), c["side"].partition(":")[2])
                     for c in cells(fmt, registry, "end")]
            row.append(", ".join(f"{b / 2**30:.2f} GiB" + (f" {impl}" if impl and len(peaks) > 1 else "")
                                 for b, impl in peaks) or "-")
            row.append(", ".join(f"{c['load_s']:.1f} s" for c in loads if "load_s" in c) or "-")
            held = next((c for c in loads if "experts_resident_bytes" in c), None)
            row.append(f"{_mib(held['experts_resident_bytes'])} / {_mib(held['experts_checkpoint_bytes'])} MiB "
                       f"({', '.join(held['kernels'])})" if held else "")
            rows.append(row)
    lines_md = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines_md += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines_md) + "\n"


def modes_table(lines: list[dict[str, Any]], batches: list[int]) -> str:
    """The registry's decode tok/s per mode: per-layer experts graphs (eager), none (direct), or transformers'
    compiled static-cache step (static); a mode's greedy tokens against the first mode's where they differ."""
    formats = list(dict.fromkeys(c["format"] for c in lines if c["kind"] == "decode" and c["side"] == "registry"))
    modes = [m for m in MODES if any(c.get("mode") == m for c in lines)]
    head = ["format", "mode"] + [f"batch {b}" for b in batches]
    rows = []
    for fmt in formats:
        for mode in modes:
            got = {c["batch"]: c for c in lines if c["kind"] == "decode" and c["side"] == "registry"
                   and c["format"] == fmt and c["mode"] == mode}
            if got:
                rows.append([fmt, mode] + [_mode_cell(got[b]) if b in got else "-" for b in batches])
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def graphs_note(lines: list[dict[str, Any]]) -> str:
    """The per-layer experts graphs' check: logits with them against without them."""
    checks = [c["graphs_vs_direct_logits_rel_err"] for c in lines if c["kind"] == "check"]
    return (f"\nLogits with the per-layer experts graphs against without them: relative error at most "
            f"{max(checks):.1e}.\n" if checks else "")


def _mode_cell(cell: dict[str, Any]) -> str:
    """tok/s, and the share of greedy tokens equal to the first mode's where not all are."""
    same = cell.get("tokens_equal_first_mode")
    return f"{cell['tokens_per_s']:.0f}" + (f" ({same:.0%} same tokens)" if same is not None and same < 1 else "")


def profile_table(lines: list[dict[str, Any]]) -> str:
    """Where a profiled forward's time goes, per side: the wall time of a forward against the device's busy
    time in it (the rest is the host's and the gaps between kernels), and how the host put the kernels there."""
    profiles = [c for c in lines if c["kind"] == "profile" and "wall_ms_per_forward" in c]
    if not profiles:
        return ""
    head = ["format", "side", "mode, batch or tokens", "wall ms / forward", "device busy ms / forward",
            "kernels / forward", "graph replays / forward", "single launches / forward"]
    rows = []
    for c in profiles:
        calls = c.get("host_launch_calls_per_forward", {})
        single = sum(v for k, v in calls.items() if k != "cudaGraphLaunch")
        rows.append([c["format"], c["side"], f"{c['mode']}, {c['batch']}", f"{c['wall_ms_per_forward']:.2f}",
                     f"{c['device_busy_ms_per_forward']:.2f}", f"{c['kernels_per_forward']:.0f}",
                     f"{calls.get('cudaGraphLaunch', 0):.2f}", f"{single:.0f}"])
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    prefill = (" and one profiled prefill forward (mode prefill)" if any(c["mode"] == "prefill" for c in profiles)
               else "")
    lines = "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    return (f"\nOne profiled `generate` per side (a forward is the prefill or one decode step){prefill}; the "
            f"profiler's own cost is in the wall time:\n\n{lines}\n")


def markdown(path: Path) -> str:
    header, lines = read_record(path)
    settings = header.get("settings", {})
    batches = settings.get("batch") or sorted({c["batch"] for c in lines if c["kind"] == "decode"})
    prefills = settings.get("prefill") or sorted({c["tokens"] for c in lines if c["kind"] == "prefill"})
    modes = {c["mode"] for c in lines if c["kind"] == "decode" and c["side"] == "registry"}
    by_mode = ("\nThe registry's decode by mode (tok/s):\n\n" + modes_table(lines, batches)
               if len(modes) > 1 else "")  # with one mode, the main table holds its cells already
    return table(lines, batches, prefills) + by_mode + graphs_note(lines) + profile_table(lines)


def command(settings: dict[str, Any], formats: list[str]) -> str:
    """The command line that measures a record with these settings."""
    parts = ["python tools/bench_model.py", f"--model {settings['model']}", f"--layers {settings['layers']}"]
    parts += [f"--vocab {settings['vocab']}"] if settings.get("vocab") else []
    parts += [f"--device {settings['device']}"] + ([f"--threads {settings['threads']}"] if settings.get("threads")
                                                   else [])
    parts += ["--format " + " ".join(formats), "--batch " + " ".join(map(str, settings["batch"]))]
    parts += ["--prefill " + " ".join(map(str, settings["prefill"]))] if settings.get("prefill") else []
    parts += [f"--context {settings['context']}", f"--new-tokens {settings['new_tokens']}",
              "--modes " + " ".join(settings["modes"])]
    experts = settings.get("transformers_experts")
    parts += ["--transformers-experts " + " ".join(experts)] if experts and experts != ["grouped_mm", "batched_mm"] \
        else []
    parts += ["--profile"] if settings.get("profile") else []
    parts += ["--hub-kernels HUB_KERNELS"] if settings.get("hub_kernels") else []
    parts += ["--out OUT"]
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "qwen3-30b-a3b"], default="tiny")
    p.add_argument("--format", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the model's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads in each measuring process")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64], help="decode batch sizes")
    p.add_argument("--prefill", type=int, nargs="*", default=[512, 4096], help="prefill token counts (batch 1)")
    p.add_argument("--context", type=int, default=32, help="prompt tokens before decode (default 32)")
    p.add_argument("--new-tokens", dest="new_tokens", type=int, default=16, help="decode steps + 1 (default 16)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["eager", "static"])
    p.add_argument("--out", default="bench_out", help="dir the JSON-lines record is appended to")
    p.add_argument("--work", help="dir for the checkpoints (kept; default: a temporary dir, removed)")
    p.add_argument("--side-timeout", dest="side_timeout", type=float, default=900,
                   help="seconds one side of one format may take (default 900)")
    p.add_argument("--transformers-experts", dest="transformers_experts", nargs="+",
                   default=["grouped_mm", "batched_mm"], help="transformers' experts kernels run on the bf16 "
                   "checkpoint on CUDA (default: grouped_mm batched_mm)")
    p.add_argument("--sides", nargs="+", choices=["registry", "transformers"], default=["registry", "transformers"],
                   help="which sides to measure (default both: a later call can measure one side again, e.g. with a "
                   "longer --side-timeout, its lines appended to the same record)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one decode run (static mode where measured, first batch) and one prefill "
                   "forward (first count) with torch.profiler, beside the record")
    p.add_argument("--hub-kernels", dest="hub_kernels", type=Path, metavar="DIR",
                   help="local copies of the Hub kernels transformers downloads (kernels.json inside)")
    p.add_argument("--table", type=Path, metavar="RECORD", help="print the markdown tables of a record and exit")
    p.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--fmt", help=argparse.SUPPRESS)
    p.add_argument("--out-file", dest="out_file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.table is not None:
        print(markdown(args.table), end="")
        return 0
    if args.measure is not None:
        measure(args)
        return 0
    record = run(args)
    print(markdown(record), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
