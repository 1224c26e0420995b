"""Old against new Triton MoE kernels, in one process: bit-identical outputs and layer timings.

A refactor of ``kernels/`` (the ``moe_registry_kernels`` package) must leave every output bit for
bit as it was and cost no speed. This loads a copy of the old package next to the current one
(renamed ``moe_registry_kernels_old``, its custom ops under ``torch.ops.moe_registry_old``), runs
both on the same inputs and compares the outputs with ``torch.equal``:

- every conformance case the specs give the Triton kernels (all shipped schemes' weight and
  activation keys, each declared option), at M = 1, 8, 64, 512 in bfloat16 and float16, E=8,
  H=512, I=256 (weights from quant_ref, a fixed seed per case id);
- the benchmark's schemes at its model shapes (tuned tile configs: swapped operands, split-K),
  M = 1, 8, 64, 512, bfloat16, weights quantised on the GPU.

Cases are spread over ``--workers`` processes (compilation is the slow part). Then ``--time``
times chosen cells old and new alternately (CUDA graphs of 8 layer calls, the median of rounds).
Writes identity.json (per case: equal, sha256 of both outputs) and timing.json under --out (and, as
they come, identity.jsonl per finished chunk and timing.jsonl per timed cell, so a run cut off keeps them), and
the conformance cases' outputs (old_outputs.safetensors, new_outputs.safetensors) under --save.

    git archive OLD_COMMIT kernels | tar -x -C /tmp/old     # the kernels before the change
    python3 tools/kernel_identity.py --old /tmp/old/kernels --out /tmp/identity --time

The old package may be laid out differently from the current one (a module split): a class the
current specs name is looked up in the old package's modules by its name.

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import multiprocessing
import re
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path

import torch

OLD_NAME = "moe_registry_kernels_old"
MS = (1, 8, 64, 512)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# the benchmark's shapes (experts, top-k, hidden, intermediate) and schemes (weight, activation key)
MODEL_SHAPES = {"mixtral": (8, 2, 4096, 14336), "qwen3": (128, 8, 2048, 768), "dsv2lite": (64, 6, 2048, 1408)}
MODEL_SCHEMES = {
    "bf16": ("unquantized", "unquantized"),
    "awq": ("uint4 scale:float16:group(128):static zp:group", "unquantized"),
    "gptq4": ("uint4b8 scale:float16:group(128):static", "unquantized"),
    "int8wo": ("uint8b128 scale:float16:group(128):static", "unquantized"),
    "w8a8": ("int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic"),
    "mxfp8": ("fp8e4m3 scale:e8m0:block(1x32):static", "fp8e4m3 scale:e8m0:block(1x32):dynamic"),
    "mxfp8-a16": ("fp8e4m3 scale:e8m0:block(1x32):static", "unquantized"),
    "fp8block": ("fp8e4m3 scale:float32:block(128x128):static", "fp8e4m3 scale:float32:group(128):dynamic"),
}
TIMED_SHAPES = ("qwen3", "mixtral")
TIMED_MS = (1, 8, 64, 512)
GRAPH_CALLS = 8
MODEL_WORKERS = 3
CHUNKS_PER_WORKER = 8
DEVICE = "cuda"  # --device cpu: a smoke test of this tool under TRITON_INTERPRET=1
EXPERTS = "moe_registry_kernels.triton.experts:TritonExperts"


def install_old(old_dir: Path) -> Path:
    """Copy the old package to a temporary folder as OLD_NAME (imports and op names renamed)."""
    root = Path(tempfile.mkdtemp(prefix="old_kernels_"))
    dest = root / OLD_NAME
    shutil.copytree(old_dir, dest)
    for path in dest.rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bmoe_registry_kernels\b", OLD_NAME, text)
        text = text.replace('"moe_registry::', '"moe_registry_old::').replace("torch.ops.moe_registry.",
                                                                           "torch.ops.moe_registry_old.")
        path.write_text(text)
    return root


def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


def conformance_cases() -> list:
    from moe_registry.spec.loader import load_registry
    from moe_registry.testing.conformance import Sizes, cases_for

    registry = load_registry()
    kernels = [k for k in registry.kernels if registry.kernel(k).impl.startswith("moe_registry_kernels.triton")]
    cases, seen = [], set()
    for case in cases_for(registry, kernels=kernels, dtypes=list(DTYPES), sizes=Sizes(8, 2, 512, 256, MS)):
        for dtype in DTYPES:
            if dtype not in registry.kernel(case.kernel).dtypes:
                continue
            c = replace(case, dtype=dtype)
            if c.id not in seen:
                seen.add(c.id)
                cases.append(("conformance", c))
    return cases


def model_cases() -> list:
    return [("model", (shape, scheme, m)) for shape in MODEL_SHAPES for scheme in MODEL_SCHEMES for m in MS]


def _case_id(kind: str, case) -> str:
    return case.id if kind == "conformance" else "model-{}-{}-M{}".format(*case)


def _classes(impl: str):
    """(old class, new class) of a kernel spec's impl (the current specs' path). The old package may
    keep the class in another module (its layout before a split): then the first of its modules,
    CPU kernels left out, that defines a class of that name."""
    import importlib

    module, name = impl.split(":")
    new = getattr(importlib.import_module(module), name)
    try:
        old = getattr(importlib.import_module(module.replace("moe_registry_kernels", OLD_NAME)), name)
    except (ImportError, AttributeError):
        old = _old_class(name)
    return old, new


def _old_class(name: str):
    """The class ``name`` from whichever module of the old package defines it."""
    import importlib
    import pkgutil

    package = importlib.import_module(OLD_NAME)
    for info in pkgutil.walk_packages(package.__path__, OLD_NAME + "."):
        if "cpu_" in info.name:
            continue
        cls = getattr(importlib.import_module(info.name), name, None)
        if isinstance(cls, type):
            return cls
    raise SystemExit(f"the old kernels at {package.__path__} define no class {name}")


def _model_weights(shape: str, scheme: str, seed: int = 0):
    from moe_registry_kernels.quant_ref import quantize_weight_to_layout, static_input_scale

    from moe_registry.core.keys import parse_quant_key
    from moe_registry.formats.weights import ExpertWeights

    e, _, h, i = MODEL_SHAPES[shape]
    wkey, akey = (parse_quant_key(k) for k in MODEL_SCHEMES[scheme])
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    p13 = quantize_weight_to_layout(torch.randn(e, 2 * i, h, generator=gen, device=DEVICE) / math.sqrt(h), wkey,
                                    dtype=torch.bfloat16)
    p2 = quantize_weight_to_layout(torch.randn(e, h, i, generator=gen, device=DEVICE) / math.sqrt(i), wkey,
                                   dtype=torch.bfloat16)
    s = static_input_scale(akey, 6.0)
    if s is not None:
        p13, p2 = replace(p13, input_scale=s.to(DEVICE)), replace(p2, input_scale=s.to(DEVICE))
    return ExpertWeights(p13, p2, wkey, akey)


def _model_inputs(shape: str, m: int, seed: int):
    e, top_k, h, _ = MODEL_SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, h, generator=gen, device=DEVICE).to(torch.bfloat16)
    tw, ti = torch.topk(torch.softmax(torch.randn(m, e, generator=gen, device=DEVICE), -1), top_k, -1)
    return x, tw, ti.to(torch.int32)


def run_conformance(case):
    """(old output, new output) of one conformance case, as tests/test_conformance.py runs it. The
    batched format compares the experts' output [E, T, H] itself: finalize sums the top-k rows with
    index_add_, whose atomics on a GPU add in any order (not bit-reproducible, old or new)."""
    from moe_registry_kernels.quant_ref import make_random_expert_weights

    from moe_registry.layer.experts import ExpertsConfig
    from moe_registry.layer.modular import BatchedLocalPrepareFinalize, FusedMoEKernel, LocalPrepareFinalize
    from moe_registry.spec.loader import load_registry

    seed = _seed(case.id)
    dtype = DTYPES[case.dtype]
    weights = make_random_expert_weights(case.weight_key, case.activation_key, num_experts=case.num_experts,
                                         hidden=case.hidden, intermediate=case.intermediate, dtype=dtype,
                                         bias=case.bias, act_order=case.act_order, seed=seed).to(DEVICE)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype).to(DEVICE)
    allowed = torch.arange(case.skip_experts, case.num_experts)
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:case.top_k]]
                       for _ in range(case.tokens)]).to(torch.int32).to(DEVICE)
    tw = torch.rand(case.tokens, case.top_k, generator=gen) + 0.1
    tw = (tw / tw.sum(-1, keepdim=True)).to(DEVICE)
    config = ExpertsConfig(activation=case.activation, apply_router_weight_on_input=case.router_weight_on_input,
                           activation_format=case.activation_format)
    outs = []
    for cls in _classes(load_registry().kernel(case.kernel).impl):
        experts = cls(weights, config)
        if case.activation_format == "batched":
            pf = BatchedLocalPrepareFinalize(case.num_experts)
            prepared = pf.prepare(x, tw, ids, apply_router_weight_on_input=case.router_weight_on_input)
            outs.append(experts.apply_batched(prepared.hidden, prepared.expert_num_tokens))
        else:
            outs.append(FusedMoEKernel(LocalPrepareFinalize(), experts)(x, tw, ids))
    return outs


_MODEL_CACHE: dict = {}


def run_model(shape: str, scheme: str, m: int):
    from moe_registry.layer.experts import ExpertsConfig

    if (shape, scheme) not in _MODEL_CACHE:
        _MODEL_CACHE.clear()
        torch.cuda.empty_cache()
        weights = _model_weights(shape, scheme)
        _MODEL_CACHE[(shape, scheme)] = [cls(weights, ExpertsConfig())
                                         for cls in _classes(EXPERTS)]
    x, tw, ti = _model_inputs(shape, m, seed=m)
    return [kernel.apply(x, tw, ti) for kernel in _MODEL_CACHE[(shape, scheme)]]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def worker(args: tuple) -> tuple[list[dict], dict]:
    global DEVICE
    old_root, cases, DEVICE = args
    if str(old_root) not in sys.path:  # once per worker process (it takes many chunks)
        logging.getLogger("moe_registry").setLevel(logging.ERROR)  # untuned shapes: said once per process
        sys.path.insert(0, str(old_root))
    rows, saved = [], {"old": {}, "new": {}}
    for kind, case in cases:
        cid = _case_id(kind, case)
        try:
            old, new = run_conformance(case) if kind == "conformance" else run_model(*case)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (reported, never hidden)
            rows.append({"id": cid, "error": f"{type(e).__name__}: {e}"})
            continue
        rows.append({"id": cid, "equal": bool(torch.equal(old, new)), "shape": list(new.shape),
                     "old": _digest(old), "new": _digest(new)})
        if kind == "conformance":
            saved["old"][cid], saved["new"][cid] = old.cpu(), new.cpu()
    return rows, saved


def time_cells(out: Path, rounds: int, cells: list[str] | None = None) -> list[dict]:
    """Old and new layer timings (µs per call), alternating, per (shape, scheme, M); ``cells``
    ("shape:scheme:M") picks some."""
    from moe_registry.layer.experts import ExpertsConfig

    rows = []
    (out / "timing.jsonl").write_text("")  # this run's cells only
    for shape in TIMED_SHAPES:
        for scheme in MODEL_SCHEMES:
            ms = [m for m in TIMED_MS if cells is None or f"{shape}:{scheme}:{m}" in cells]
            if not ms:
                continue
            weights = _model_weights(shape, scheme)
            kernels = [cls(weights, ExpertsConfig()) for cls in _classes(EXPERTS)]
            for m in ms:
                x, tw, ti = _model_inputs(shape, m, seed=m)
                graphs = []
                for kernel in kernels:
                    for _ in range(2):
                        kernel.apply(x, tw, ti)  # compile, warm
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(GRAPH_CALLS):
                            kernel.apply(x, tw, ti)
                    graphs.append(graph)
                times = [[], []]
                for _ in range(rounds):
                    for which, graph in enumerate(graphs):
                        graph.replay()
                        torch.cuda.synchronize()
                        reps, start = 0, time.perf_counter()
                        while True:
                            graph.replay()
                            reps += 1
                            if reps % 10 == 0:
                                torch.cuda.synchronize()
                                if time.perf_counter() - start > 0.05:
                                    break
                        times[which].append((time.perf_counter() - start) / (reps * GRAPH_CALLS) * 1e6)
                old_us, new_us = statistics.median(times[0]), statistics.median(times[1])
                row = {"shape": shape, "scheme": scheme, "m": m, "old_us": round(old_us, 2),
                       "new_us": round(new_us, 2), "new/old": round(new_us / old_us, 3)}
                print(json.dumps(row), flush=True)
                with (out / "timing.jsonl").open("a") as f:
                    f.write(json.dumps(row) + "\n")
                rows.append(row)
                del graphs
            del kernels, weights
            torch.cuda.empty_cache()
    (out / "timing.json").write_text(json.dumps(rows, indent=1))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the old kernels/ folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--time", action="store_true", help="also time the benchmark cells")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cells", nargs="*", help="time only these cells, shape:scheme:M")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--limit", type=int, help="the first N conformance cases only")
    parser.add_argument("--save", type=Path, help="where the outputs go (default: --out)")
    parser.add_argument("--no-models", action="store_true", help="conformance cases only")
    parser.add_argument("--no-conformance", action="store_true", help="model cases only")
    parser.add_argument("--only", help="cases whose id holds this text")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    old_root = install_old(args.old)
    sys.path.insert(0, str(old_root))
    conf = [] if args.no_conformance else conformance_cases()[:args.limit]
    models = [] if args.no_models else model_cases()
    if args.only:
        conf = [c for c in conf if args.only in _case_id(*c)]
        models = [c for c in models if args.only in _case_id(*c)]
    # small interleaved chunks, handed out as workers free up: rows reach identity.jsonl all along the run
    chunks = max(1, min(len(conf), args.workers * CHUNKS_PER_WORKER))
    slices = [conf[i::chunks] for i in range(chunks)]
    # model cases grouped by (shape, scheme) so a worker makes each scheme's weights once, in
    # fewer workers (a Mixtral layer's weights take GBs)
    model_workers = min(args.workers, MODEL_WORKERS)
    model_slices = [[] for _ in range(model_workers)]
    for j, key in enumerate(dict.fromkeys((s, sc) for _, (s, sc, _) in models)):
        model_slices[j % model_workers] += [c for c in models if c[1][:2] == key]
    started = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    parts = []
    rows_file = args.out / "identity.jsonl"  # each chunk's rows as it finishes: a run cut off keeps them
    rows_file.write_text("")
    for n, work in ((args.workers, slices), (model_workers, model_slices)):
        work = [w for w in work if w]
        if work:
            with ctx.Pool(n) as pool:
                for part in pool.imap_unordered(worker, [(old_root, w, args.device) for w in work]):
                    parts.append(part)
                    with rows_file.open("a") as f:
                        f.writelines(json.dumps(row) + "\n" for row in part[0])
    rows = [r for part, _ in parts for r in part]
    save = args.save or args.out
    save.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    for which in ("old", "new"):
        tensors = {k: v.contiguous() for _, saved in parts for k, v in saved[which].items()}
        save_file(tensors, str(save / f"{which}_outputs.safetensors"))
    equal = sum(1 for r in rows if r.get("equal"))
    errors = [r for r in rows if "error" in r]
    differ = [r for r in rows if r.get("equal") is False]
    summary = {"compared": len(rows) - len(errors), "equal": equal, "differ": [r["id"] for r in differ],
               "errors": errors, "seconds": round(time.monotonic() - started, 1)}
    (args.out / "identity.json").write_text(json.dumps({"summary": summary, "cases": rows}, indent=1))
    print(json.dumps(summary, indent=1), flush=True)
    if args.time or args.cells:
        time_cells(args.out, args.rounds, args.cells)
    return 0 if not differ and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
