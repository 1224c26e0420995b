"""Whole-model benchmark: one checkpoint loaded by ``moe_registry.load_model`` and by transformers' own
``from_pretrained``, side by side: prefill and decode tokens/s (greedy ``generate``, batch 1), the experts'
resident bytes against the checkpoint's expert bytes, and the peak RSS the load (and the load with the run) adds
over the process after its imports (each side in its own process, so one side's memory never counts for the
other).

Models: ``tiny`` (a tiny fixture family made whole, tools/make_transformers_whole.py) or ``qwen3-30b-a3b``
(Qwen3-30B-A3B's real layer shapes with random weights; ``--layers N`` decoder layers, ``--vocab`` to keep the
embedding small on a small machine). Formats: ``bf16`` and ``gptq`` (4-bit, group 128, every decoder projection,
written by the project's GPTQ packer; transformers needs a GPTQ backend to load it, so its side says why not).

    python tools/bench_model.py --model tiny --format bf16 gptq --threads 2
    python tools/bench_model.py --model qwen3-30b-a3b --layers 2 --vocab 4096 --format bf16 gptq --device cuda
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
QWEN3_30B_A3B = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     intermediate_size=6144, moe_intermediate_size=768, num_local_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                                                         "rope_theta": 1e6})


def make_checkpoint(model: str, fmt: str, out: Path, layers: int, vocab: int | None) -> Path:
    """Write the benchmark checkpoint (bf16 by transformers' save_pretrained, then GPTQ-packed if asked)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from make_transformers_whole import make_whole_model

    fields: dict[str, Any] = {} if model == "tiny" else dict(QWEN3_30B_A3B)
    if vocab:
        fields["vocab_size"] = vocab
    # the packed CPU kernel wants intermediate >= 32: the tiny model is made with 32 for every format
    fields.setdefault("moe_intermediate_size", 32)
    path = make_whole_model("qwen3_moe", out / "bf16", layers=layers, **fields)
    if fmt == "bf16":
        return path
    return _gptq(path, out / "gptq")


def _gptq(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    from moe_registry.testing.packers import pack_gptq

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in [n for n, t in tensors.items() if n.endswith("_proj.weight") and t.dim() == 2]:
            w = tensors.pop(name)
            group = 128 if w.shape[1] % 128 == 0 else -1
            tensors.update({f"{name.removesuffix('.weight')}.{k}": v for k, v in pack_gptq(w, 4, group).items()})
        save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    group = 128 if cfg["moe_intermediate_size"] % 128 == 0 else -1
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                  "sym": True, "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _rss_peak() -> int:
    """This process's peak resident bytes (Linux VmHWM: reset at exec, unlike ru_maxrss, which a child started by
    fork and exec inherits from its parent's peak)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]


def measure(path: Path, side: str, device: str, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """In this process: load with ``side`` (registry or transformers), then time one greedy generate."""
    import transformers

    from moe_registry.cli.generate import TokenClock
    from moe_registry.whole.load import load_model

    before = _rss_peak()
    start = time.perf_counter()
    if side == "registry":
        model = load_model(path, device=device)
        report = model.moe_registry_report
        experts = {"experts_resident_bytes": report.experts_resident_bytes,
                   "experts_checkpoint_bytes": report.experts_checkpoint_bytes,
                   "kernels": sorted({p.kernel for p in report.layers}),
                   "schemes": sorted({p.scheme for p in report.layers})}
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(device).eval()
        experts = {"experts_implementation": model.config._experts_implementation}
    load_s = time.perf_counter() - start
    load_rss = _rss_peak() - before
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(model.device)
    with torch.no_grad():
        # a warm-up generate of the timed shapes: a GPU kernel compiles once per tile config, and the prefill's
        # and each decode step's token counts pick their own; a shorter warm-up leaves compiles in the timing
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        clock = TokenClock()
        start = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=clock)
    prefill_s, decode_s = clock.times[1] - start, clock.times[-1] - clock.times[1]
    # safetensors maps the file: pages a load leaves untouched count only once a forward reads them
    run_rss = _rss_peak() - before
    return {"side": side, "load_s": load_s, "load_peak_rss_bytes": load_rss, "run_peak_rss_bytes": run_rss,
            "prefill_tokens_per_s": prompt_len / prefill_s, "decode_tokens_per_s": (new_tokens - 1) / decode_s,
            "threads": torch.get_num_threads(), **experts}


def _child(args: argparse.Namespace, path: Path, side: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--measure", str(path), "--side", side, "--device", args.device,
           "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"side": side, "error": last[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(fmt: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {fmt} | {r['side']} | not loaded: {r['error']} | | | | |"
    experts = (f"{r['experts_resident_bytes'] / 2**20:.1f} / {r['experts_checkpoint_bytes'] / 2**20:.1f} MiB "
               f"({', '.join(r['kernels'])})" if "kernels" in r else f"({r['experts_implementation']})")
    return (f"| {fmt} | {r['side']} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | {experts} | "
            f"{r['load_peak_rss_bytes'] / 2**20:.0f} / {r.get('run_peak_rss_bytes', 0) / 2**20:.0f} MiB | "
            f"{r['load_s']:.1f} s |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "qwen3-30b-a3b"], default="tiny")
    p.add_argument("--format", nargs="+", choices=["bf16", "gptq"], default=["bf16", "gptq"])
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the model's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads in each measuring process")
    p.add_argument("--prompt-tokens", dest="prompt_tokens", type=int, default=64)
    p.add_argument("--new-tokens", dest="new_tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="one JSON object per row instead of the table")
    p.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--side", choices=["registry", "transformers"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.side, args.device, args.prompt_tokens, args.new_tokens)))
        return 0
    print(f"model {args.model}, {args.layers} layers, device {args.device}, threads {args.threads or 'torch default'}, "
          f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens (batch 1, greedy)\n")
    print("| format | loaded by | prefill tok/s | decode tok/s | experts resident / checkpoint | peak RSS added "
          "(load / load+run) | load |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.format:
            path = make_checkpoint(args.model, fmt, Path(tmp) / fmt, args.layers, args.vocab)
            for side in ("registry", "transformers"):
                r = _child(args, path, side)
                print(json.dumps({"format": fmt, **r}) if args.json else _row(fmt, r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
