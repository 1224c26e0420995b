"""Write the GPTQModel and AutoAWQ producer fixtures under tests/fixtures/ (run by hand, not in CI).

Layout: tests/fixtures/<library>/<name>/checkpoint/ (a model dir) and <name>/ref.safetensors.

The libraries themselves quantize a tiny random Qwen3-MoE (hidden 64, expert intermediate 64, 4 experts,
top-2, one layer, group size 32) on the CPU and save it as they always do; GPTQModel also a tiny Mixtral of
the same shape, which it saves under its own module names (``mlp.gate``, ``mlp.experts.N.gate_proj``/
``up_proj``/``down_proj``), not the ``block_sparse_moe.experts.N.w1/w3/w2`` of transformers' save_pretrained.
Of what they write we keep config.json (+ quantize_config.json) and the first MoE layer's router and expert
tensors, names and dtypes untouched, plus ref.safetensors with the library's OWN reading of them: each expert
projection's dequantised weight (``<module>.weight``, [out, in], as the library's quantized linear reconstructs it)
and that linear's output on fixed inputs (``<module>.output`` for ``inputs``). Our packers play no part.

Heavy dependencies live in their own venvs, never in the project's (their pins fight the project's):

    python3 -m venv /work/producers/gptq && /work/producers/gptq/bin/pip install torch==2.13.0
    /work/producers/gptq/bin/pip install --no-deps gptqmodel==7.7.0
    /work/producers/gptq/bin/pip install -c <torch==2.13.0> transformers==5.23.0 accelerate defuser \
        device-smi logbar pypcre threadpoolctl tokenicer dill pillow protobuf
    GPTQMODEL_CPU_WORKERS=2 /work/producers/gptq/bin/python tools/make_fixtures_gptq_awq.py gptq

    python3 -m venv /work/producers/awq && /work/producers/awq/bin/pip install torch==2.13.0
    /work/producers/awq/bin/pip install --no-deps autoawq==0.2.9
    /work/producers/awq/bin/pip install -c <torch==2.13.0> transformers==4.51.3 accelerate tokenizers
    /work/producers/awq/bin/python tools/make_fixtures_gptq_awq.py awq
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
LAYER_PREFIX = "model.layers.0.mlp."
HIDDEN, INTER, EXPERTS, TOP_K, GROUP, VOCAB = 64, 64, 4, 2, 32, 128

# name -> GPTQModel QuantizeConfig arguments (act-order is covered by the 8-bit symmetric v1 and the 4-bit
# asymmetric v2 fixtures)
GPTQ_VARIANTS = {
    "qwen3-gptq-w4-sym": dict(bits=4, sym=True, desc_act=False, format="gptq"),
    "qwen3-gptq-w4-asym": dict(bits=4, sym=False, desc_act=False, format="gptq"),
    "qwen3-gptq-w8-sym-actorder": dict(bits=8, sym=True, desc_act=True, format="gptq"),
    "qwen3-gptq-w4-sym-v2": dict(bits=4, sym=True, desc_act=False, format="gptq_v2"),
    "qwen3-gptq-w4-asym-actorder-v2": dict(bits=4, sym=False, desc_act=True, format="gptq_v2"),
    "mixtral-gptq-w4-sym": dict(bits=4, sym=True, desc_act=False, format="gptq"),
    "qwen3-gptq-w8-asym": dict(bits=8, sym=False, desc_act=False, format="gptq"),
    "qwen3-gptq-w8-asym-v2": dict(bits=8, sym=False, desc_act=False, format="gptq_v2"),
}
# fixture -> the tiny source model it quantizes (default qwen3_moe)
SOURCE_OF = {"mixtral-gptq-w4-sym": "mixtral"}
AWQ_VARIANTS = {"qwen3-awq-w4-gemm": dict(w_bit=4, q_group_size=GROUP, zero_point=True, version="GEMM",
                                         modules_to_not_convert=["mlp.gate"])}  # the router stays float


def tokenizer(out: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over the tiny vocabulary: the libraries insist on loading one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t1", eos_token="t2",
                            bos_token="t3").save_pretrained(out)


def make_source(out: Path, kv_heads: int = 1, model_type: str = "qwen3_moe") -> None:
    """A tiny random Qwen3-MoE in float16, saved by transformers. Expert 0's gate projection gets one
    all-positive and one all-negative group of 8 output rows so that asymmetric quantization meets
    zero points 0 and 2**bits - 1 (GPTQ v1 stores zero - 1 and so borrows across packed fields).
    AutoAWQ's clip search wants every clipped linear's outputs in multiples of 64: kv_heads=2 there."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if model_type == "mixtral":
        cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=32,
                            num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=128)
        model = MixtralForCausalLM(cfg).to(torch.float16)
    else:
        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                             moe_intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=kv_heads, head_dim=32, num_experts=EXPERTS,
                             num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=128)
        model = Qwen3MoeForCausalLM(cfg).to(torch.float16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." not in name or "gate" not in name or "down" in name:
                continue
            w = p[0] if p.dim() == 3 else (p if ".experts.0." in name else None)  # fused [E, 2I, H] or per expert
            if w is not None:
                w[0:8, 0:GROUP] = w[0:8, 0:GROUP].abs() + 1e-3
                w[8:16, 0:GROUP] = -(w[8:16, 0:GROUP].abs() + 1e-3)
    model.save_pretrained(out)
    tokenizer(out)


def calibration(n: int = 16, length: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(4, VOCAB, (1, length), generator=g),
             "attention_mask": torch.ones(1, length, dtype=torch.long)} for _ in range(n)]


