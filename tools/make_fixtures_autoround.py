"""Write the Intel AutoRound producer fixtures under tests/fixtures/autoround/ (run by hand, not in CI).

AutoRound itself quantizes the tiny random Qwen3-MoE of make_fixtures_gptq_awq.py (hidden 64, expert
intermediate 64, 4 experts, top-2, one layer, group size 32) on the CPU in RTN mode (iters=0: the rounding
search changes values, not what is written) and saves it with ``format="auto_round"``, which packs int4 as
``auto_round:auto_gptq``. Kept: config.json as written and layer 0's MoE tensors, names and dtypes untouched
(<name>/checkpoint/), and ref.safetensors with AutoRound's OWN reading of them, each expert projection's weight
read as its output on the identity (``<module>.weight``, [out, in]) and its output on fixed inputs
(``<module>.output`` for ``inputs``). The symmetric checkpoint is read back by transformers through AutoRound's
quantized linears. The asymmetric one is written with ``format="auto_round:auto_gptq"`` (the plain
``"auto_round"`` picks the auto_awq packing for asymmetric int4, whose export fails in auto-round 0.16.1), and read
by the quantized linear AutoRound packs it with (``auto_round_extension.torch.qlinear_torch_zp``, whose forward
adds back the 1 its packing takes from each zero point): on the CPU, transformers' load of an asymmetric
checkpoint takes AutoRound's fake-activation linear, which fails on a weight-only scheme.

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

VARIANTS = {"qwen3-autoround-w4-sym": dict(bits=4, sym=True),
            "qwen3-autoround-w4-asym": dict(bits=4, sym=False)}
FORMATS = {"qwen3-autoround-w4-sym": "auto_round", "qwen3-autoround-w4-asym": "auto_round:auto_gptq"}


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
    rounder.quantize_and_save(str(work / name), format=FORMATS[name])
    saved = next(p.parent for p in (work / name).rglob("config.json"))
    fixture = FIXTURES / "autoround" / name
    keep_layer(saved, fixture, ("config.json", "quantization_config.json"))
    if qargs["sym"]:
        modules = expert_modules(AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float16, device_map="cpu"))
    else:
        modules = packed_linears(saved, qargs["bits"])
    x = fixed_inputs()
    ref: dict[str, torch.Tensor] = {"inputs": x}
    with torch.no_grad():
        for mod_name, mod in modules.items():
            eye = torch.eye(HIDDEN if "down" not in mod_name else INTER, dtype=torch.float16)
            ref[f"{mod_name}.weight"] = mod(eye).t().contiguous()
            ref[f"{mod_name}.output"] = mod(x).contiguous()
    if len(ref) != 1 + 2 * 3 * EXPERTS:
        raise SystemExit(f"{name}: found {(len(ref) - 1) // 2} expert linears, wanted {3 * EXPERTS}")
    save_file(ref, str(fixture / "ref.safetensors"))
    print(f"{name}: {sorted(p.name for p in fixture.iterdir())}")


def packed_linears(saved: Path, bits: int) -> dict[str, torch.nn.Module]:
    """Layer 0's expert projections as AutoRound's packing linear for auto_round:auto_gptq holds them, their
    qweight, qzeros and scales loaded from the saved file."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in saved.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    modules: dict[str, torch.nn.Module] = {}
    for name in sorted({k.rsplit(".", 1)[0] for k in tensors if k.startswith(LAYER_PREFIX + "experts.")}):
        qweight, scales = tensors[f"{name}.qweight"], tensors[f"{name}.scales"]
        linear = QuantLinear(bits, GROUP, qweight.shape[0] * 32 // bits, qweight.shape[1], bias=False)
        linear.load_state_dict({"qweight": qweight, "qzeros": tensors[f"{name}.qzeros"], "scales": scales},
                               strict=False)
        linear.post_init()
        modules[name] = linear
    return modules


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
            "fixtures": {name: {**qargs, "format": FORMATS[name], "iters": 0} for name, qargs in VARIANTS.items()}}
    (FIXTURES / "autoround" / "VERSIONS.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
