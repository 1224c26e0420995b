"""``moe-registry generate``: load a whole model with ``load_model`` and generate greedily with transformers'
``generate``; print the text (the checkpoint's tokenizer when it has one, else token ids), prefill and decode
tokens/s, and the bytes the experts hold."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_registry.core.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def add_generate_parser(parser: Any, sub: Any, add: Callable[..., Any], add_json: Callable[..., None]) -> None:
    """The ``generate`` verb (``add``/``add_json``: main's helpers, so every verb reads alike)."""
    p = add(parser, sub, "generate", "load a whole model with its MoE experts on the registry's kernels and generate",
            ("moe-registry generate MODEL_DIR --prompt 'The capital of France is' --max-new-tokens 32",
             "moe-registry generate MODEL_DIR --input-ids 1,2,3 --max-new-tokens 16 --json",
             "moe-registry generate MODEL_DIR --prompt hello --device cuda --kernel triton-fused-moe"))
    p.add_argument("target", help="a model dir (config.json and its safetensors)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the checkpoint's tokenizer)")
    given.add_argument("--input-ids", dest="input_ids", metavar="IDS", help="prompt token ids, e.g. --input-ids 1,2,3")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=32, metavar="N",
                   help="tokens to generate, >= 1 (default 32)")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda[:N]")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="model dtype (default: the checkpoint's torch_dtype, else bfloat16)")
    p.add_argument("--platform", metavar="PLATFORM", help="platform the oracle decides for (default: the device's)")
    p.add_argument("--kernel", metavar="NAME", help="pin this kernel for every MoE layer")
    p.add_argument("--prefer", metavar="NAME", help="prefer this kernel, falling back (and saying so)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch (default: torch's)")
    add_json(p, "the text, token ids, speeds and the load report")
    p.set_defaults(func=cmd_generate)


class TokenClock:
    """A transformers streamer that only notes when each put arrives: the first is the prompt, the second the
    first new token (prefill done), then one per decoded token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _tokenizer(target: Path) -> Any | None:
    if not any((target / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


def _prompt_ids(args: argparse.Namespace, tokenizer: Any | None, vocab: int) -> list[int]:
    if args.prompt is not None:
        if tokenizer is None:
            raise ConfigError(f"--prompt: {args.target} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                              "give token ids with --input-ids 1,2,3")
        ids = list(tokenizer(args.prompt)["input_ids"])
        if not ids:
            raise ConfigError("--prompt: the tokenizer gave no tokens; wanted a non-empty prompt")
        return ids
    try:
        ids = [int(t) for t in args.input_ids.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--input-ids: got {args.input_ids!r}; wanted integers separated by commas") from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if not ids or bad:
        raise ConfigError(f"--input-ids: got {args.input_ids!r}; wanted token ids in [0, {vocab})")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: got {args.max_new_tokens}; wanted >= 1")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads: got {args.threads}; wanted >= 1")
    target = Path(args.target)
    from moe_registry.whole.requirement import require_transformers

    require_transformers()
    import torch

    from moe_registry.whole.load import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model = load_model(target, device=args.device, dtype=args.dtype, platform=args.platform, kernel=args.kernel,
                       prefer=args.prefer)
    load_s = time.perf_counter() - start
    report = model.moe_registry_report
    tokenizer = _tokenizer(target)
    ids = _prompt_ids(args, tokenizer, int(model.config.get_text_config().vocab_size))
    prompt = torch.tensor([ids], device=model.device)
    clock = TokenClock()
    with torch.no_grad():
        # a one-token warm-up, so one-time costs (first calls, lazily built kernel state) are not timed as prefill
        model.generate(prompt[:, :1], max_new_tokens=1, do_sample=False,
                       pad_token_id=model.generation_config.pad_token_id or 0)
        start = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.max_new_tokens,
                             min_new_tokens=args.max_new_tokens, do_sample=False, streamer=clock,
                             pad_token_id=model.generation_config.pad_token_id or 0)
    new = out[0, len(ids):].tolist()
    # the streamer's first put is the prompt, the second the first new token (prefill done)
    prefill_s = clock.times[1] - start
    decode_s = clock.times[-1] - clock.times[1]
    result = {
        "text": tokenizer.decode(new) if tokenizer is not None else None,
        "prompt_ids": ids, "new_ids": new,
        "prefill_tokens": len(ids), "prefill_tokens_per_s": len(ids) / prefill_s,
        "decode_tokens": len(new) - 1,
        "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 and decode_s > 0 else None,
        "experts_resident_bytes": report.experts_resident_bytes,
        "experts_checkpoint_bytes": report.experts_checkpoint_bytes,
        "load_s": load_s, "threads": torch.get_num_threads(), "report": report.to_dict(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(report.to_text())
    print()
    print(result["text"] if tokenizer is not None else f"new token ids: {new}")
    print()
    decode = result["decode_tokens_per_s"]
    print(f"prefill  {len(ids)} tokens, {result['prefill_tokens_per_s']:.1f} tokens/s (after a one-token warm-up)")
    print(f"decode   {len(new) - 1} tokens after the first, "
          + (f"{decode:.1f} tokens/s" if decode is not None else "none timed"))
    print(f"experts  {report.experts_resident_bytes} bytes resident "
          f"(checkpoint's expert tensors: {report.experts_checkpoint_bytes} bytes); load {load_s:.2f} s, "
          f"{result['threads']} threads")
    return 0
