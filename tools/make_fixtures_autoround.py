"""Write the Intel AutoRound producer fixtures under tests/fixtures/autoround/ (run by hand, not in CI).

AutoRound itself quantizes the tiny random Qwen3-MoE of make_fixtures_gptq_awq.py (hidden 64, expert
intermediate 64, 4 experts, top-2, one layer, group size 32) on the CPU in RTN mode (iters=0: the rounding
search changes values, not what is written) and saves it with ``format="auto_round"``, which packs int4 as
``auto_round:auto_gptq``. Kept: config.json as written and layer 0's MoE tensors, names and dtypes untouched
(<name>/checkpoint/), and ref.safetensors with AutoRound's OWN reading of them: the checkpoint loaded back by
transformers through AutoRound's quantized linears, each expert projection's weight read as its output on the
identity (``<module>.weight``, [out, in]) and its output on fixed inputs (``<module>.output`` for ``inputs``).

    python3 -m venv /tmp/venv-ar && /tmp/venv-ar/bin/pip install torch==2.13.0
    /tmp/venv-ar/bin/pip install auto-round transformers
    /tmp/venv-ar/bin/python tools/make_fixtures_autoround.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures_gptq_awq import (  # noqa: E402
    EXPERTS,
    FIXTURES,
    GROUP,
    HIDDEN,
    INTER,
    LAYER_PREFIX,
    TOP_K,
    VOCAB,
    expert_modules,
    fixed_inputs,
    keep_layer,
    make_source,
)

VARIANTS = {"qwen3-autoround-w4-sym": dict(bits=4, sym=True)}


def calibration_text(rows: int = 4, words: int = 40) -> list[str]:
    """Text over the tiny word-level vocabulary (AutoRound would otherwise download a dataset)."""
    return [" ".join(f"t{(i * 7 + j) % (VOCAB - 8) + 4}" for j in range(words)) for i in range(rows)]


def autoround_fixture(name: str, qargs: dict, source: Path, work: Path) -> None:
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float16)
    tokenizer = AutoTokenizer.from_pretrained(source)
    rounder = AutoRound(model, tokenizer, group_size=GROUP, iters=0, nsamples=2, seqlen=16,
                        dataset=calibration_text(), **qargs)
    rounder.quantize_and_save(str(work / name), format="auto_round")
    saved = next(p.parent for p in (work / name).rglob("config.json"))
    fixture = FIXTURES / "autoround" / name
    keep_layer(saved, fixture, ("config.json", "quantization_config.json"))
    loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float16, device_map="cpu")
    x = fixed_inputs()
    ref: dict[str, torch.Tensor] = {"inputs": x}
    with torch.no_grad():
        for mod_name, mod in expert_modules(loaded).items():
            eye = torch.eye(HIDDEN if "down" not in mod_name else INTER, dtype=torch.float16)
            ref[f"{mod_name}.weight"] = mod(eye).t().contiguous()
            ref[f"{mod_name}.output"] = mod(x).contiguous()
    if len(ref) != 1 + 2 * 3 * EXPERTS:
        raise SystemExit(f"{name}: found {(len(ref) - 1) // 2} expert linears, wanted {3 * EXPERTS}")
    save_file(ref, str(fixture / "ref.safetensors"))
    print(f"{name}: {sorted(p.name for p in fixture.iterdir())}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_source(work / "source")
        for name, qargs in VARIANTS.items():
            if not args.only or name in args.only:
                autoround_fixture(name, qargs, work / "source", work)
    info = {"producer_script": "tools/make_fixtures_autoround.py",
            "versions": {p: version(p) for p in ("auto-round", "transformers", "torch", "safetensors")},
            "python": sys.version.split()[0],
            "model": {"model_type": "qwen3_moe", "hidden_size": HIDDEN, "moe_intermediate_size": INTER,
                      "num_experts": EXPERTS, "top_k": TOP_K, "group_size": GROUP, "kept": LAYER_PREFIX + "*"},
            "fixtures": {name: {**qargs, "format": "auto_round", "iters": 0} for name, qargs in VARIANTS.items()}}
    (FIXTURES / "autoround" / "VERSIONS.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