def fixed_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, HIDDEN, generator=g).to(torch.float16)


def keep_layer(saved: Path, fixture: Path, config_files: tuple[str, ...]) -> None:
    """config (+ quantize config) as written; the first MoE layer's tensors, names and dtypes as written.
    They go to ``<fixture>/checkpoint/`` (a model dir that holds nothing else: a loader reads every
    .safetensors file in it); ref.safetensors stays beside that dir."""
    fixture = fixture / "checkpoint"
    fixture.mkdir(parents=True, exist_ok=True)
    for name in config_files:
        if (saved / name).is_file():
            shutil.copy(saved / name, fixture / name)
    kept: dict[str, torch.Tensor] = {}
    for file in sorted(saved.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                if k.startswith(LAYER_PREFIX):
                    kept[k] = f.get_tensor(k)
    if not kept:
        raise SystemExit(f"{saved}: no tensors under {LAYER_PREFIX}")
    save_file(kept, str(fixture / "model.safetensors"))


def expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Layer 0's expert projections as the library holds them, by checkpoint module name."""
    projections = ("gate_proj", "up_proj", "down_proj")
    return {n: m for n, m in model.named_modules()
            if n.startswith(LAYER_PREFIX + "experts.") and n.rsplit(".", 1)[-1] in projections}


def gptq_fixture(name: str, qargs: dict, source: Path, work: Path) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    saved = work / name
    model = GPTQModel.load(str(source), QuantizeConfig(group_size=GROUP, **qargs), device="cpu")
    model.quantize(calibration(), batch_size=1)
    model.save(str(saved))
    del model
    fixture = FIXTURES / "gptqmodel" / name
    keep_layer(saved, fixture, ("config.json", "quantize_config.json"))
    # the library's own reading: load the saved checkpoint back (v1 zeros are converted to v2 on load)
    # with the torch kernel in float16, and ask each expert linear for its weight and its output
    loaded = GPTQModel.load(str(saved), device="cpu", backend=BACKEND.GPTQ_TORCH, dtype=torch.float16)
    x = fixed_inputs()
    ref: dict[str, torch.Tensor] = {"inputs": x}
    with torch.no_grad():
        for mod_name, mod in expert_modules(loaded.model).items():
            w = type(mod).dequantize_weight(mod)  # [in, out]; the class's method, not the compiled one
            ref[f"{mod_name}.weight"] = w.t().contiguous()
            ref[f"{mod_name}.output"] = mod(x).contiguous()
    if len(ref) != 1 + 2 * 3 * EXPERTS:
        raise SystemExit(f"{name}: found {(len(ref) - 1) // 2} expert linears, wanted {3 * EXPERTS}")
    save_file(ref, str(fixture / "ref.safetensors"))
    print(f"{name}: {sorted(p.name for p in fixture.iterdir())}")


def awq_fixture(name: str, qargs: dict, source: Path, work: Path) -> None:
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    saved = work / name
    model = AutoAWQForCausalLM.from_pretrained(str(source), device_map="cpu", torch_dtype=torch.float16)
    tok = AutoTokenizer.from_pretrained(str(source))
    ids = [c["input_ids"][0].tolist() for c in calibration()]  # AutoAWQ takes token id lists as they are
    model.quantize(tok, quant_config=dict(qargs), calib_data=ids, n_parallel_calib_samples=None,
                   max_calib_samples=16, max_calib_seq_len=64)
    model.save_quantized(str(saved))
    fixture = FIXTURES / "autoawq" / name
    keep_layer(saved, fixture, ("config.json", "quant_config.json", "quantize_config.json"))
    x = fixed_inputs()
    ref: dict[str, torch.Tensor] = {"inputs": x}
    with torch.no_grad():
        for mod_name, mod in expert_modules(model.model).items():
            ref[f"{mod_name}.weight"] = awq_dequantize(mod)
            ref[f"{mod_name}.output"] = mod(x).contiguous()
    save_file(ref, str(fixture / "ref.safetensors"))
    print(f"{name}: {sorted(p.name for p in fixture.iterdir())}")


def awq_dequantize(mod: torch.nn.Module) -> torch.Tensor:
    """AutoAWQ's own unpacking (awq.utils.packing_utils.dequantize_gemm), [out, in]."""
    from awq.utils.packing_utils import dequantize_gemm

    w = dequantize_gemm(mod.qweight, mod.qzeros, mod.scales, mod.w_bit, mod.group_size)  # [in, out]
    return w.t().contiguous()


def write_versions(sub: str, packages: list[str], variants: dict) -> None:
    info = {"producer_script": "tools/make_fixtures_gptq_awq.py",
            "versions": {p: version(p) for p in packages},
            "python": sys.version.split()[0],
            "model": {"model_type": "qwen3_moe", "hidden_size": HIDDEN, "moe_intermediate_size": INTER,
                      "num_experts": EXPERTS, "top_k": TOP_K, "group_size": GROUP, "kept": LAYER_PREFIX + "*"},
            "fixtures": {name: {**qargs, **({"model_type": SOURCE_OF[name], "intermediate_size": INTER}
                                            if name in SOURCE_OF else {})} for name, qargs in variants.items()}}
    (FIXTURES / sub / "VERSIONS.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("library", choices=["gptq", "awq"])
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = work / "source"
        make_source(source, kv_heads=1 if args.library == "gptq" else 2)
        if args.library == "gptq":
            for model_type in sorted(set(SOURCE_OF.values())):
                make_source(work / model_type, kv_heads=1, model_type=model_type)
            for name, qargs in GPTQ_VARIANTS.items():
                if not args.only or name in args.only:
                    src = work / SOURCE_OF[name] if name in SOURCE_OF else source
                    gptq_fixture(name, qargs, src, work)
            write_versions("gptqmodel", ["gptqmodel", "transformers", "torch", "safetensors"], GPTQ_VARIANTS)
        else:
            for name, qargs in AWQ_VARIANTS.items():
                if not args.only or name in args.only:
                    awq_fixture(name, qargs, source, work)
            write_versions("autoawq", ["autoawq", "transformers", "torch", "safetensors"], AWQ_VARIANTS)


if __name__ == "__main__":
    main()
