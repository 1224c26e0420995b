# ruff: noqa: E501  (a table of cases: one case a line reads better than wrapped regexes)
"""Hostile input: specs, configs, checkpoints, flags and run inputs malformed on purpose.

Each case builds its bad input in tmp_path, runs ``moe_registry.cli.main.main`` and asserts the exit code
and the one-line message (a regex, ``{d}`` standing for tmp_path). A SIGALRM fixture turns a hang
into a failure. Big inputs (50k-deep YAML, 200k-deep JSON) are generated here, not committed. The
seeded fuzz at the end feeds random text to the key parser, the shape-expression evaluator and
detection, and accepts only the project's error types.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_registry.cli.main import main
from moe_registry.core.errors import MoERegistryError

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 32, 16, 4, 2, 2
CORPUS = Path(__file__).parent / "hostile"
EXP = "model.layers.0.block_sparse_moe.experts"
ROUTER = "model.layers.0.block_sparse_moe.gate.weight"


@pytest.fixture(autouse=True)
def no_hang():
    """Fail (instead of blocking CI) when one case runs longer than 20 s."""
    def on_alarm(signum, frame):  # noqa: ARG001
        raise TimeoutError("hostile case ran longer than 20 s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- a tiny model


def base_config() -> dict:
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K, "hidden_act": "silu", "torch_dtype": "float32"}


def base_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        p = f"model.layers.{layer}.block_sparse_moe"
        out[f"{p}.gate.weight"] = torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.05
        for e in range(EXPERTS):
            for proj, shape in (("w1", (INTER, HIDDEN)), ("w3", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
                out[f"{p}.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=gen) * 0.05
    return out


def make_model(d: Path, config: Callable[[dict], object] | None = None,
               tensors: Callable[[dict], object] | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg, t = base_config(), base_tensors()
    if config:
        config(cfg)
    if tensors:
        tensors(t)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(d / "model.safetensors"))
    return d


def cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out.splitlines(), cap.err.splitlines()


def check_line(line: str, expected: str, d: Path) -> None:
    pattern = expected.replace("{d}", re.escape(str(d)))
    assert re.fullmatch(pattern, line), f"\n got: {line}\nwant: {pattern}"


# ---------------------------------------------------------------- specs (validate)

SCHEME = """scheme: h-test
summary: s
detect:
  quant_method: {equals: htest}
weight: unquantized
activation: unquantized
checkpoint:
  format: unquantized
  tensors:
    weight: {dtype: bfloat16, shape: [out, in]}
kernels: [torch-reference]
tolerance: {float16: 0.01}
"""
KERNEL = (Path(__file__).parent.parent / "specs" / "kernels" / "torch-reference.yaml").read_text().replace(
    "kernel: torch-reference", "kernel: h-kernel")
FAMILY = (Path(__file__).parent.parent / "specs" / "models" / "mixtral.yaml").read_text().replace(
    "family: mixtral", "family: h-family").replace("model_type: [mixtral, minimax, minimax_m1, minimax_text_01]",
                                                     "model_type: [h_family]").replace(
    "architectures: [MixtralForCausalLM, MiniMaxForCausalLM, MiniMaxM1ForCausalLM]", "architectures: [HFamily]")

R = r"\d+"  # a line number
_spec_cases: list[tuple[str, str, str]] = []


def spec(name: str, text: str, expected: str) -> None:
    _spec_cases.append((name, text, expected))


def tol(value: str, seen: str, dtype: str = "float16") -> None:
    spec(f"tolerance-{dtype}-{value}", SCHEME.replace("{float16: 0.01}", f"{{{dtype}: {value}}}"),
         rf"{{d}}/s\.yaml:12: tolerance: tolerance\.{dtype}: got {seen}; wanted a finite number > 0 and <= 1")


for v, seen in ((".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan"), ("-1", "-1.0"), ("0", "0.0"), ("2", "2.0"),
                ("1.5", "1.5"), ("1e400", "inf"), ("-0.0", "-0.0")):
    tol(v, seen)
tol(".inf", "inf", "bfloat16")
tol(".nan", "nan", "float32")


def shape(dim: str, expected: str, name: str | None = None) -> None:
    spec(f"shape-{name or dim}", SCHEME.replace("shape: [out, in]", f"shape: [out, {dim}]"),
         r"{d}/s\.yaml:10: checkpoint\.tensors\.weight\.shape: " + expected)


shape("in / 0", r"division by zero in 'in / 0'")
shape("in // 0", r"division by zero in 'in // 0'")
shape("in % 0", r"division by zero in 'in % 0'")
shape("'in % (3 - 3)'", r"division by zero in 'in % \(3 - 3\)'", "mod-folded-zero")
shape("'groups(in, 0)'", r"group size 0 in 'groups\(in, 0\)' must be positive or -1", "groups-0")
shape("'groups(in, -2)'", r"group size -2 in 'groups\(in, -2\)' must be positive or -1", "groups-neg")
shape("'groups(in)'", r"groups\(\) takes \(size, group\) in 'groups\(in\)'", "groups-1arg")
shape("'ceil(in, 2)'", r"ceil\(\) takes one argument in 'ceil\(in, 2\)'", "ceil-2args")
shape("-1", r"shape dimension '-1' is negative; wanted a size >= 0", "neg-const")
shape("-128", r"shape dimension '-128' is negative; wanted a size >= 0", "neg-const-128")
shape("'in - 2 * in'", r"shape dimension 'in - 2 \* in' is -430080 for in = out = 430080; wanted a positive size",
      "neg-expr")
shape("'-in'", r"shape dimension '-in' is -430080 for in = out = 430080; wanted a positive size", "neg-in")
shape("'in - in'", r"shape dimension 'in - in' is 0 for in = out = 430080; wanted a positive size", "zero-expr")
shape("true", r"shape dimension True is a boolean; wanted an integer or an expression", "bool-true")
shape("false", r"shape dimension False is a boolean; wanted an integer or an expression", "bool-false")
shape("'in ** 2'", r"BinOp is not allowed in expression 'in \*\* 2'.*", "pow")
shape("'in.__class__'", r"name '__class__' is not allowed in 'in\.__class__'; names may not start with __", "dunder")
shape("'__import__(1)'", r"name '__import__' is not allowed in '__import__\(1\)'; names may not start with __",
      "import")
shape("'open(in)'", r"Call is not allowed in expression 'open\(in\)'.*", "call")
shape("'in if out else 1'", r"IfExp is not allowed in expression 'in if out else 1'.*", "ifexp")
shape("'[in]'", r"List is not allowed in expression '\[in\]'.*", "list")
shape("'in / 2.5'", r"only integer constants are allowed in 'in / 2\.5', got 2\.5", "float-const")
shape("'\"x\"'", r"only integer constants are allowed in '\"x\"', got a string", "string-const")
shape("'" + "1 + " * 60 + "1'", r"expression longer than 200 characters", "long")
spec("shape-5000-digit", SCHEME.replace("shape: [out, in]", f"shape: [out, {'9' * 5000}]"),
     r"{d}/s\.yaml:10: YAML value '9+ …9' cannot be read: Exceeds the limit \(4300 digits\).*")
shape("99999999999999999999999", r"integer of 23 digits; at most 64 bits", "huge-int")
shape("'in $'", r"bad binding reference in 'in \$'; write \$name", "bad-binding")
shape("'lambda: 1'", r"Lambda is not allowed in expression 'lambda: 1'.*", "lambda")


def limit(attr: str, value: str, expected: str, name: str) -> None:
    spec(f"kernel-limit-{name}", KERNEL.replace("layout: nk", f"shapes:\n  hidden: {{{attr}: {value}}}\nlayout: nk"),
         r"{d}/s\.yaml:\d+: shapes\.hidden\." + attr + ": " + expected)


limit("max", "'64 // 0'", r"division by zero in '64 // 0'", "floordiv0")
limit("multiple_of", "'16 % 0'", r"division by zero in '16 % 0'", "mod0")
limit("multiple_of", "0", r"multiple_of '0' is 0; wanted an integer >= 1", "multiple0")
limit("multiple_of", "-16", r"multiple_of '-16' is -16; wanted an integer >= 1", "multiple-neg")
limit("min", "-1", r"min '-1' is -1; wanted an integer >= 0", "min-neg")
limit("max", "'0 - 5'", r"max '0 - 5' is -5; wanted an integer >= 0", "max-neg")
limit("max", "true", r"max True is a boolean; wanted an integer or an expression", "max-bool")
limit("min", "'__x'", r"name '__x' is not allowed in '__x'; names may not start with __", "dunder")
spec("kernel-limit-5000-digit", KERNEL.replace("layout: nk", f"shapes:\n  hidden: {{max: {'9' * 5000}}}\nlayout: nk"),
     r"{d}/s\.yaml:\d+: YAML value '9+ …9' cannot be read: Exceeds the limit \(4300 digits\).*")


def naming(field: str, value: str, expected: str, name: str) -> None:
    old = {"layer": "layer: model.layers.{layer}", "expert": "expert: block_sparse_moe.experts.{expert}"}[field]
    spec(f"naming-{name}", FAMILY.replace(old, f"{field}: '{value}'"), r"{d}/s\.yaml:\d+: naming: " + expected)


naming("layer", "model.layers.{layer.__class__}", r"naming\.layer 'model\.layers\.\{layer\.__class__\}': "
       r"placeholder \{layer\.__class__\} is not allowed; only \{layer\} .*", "attr")
naming("layer", "model.layers.{layer.__class__.__init__.__globals__}", r"naming\.layer .*placeholder "
       r"\{layer\.__class__\.__init__\.__globals__\} is not allowed.*", "globals")
naming("layer", "{layer[0]}", r"naming\.layer '\{layer\[0\]\}': placeholder \{layer\[0\]\} is not allowed.*", "index")
naming("layer", "{layer!r}", r"naming\.layer '\{layer!r\}': placeholder .* is not allowed.*", "conversion")
naming("layer", "{layer:>9}", r"naming\.layer '\{layer:>9\}': placeholder .* is not allowed.*", "format-spec")
naming("layer", "{layer}{0}", r"naming\.layer '\{layer\}\{0\}': placeholder \{0\} is not allowed.*", "positional")
naming("layer", "{layer}{expert}", r"naming\.layer .*placeholder \{expert\} is not allowed.*", "other-name")
naming("layer", "{{layer}}.{layer}", r"naming\.layer .*is not allowed.*\(no attributes, indices, formats or braces\)",
       "escaped-braces")
naming("layer", "{layer", r"naming\.layer '\{layer': .*", "unclosed")
naming("expert", "experts.{expert.real}", r"naming\.expert 'experts\.\{expert\.real\}': placeholder "
       r"\{expert\.real\} is not allowed; only \{expert\} .*", "expert-attr")
naming("expert", "experts.{expert}.{layer}", r"naming\.expert .*placeholder \{layer\} is not allowed.*",
       "expert-layer")


def impl(value: str, name: str, expected: str | None = None) -> None:
    spec(f"impl-{name}", KERNEL.replace("impl: moe_registry_kernels.reference:ReferenceExperts", f"impl: {value}"),
         r"{d}/s\.yaml:3: impl: " + (expected or rf"kernel h-kernel: impl {re.escape(value)}: module "
                                     rf"{re.escape(value.split(':')[0])} is neither in moe_registry_kernels nor a "
                                     r"package inside the spec dir .* that declares it; refused before importing it"))


impl("os:system", "os")
impl("subprocess:Popen", "subprocess")
impl("moe_registry.cli.main:Parser", "project-module")
impl("builtins:object", "builtins")
impl("no_such_module_h6:X", "missing")
impl("os.path:join", "os-path")
impl("os.system", "no-class", r"String should match pattern .*")
impl("moe_registry_kernels:X; import os", "injection", r"String should match pattern .*")

# the file itself
spec("yaml-50k-deep-flow", "x: " + "[" * 50000 + "]" * 50000 + "\n", r"{d}/s\.yaml:1: nesting deeper than 32 levels")
spec("yaml-50k-deep-flow-map", "x: " + "{a: " * 50000 + "1" + "}" * 50000 + "\n",
     r"{d}/s\.yaml:1: nesting deeper than 32 levels")
spec("yaml-deep-block", "a:\n" + "".join(" " * (i + 1) + "b:\n" for i in range(40)) + " " * 42 + "1\n",
     r"{d}/s\.yaml:33: nesting deeper than 32 levels")
spec("yaml-deep-block-seq", "".join(" " * (2 * i) + "- \n" for i in range(40)) + " " * 80 + "1\n",
     r"{d}/s\.yaml:\d+: nesting deeper than 32 levels")
spec("yaml-5000-digit-int", SCHEME.replace("0.01}", "0.01}\nx: " + "9" * 5000),
     r"{d}/s\.yaml:13: YAML value '9999.*' cannot be read: Exceeds the limit \(4300 digits\).*")
spec("yaml-alias", "a: &x [1]\nb: *x\n", r"{d}/s\.yaml:2: YAML aliases \(\*name\) are not allowed in specs")
spec("yaml-python-tag", "a: !!python/object/apply:os.system [ls]\n",
     r"{d}/s\.yaml:1: YAML tag 'tag:yaml\.org,2002:python/object/apply:os\.system' is not allowed.*")
spec("yaml-merge", "a: {x: 1}\nb:\n  <<: {x: 1}\n", r"{d}/s\.yaml:3: YAML merge keys \(<<\) are not allowed")
spec("yaml-dup-key", SCHEME + "scheme: again\n", r"{d}/s\.yaml:13: duplicate key 'scheme'")
spec("yaml-empty", "", r"{d}/s\.yaml: file is empty")
spec("yaml-list-top", "- 1\n- 2\n", r"{d}/s\.yaml: a spec must be a mapping")
spec("yaml-bad-syntax", "a: [1\n", r"{d}/s\.yaml:\d: YAML: .*")
spec("yaml-tab", "a:\n\tb: 1\n", r"{d}/s\.yaml:2: YAML: .*")
spec("yaml-two-kinds", SCHEME + "kernel: x\n",
     r"{d}/s\.yaml:1: a spec needs exactly one of the top-level keys: scheme, kernel, family, format, keyset")
spec("scheme-bad-key", SCHEME.replace("weight: unquantized", "weight: uint4 scale:float16:group(0):static"),
     r"{d}/s\.yaml:5: weight: bad group size 0 in 'group\(0\)'; wanted a positive integer or -1")
spec("scheme-key-unicode-digit", SCHEME.replace("weight: unquantized", "weight: uint4 scale:float16:group(١٢٨):static"),
     r"{d}/s\.yaml:5: weight: bad group shape 'group\(١٢٨\)'; wanted tensor, channel, token, group\(<n>\) or "
     r"block\(<r>x<c>\)")
spec("scheme-key-huge", SCHEME.replace("weight: unquantized", "weight: uint4 scale:float16:group(" + "9" * 300 + ")"),
     r"{d}/s\.yaml:5: weight: quant key of \d+ characters; at most 256")
spec("scheme-key-float-zp", SCHEME.replace("weight: unquantized", "weight: fp8e4m3 scale:float32:tensor zp:group"),
     r"{d}/s\.yaml:5: weight: quant key 'fp8e4m3 scale:float32:tensor zp:group': a float type cannot carry a zero "
     r"point")
spec("scheme-template-unbound", SCHEME.replace("weight: unquantized", "weight: uint4 scale:float16:group($g):static"),
     r"{d}/s\.yaml:5: weight: \$g is not bound \(bindings: none\)")


@pytest.mark.parametrize(("name", "text", "expected"), _spec_cases, ids=[c[0] for c in _spec_cases])
def test_spec(capsys, tmp_path: Path, name: str, text: str, expected: str) -> None:
    f = tmp_path / "s.yaml"
    f.write_text(text)
    code, out, _ = cli(capsys, "validate", str(f))
    assert code == 2, out
    check_line(out[0], expected, tmp_path)


def test_spec_fifo_is_refused_without_blocking(capsys, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "s.yaml")
    code, out, _ = cli(capsys, "validate", str(tmp_path / "s.yaml"))
    assert code == 2
    check_line(out[0], r"{d}/s\.yaml: spec file is a FIFO; wanted a regular file", tmp_path)


def test_spec_symlink_loop(capsys, tmp_path: Path) -> None:
    os.symlink(tmp_path / "b.yaml", tmp_path / "a.yaml")
    os.symlink(tmp_path / "a.yaml", tmp_path / "b.yaml")
    code, out, err = cli(capsys, "validate", str(tmp_path / "a.yaml"))
    assert code == 2 and len(out + err) == 1
    check_line((out + err)[0], r"(error: )?{d}/a\.yaml: no such file or directory \(a dangling symlink or a "
               r"symlink loop\)", tmp_path)


def test_spec_not_utf8(capsys, tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_bytes(b"scheme: \xff\xfe\n")
    code, out, _ = cli(capsys, "validate", str(tmp_path / "s.yaml"))
    assert code == 2
    check_line(out[0], r"{d}/s\.yaml: file is not UTF-8 text", tmp_path)


def test_spec_dir_fifo_ignored_dir_listed(capsys, tmp_path: Path) -> None:
    """A FIFO inside a spec dir is not a spec file: never opened, the dir reports no spec files."""
    os.mkfifo(tmp_path / "x.yaml")
    code, _, err = cli(capsys, "explain", "examples/mixtral-8x7b-awq/config.json", "--platform", "cpu",
                       "--spec-dir", str(tmp_path))
    assert code == 0


# ---------------------------------------------------------------- configs (explain)


@dataclass(frozen=True)
class ConfigCase:
    name: str
    change: Callable[[dict], object]
    expected: str
    code: int = 2


def _set(**kv: object) -> Callable[[dict], object]:
    return lambda c: c.update(kv)


def _q(**kv: object) -> Callable[[dict], object]:
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    return lambda c: c.update(quantization_config={**base, **kv})


CFG = r"error: {d}/config\.json: "
CONFIG_CASES = [
    ConfigCase("layers-1e9-float", _set(num_hidden_layers=1e9),
               CFG + r"num_hidden_layers: got 1000000000\.0; wanted a positive integer"),
    ConfigCase("layers-1e9-int", _set(num_hidden_layers=10 ** 9),
               CFG + r"num_hidden_layers: got 1000000000; wanted an integer <= 4096"),
    ConfigCase("layers-bool", _set(num_hidden_layers=True), CFG + r"num_hidden_layers: got True; wanted a positive integer"),
    ConfigCase("layers-str", _set(num_hidden_layers="2"), CFG + r"num_hidden_layers: got '2'; wanted a positive integer"),
    ConfigCase("layers-neg", _set(num_hidden_layers=-2), CFG + r"num_hidden_layers: got -2; wanted a positive integer"),
    ConfigCase("layers-zero", _set(num_hidden_layers=0), CFG + r"num_hidden_layers: got 0; wanted a positive integer"),
    ConfigCase("experts-huge", _set(num_local_experts=10 ** 7), CFG + r"num_experts: got 10000000; wanted an integer <= 65536"),
    ConfigCase("experts-float", _set(num_local_experts=4.0), CFG + r"num_experts: got 4\.0; wanted a positive integer"),
    ConfigCase("experts-list", _set(num_local_experts=[4]), CFG + r"num_experts: got \[4\]; wanted a positive integer"),
    ConfigCase("hidden-huge", _set(hidden_size=1 << 40), CFG + r"hidden_size: got 1099511627776; wanted an integer <= 1048576"),
    ConfigCase("hidden-5000-digits", lambda c: c.update(hidden_size=10 ** 4999),
               CFG + r"hidden_size: got an integer of 5000 digits; wanted a positive integer|.*"),
    ConfigCase("inter-huge", _set(intermediate_size=1 << 30), CFG + r"intermediate_size: got 1073741824; wanted an integer <= 1048576"),
    ConfigCase("topk-float", _set(num_experts_per_tok=2.0), CFG + r"top_k: got 2\.0; wanted a positive integer"),
    ConfigCase("topk-bool", _set(num_experts_per_tok=True), CFG + r"top_k: got True; wanted a positive integer"),
    ConfigCase("topk-gt-experts", _set(num_experts_per_tok=9), CFG + r"num_experts_per_tok: 9 is more than the 4 experts"),
    ConfigCase("architectures-int", _set(architectures=5), CFG + r"architectures: got 5; wanted a list of strings"),
    ConfigCase("architectures-str", _set(architectures="MixtralForCausalLM"),
               CFG + r"architectures: got 'MixtralForCausalLM'; wanted a list of strings"),
    ConfigCase("architectures-list-int", _set(architectures=[5]), CFG + r"architectures: got \[5\]; wanted a list of strings"),
    ConfigCase("architectures-dict", _set(architectures={"a": 1}), CFG + r"architectures: got \{'a': 1\}; wanted a list of strings"),
    ConfigCase("model-type-unknown", _set(model_type="nope", architectures=[]),
               CFG + r"model_type: 'nope' is not a known MoE family .*"),
    ConfigCase("text-config-other-type", _set(text_config={"model_type": "qwen3_moe", "hidden_size": 64}),
               CFG + r"text_config\.model_type: got 'qwen3_moe'; family mixtral reads text_config only of model type "
               r"mixtral or minimax or minimax_m1 or minimax_text_01"),
    ConfigCase("text-config-type-int", _set(text_config={"model_type": 5}),
               CFG + r"text_config\.model_type: got 5; family mixtral reads .*"),
    ConfigCase("act-list", _set(hidden_act=["silu"]), CFG + r"hidden_act: got \['silu'\]; wanted an activation name .*"),
    ConfigCase("quant-config-list", _set(quantization_config=[1]), CFG + r"quantization_config must be an object, got list"),
    ConfigCase("quant-config-str", _set(quantization_config="gptq"), CFG + r"quantization_config must be an object, got str"),
    ConfigCase("gptq-dynamic-redos", _q(dynamic={"-:(a+)+$": {}}),
               r"error: quantization_config gptq-dynamic pattern: regex '\(a\+\)\+\$' nests a repetition inside a "
               r"repetition \(catastrophic backtracking\); write it without nested quantifiers"),
    ConfigCase("gptq-dynamic-redos-alt", _q(dynamic={"-:(a|aa)*b": {}}),
               r"error: quantization_config gptq-dynamic pattern: regex '\(a\|aa\)\*b' repeats an alternation .*"),
    ConfigCase("gptq-dynamic-backref", _q(dynamic={"-:(m)\\1": {}}),
               r"error: quantization_config gptq-dynamic pattern: regex '\(m\)\\\\1' uses a backreference; not allowed "
               r"in configs"),
    ConfigCase("gptq-dynamic-lookahead", _q(dynamic={"+:(?=model).*": {"bits": 8}}),
               r"error: quantization_config gptq-dynamic pattern: regex .* uses a lookaround; not allowed in configs"),
    ConfigCase("gptq-dynamic-many-stars", _q(dynamic={"-:.*a.*a.*a.*b": {}}),
               r"error: quantization_config gptq-dynamic pattern: regex .* has 4 unbounded repetitions \(\* or \+\); "
               r"at most 3"),
    ConfigCase("gptq-dynamic-long", _q(dynamic={"-:" + "a" * 600: {}}),
               r"error: quantization_config gptq-dynamic pattern: regex of 600 characters; at most 512"),
    ConfigCase("gptq-dynamic-bad-syntax", _q(dynamic={"-:[": {}}),
               r"error: quantization_config gptq-dynamic pattern: bad regex '\[': unterminated character set.*"),
    ConfigCase("gptq-dynamic-nested-braces", _q(dynamic={"-:(x{1,9}){1,9}y": {}}),
               r"error: quantization_config gptq-dynamic pattern: regex .* nests a repetition inside a repetition.*"),
    ConfigCase("ct-ignore-redos", lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["re:(.*)*x"],
        "config_groups": {}}), r"error: quantization_config ct-target pattern: regex '\(\.\*\)\*x' nests .*"),
    ConfigCase("ct-ignore-backref", lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["re:(m)(?P=x)"],
        "config_groups": {}}), r"error: quantization_config ct-target pattern: bad regex .*|.*backreference.*"),
    ConfigCase("group-size-float", _q(group_size=64.0), r"explain-refused", 1),
    ConfigCase("bits-bool", _q(bits=True), r"explain-refused", 1),
    ConfigCase("mlp-only-layers-int", _set(mlp_only_layers=5), r"no-family-field", 0),
    ConfigCase("json-5000-digit", lambda c: c.update(x=10 ** 4999),
               r"error: {d}/config\.json: config: Exceeds the limit \(4300 digits\).*"),
]


def _write_config(d: Path, change: Callable[[dict], object]) -> Path:
    cfg = base_config()
    change(cfg)
    d.mkdir(exist_ok=True)
    text = json.dumps(cfg) if not any(isinstance(v, int) and v > 10 ** 4000 for v in cfg.values()) else \
        json.dumps({k: v for k, v in cfg.items() if not isinstance(v, int) or v < 10 ** 4000})[:-1] + \
        "".join(f', "{k}": {"9" * 5000}' for k, v in cfg.items() if isinstance(v, int) and v > 10 ** 4000) + "}"
    (d / "config.json").write_text(text)
    return d / "config.json"


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[c.name for c in CONFIG_CASES])
def test_config(capsys, tmp_path: Path, case: ConfigCase) -> None:
    path = _write_config(tmp_path, case.change)
    code, out, err = cli(capsys, "explain", str(path), "--platform", "cpu")
    assert code == case.code, (out, err)
    if case.code == 2:
        assert len(err) == 1, err
        check_line(err[0], case.expected, tmp_path)
    elif case.code == 1:
        assert err[-1].startswith("error: no scheme matches") or "error:" in err[-1]


MOE = "model.layers.0.block_sparse_moe"
MOE_CFG = [  # families with a skip list / step: qwen-moe (mlp_only_layers, decoder_sparse_step)
    ("mlp-only-layers-int", {"mlp_only_layers": 5}, r"mlp_only_layers: got 5; wanted a list of layer indices"),
    ("mlp-only-layers-str", {"mlp_only_layers": "0,1"}, r"mlp_only_layers: got '0,1'; wanted a list of layer indices"),
    ("mlp-only-layers-bool", {"mlp_only_layers": [True]}, r"mlp_only_layers: got True; wanted an integer in \[0, 4096\]"),
    ("mlp-only-layers-neg", {"mlp_only_layers": [-1]}, r"mlp_only_layers: got -1; wanted an integer in \[0, 4096\]"),
    ("mlp-only-layers-float", {"mlp_only_layers": [1.0]}, r"mlp_only_layers: got 1\.0; wanted an integer in \[0, 4096\]"),
    ("sparse-step-str", {"decoder_sparse_step": "two"}, r"decoder_sparse_step: got 'two'; wanted an integer in "
                                                        r"\[-1, 4096\]"),
    ("sparse-step-float", {"decoder_sparse_step": 2.5}, r"decoder_sparse_step: got 2\.5; wanted an integer in \[-1, 4096\]"),
    ("sparse-step-huge", {"decoder_sparse_step": 10 ** 12}, r"decoder_sparse_step: got 1000000000000; wanted an "
                                                            r"integer in \[-1, 4096\]"),
    ("sparse-step-bool", {"decoder_sparse_step": True}, r"decoder_sparse_step: got True; wanted an integer in \[-1, 4096\]"),
]


def qwen_config() -> dict:
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
            "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu"}


@pytest.mark.parametrize(("name", "change", "expected"), MOE_CFG, ids=[c[0] for c in MOE_CFG])
def test_config_moe_layers(capsys, tmp_path: Path, name: str, change: dict, expected: str) -> None:
    cfg = {**qwen_config(), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli(capsys, "explain", str(tmp_path / "config.json"), "--platform", "cpu")
    assert code == 2 and len(err) == 1, err
    check_line(err[0], CFG + expected, tmp_path)


JSON_FILES = [
    ("json-200k-deep-list", "[" * 200000 + "]" * 200000, r"error: {d}/config\.json:1: JSON nests deeper than 64 levels"),
    ("json-200k-deep-object", '{"a":' * 200000 + "1" + "}" * 200000,
     r"error: {d}/config\.json:1: JSON nests deeper than 64 levels"),
    ("json-65-deep", '{"model_type": "mixtral", "x": ' + "[" * 65 + "]" * 65 + "}",
     r"error: {d}/config\.json:1: JSON nests deeper than 64 levels"),
    ("json-brackets-in-strings-ok", None, None),
    ("json-nan", '{"model_type": "mixtral", "hidden_size": NaN}',
     r"error: {d}/config\.json: config: NaN is not a JSON number; wanted finite numbers"),
    ("json-infinity", '{"model_type": "mixtral", "hidden_size": Infinity}',
     r"error: {d}/config\.json: config: Infinity is not a JSON number; wanted finite numbers"),
    ("json-5000-digit", '{"model_type": "mixtral", "hidden_size": ' + "9" * 5000 + "}",
     r"error: {d}/config\.json: config: Exceeds the limit \(4300 digits\) for integer string conversion.*"),
    ("json-list-top", "[1, 2]", r"error: {d}/config\.json: config must be a JSON object"),
    ("json-truncated", '{"model_type": ', r"error: {d}/config\.json:1: config is not valid JSON: .*"),
    ("json-not-utf8", b'{"model_type": "\xff"}', r"error: {d}/config\.json: config is not UTF-8 text"),
    ("json-too-big", b" " * (4 * 1024 * 1024 + 1) + b"{}",
     r"error: {d}/config\.json: config is 4194307 bytes; at most 4194304 are read"),
    ("json-empty", "", r"error: {d}/config\.json:1: config is not valid JSON: Expecting value"),
]


@pytest.mark.parametrize(("name", "text", "expected"), [c for c in JSON_FILES if c[1] is not None],
                         ids=[c[0] for c in JSON_FILES if c[1] is not None])
def test_config_file(capsys, tmp_path: Path, name: str, text: str | bytes, expected: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = cli(capsys, "explain", str(path), "--platform", "cpu")
    assert code == 2 and len(err) == 1, err
    check_line(err[0], expected, tmp_path)


def test_json_brackets_in_strings_are_not_depth(capsys, tmp_path: Path) -> None:
    cfg = {**base_config(), "note": "[" * 500 + "{" * 500}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli(capsys, "explain", str(tmp_path / "config.json"), "--platform", "cpu")
    assert code == 0, err


@pytest.mark.parametrize("kind", ["fifo", "loop", "dir"])
def test_config_not_a_regular_file(capsys, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)
        want = r"error: {d}/config\.json: config is a FIFO; wanted a regular file"
    elif kind == "loop":
        os.symlink(tmp_path / "other.json", path)
        os.symlink(path, tmp_path / "other.json")
        want = r"error: {d}/config\.json: (config\.json is a symlink loop|no such file or directory)"
    else:
        path.mkdir()
        want = r"error: {d}/config\.json: a model dir needs a config\.json"
    code, _, err = cli(capsys, "explain", str(path), "--platform", "cpu")
    assert code == 2 and len(err) == 1, err
    check_line(err[0], want, tmp_path)


SIDE = "hf_quant_config.json"
SIDE_CASES = [
    ("conflict-algo", {"quant_method": "modelopt", "quant_algo": "FP8"},
     {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MXFP8"}},
     r"error: {d}/config\.json: quantization_config\.quant_algo = 'FP8' but hf_quant_config\.json says "
     r"quant_algo = 'MXFP8'; remove or fix one of them", 2),
    ("conflict-flat", {"quant_method": "awq", "bits": 4}, {"bits": 8},
     r"error: {d}/config\.json: quantization_config\.bits = 4 but hf_quant_config\.json says bits = 8; remove or "
     r"fix one of them", 2),
    ("side-fifo", {"quant_method": "awq", "bits": 4}, "fifo",
     r"error: {d}/hf_quant_config\.json: hf_quant_config\.json is a FIFO; wanted a regular file", 2),
    ("side-not-object", None, [1], r"error: {d}/hf_quant_config\.json: hf_quant_config\.json must be a JSON object", 2),
    ("side-deep", None, "deep", r"error: {d}/hf_quant_config\.json:1: JSON nests deeper than 64 levels", 2),
]


@pytest.mark.parametrize(("name", "inline", "side", "expected", "code"), SIDE_CASES, ids=[c[0] for c in SIDE_CASES])
def test_hf_quant_config(capsys, tmp_path: Path, name: str, inline, side, expected: str, code: int) -> None:
    cfg = base_config()
    if inline is not None:
        cfg["quantization_config"] = inline
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if side == "fifo":
        os.mkfifo(tmp_path / SIDE)
    elif side == "deep":
        (tmp_path / SIDE).write_text("[" * 100 + "]" * 100)
    else:
        (tmp_path / SIDE).write_text(json.dumps(side))
    got, _, err = cli(capsys, "explain", str(tmp_path), "--platform", "cpu")
    assert got == code, err
    check_line(err[-1], expected, tmp_path)


# ---------------------------------------------------------------- checkpoints (run)


def _index(d: Path, weight_map: object, raw: str | None = None) -> None:
    (d / "model.safetensors.index.json").write_text(raw if raw is not None else json.dumps(
        {"metadata": {}, "weight_map": weight_map}))


def _all_in(d: Path, shard: str) -> dict[str, str]:
    return dict.fromkeys(base_tensors(), shard)


@dataclass(frozen=True)
class CkptCase:
    name: str
    prepare: Callable[[Path], object]
    expected: str
    code: int = 2


def _outside(d: Path) -> None:
    other = d.parent / "outside"
    make_model(other)
    _index(d, {**_all_in(d, "model.safetensors"), ROUTER: str(other / "model.safetensors")})


def _dotdot(d: Path) -> None:
    make_model(d.parent / "outside")
    _index(d, {**_all_in(d, "model.safetensors"), ROUTER: "../outside/model.safetensors"})


def _symlink_out(d: Path) -> None:
    make_model(d.parent / "outside")
    os.symlink(d.parent / "outside" / "model.safetensors", d / "shard2.safetensors")
    _index(d, {**_all_in(d, "model.safetensors"), ROUTER: "shard2.safetensors"})


def _symlink_loop(d: Path) -> None:
    os.symlink(d / "l2.safetensors", d / "l1.safetensors")
    os.symlink(d / "l1.safetensors", d / "l2.safetensors")
    _index(d, {**_all_in(d, "model.safetensors"), ROUTER: "l1.safetensors"})


def _fifo_shard(d: Path) -> None:
    os.mkfifo(d / "fifo.safetensors")
    _index(d, {**_all_in(d, "model.safetensors"), ROUTER: "fifo.safetensors"})


def _fifo_glob(d: Path) -> None:
    os.mkfifo(d / "zz.safetensors")


def _dev_shard(d: Path) -> None:
    _index(d, {**_all_in(d, "model.safetensors"), ROUTER: "/dev/zero"})


def _dup(d: Path) -> None:
    save_file({ROUTER: torch.zeros(EXPERTS, HIDDEN)}, str(d / "model-2.safetensors"))


def _dup_indexed(d: Path) -> None:
    save_file({ROUTER: torch.zeros(EXPERTS, HIDDEN)}, str(d / "model-2.safetensors"))
    _index(d, {**_all_in(d, "model.safetensors"), f"{EXP}.0.w1.weight": "model-2.safetensors"})


def _poke(name: str, value: float, dtype: torch.dtype | None = None) -> Callable[[dict], None]:
    def apply(t: dict) -> None:
        x = t[name].clone()
        x.view(-1)[3] = value
        t[name] = x if dtype is None else x.to(dtype)
    return apply


def _ckpt_tensors(fn: Callable[[dict], None]) -> Callable[[Path], object]:
    def prepare(d: Path) -> None:
        t = base_tensors()
        fn(t)
        save_file(t, str(d / "model.safetensors"))
    return prepare


def _rename(old: str, new: str) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(new, t.pop(old))


def _nan_fp8(t: dict) -> None:
    t["model.layers.0.block_sparse_moe.experts.0.w1.extra"] = torch.tensor([0x7F, 0], dtype=torch.uint8).view(
        torch.float8_e4m3fn)


W1 = f"{EXP}.1.w1.weight"
CKPT_CASES = [
    CkptCase("index-absolute", _outside, r"error: {d}/m/model\.safetensors\.index\.json: weight_map\["
             rf"'{re.escape(ROUTER)}'\] = '{{d}}/outside/model\.safetensors': the shard path leaves the model dir "
             r"{d}/m; wanted a file name inside it"),
    CkptCase("index-dotdot", _dotdot, r"error: {d}/m/model\.safetensors\.index\.json: weight_map\["
             rf"'{re.escape(ROUTER)}'\] = '\.\./outside/model\.safetensors': the shard path leaves the model dir "
             r"{d}/m; wanted a file name inside it"),
    CkptCase("index-symlink-outside", _symlink_out, r"error: {d}/m/model\.safetensors\.index\.json: weight_map\["
             rf"'{re.escape(ROUTER)}'\] = 'shard2\.safetensors': {{d}}/m/shard2\.safetensors resolves to "
             r"{d}/outside/model\.safetensors, outside the model dir {d}/m; wanted a file inside it"),
    CkptCase("index-symlink-loop", _symlink_loop, r"error: {d}/m/model\.safetensors\.index\.json: weight_map\["
             rf"'{re.escape(ROUTER)}'\] = 'l1\.safetensors': {{d}}/m/l1\.safetensors is a symlink loop"),
    CkptCase("index-fifo", _fifo_shard, r"error: {d}/m/fifo\.safetensors: shard is a FIFO; wanted a regular file"),
    CkptCase("index-dev", _dev_shard, r"error: .*weight_map.* = '/dev/zero': the shard path leaves the model dir .*"),
    CkptCase("index-weight-map-list", lambda d: _index(d, ["model.safetensors"]),
             r"error: {d}/m/model\.safetensors\.index\.json: weight_map is a list; wanted an object mapping tensor "
             r"names to shard files"),
    CkptCase("index-weight-map-str", lambda d: _index(d, "model.safetensors"),
             r"error: {d}/m/model\.safetensors\.index\.json: weight_map is a str; wanted an object .*"),
    CkptCase("index-no-weight-map", lambda d: _index(d, None, "{}"),
             r"error: {d}/m/model\.safetensors\.index\.json: not a safetensors index \(no weight_map object\)"),
    CkptCase("index-list", lambda d: _index(d, None, "[]"),
             r"error: {d}/m/model\.safetensors\.index\.json: not a safetensors index \(no weight_map object\)"),
    CkptCase("index-shard-int", lambda d: _index(d, {ROUTER: 5}),
             rf"error: {{d}}/m/model\.safetensors\.index\.json: weight_map\['{re.escape(ROUTER)}'\]: got 5; wanted a "
             r"shard file name"),
    CkptCase("index-shard-empty", lambda d: _index(d, {ROUTER: ""}),
             rf"error: .*weight_map\['{re.escape(ROUTER)}'\]: got ''; wanted a shard file name"),
    CkptCase("index-shard-missing", lambda d: _index(d, {ROUTER: "nope.safetensors"}),
             rf"error: {{d}}/m/model\.safetensors\.index\.json: names shard\(s\) that are not there: nope\.safetensors "
             rf"\(for '{re.escape(ROUTER)}'\)"),
    CkptCase("index-deep", lambda d: _index(d, None, "[" * 100000 + "]" * 100000),
             r"error: {d}/m/model\.safetensors\.index\.json:1: JSON nests deeper than 64 levels"),
    CkptCase("index-not-json", lambda d: _index(d, None, "{"),
             r"error: {d}/m/model\.safetensors\.index\.json:1: safetensors index is not valid JSON: .*"),
    CkptCase("index-fifo-itself", lambda d: os.mkfifo(d / "model.safetensors.index.json"),
             r"error: {d}/m/model\.safetensors\.index\.json: safetensors index is a FIFO; wanted a regular file"),
    CkptCase("glob-fifo", _fifo_glob, r"error: {d}/m/zz\.safetensors: safetensors file is a FIFO; wanted a regular file"),
    CkptCase("duplicate-tensor", _dup, rf"error: {re.escape(ROUTER)}: stored in two shards, model-2\.safetensors and "
             r"model\.safetensors; wanted exactly one"),
    CkptCase("duplicate-tensor-indexed", _dup_indexed, rf"error: {re.escape(ROUTER)}: stored in two shards, "
             r"model-2\.safetensors and model\.safetensors; wanted exactly one"),
    CkptCase("expert-leading-zero", _ckpt_tensors(_rename(f"{EXP}.3.w1.weight", f"{EXP}.03.w1.weight")),
             rf"error: {re.escape(EXP)}\.03\.w1\.weight: expert index '03' is not a canonical decimal number; wanted "
             r"e\.g\. 0, 3 or 17 \(ASCII digits, no leading zeros\)"),
    CkptCase("expert-arabic-digit", _ckpt_tensors(_rename(f"{EXP}.3.w1.weight", f"{EXP}.٣.w1.weight")),
             rf"error: {re.escape(EXP)}\.٣\.w1\.weight: expert index '٣' is not a canonical decimal number; .*"),
    CkptCase("expert-fullwidth-digit", _ckpt_tensors(_rename(f"{EXP}.3.w1.weight", f"{EXP}.３.w1.weight")),
             rf"error: {re.escape(EXP)}\.３\.w1\.weight: expert index '３' is not a canonical decimal number; .*"),
    CkptCase("expert-plus", _ckpt_tensors(_rename(f"{EXP}.3.w1.weight", f"{EXP}.+3.w1.weight")),
             rf"error: {re.escape(EXP)}\.\+3\.w1\.weight: expert index '\+3' is not a canonical decimal number; .*"),
    CkptCase("expert-huge", _ckpt_tensors(_rename(f"{EXP}.3.w1.weight", f"{EXP}.{'9' * 5000}.w1.weight")),
             rf"error: {re.escape(EXP)}\.9+\.w1\.weight: expert index '9+' is not a canonical decimal number; .*"),
    CkptCase("weight-nan", _ckpt_tensors(_poke(W1, float("nan"))),
             rf"error: {re.escape(W1)}: 1 of 512 values are NaN or infinite \(first at \[0, 3\] = nan\); expected "
             r"finite values"),
    CkptCase("weight-inf", _ckpt_tensors(_poke(W1, float("inf"))),
             rf"error: {re.escape(W1)}: 1 of 512 values are NaN or infinite \(first at \[0, 3\] = inf\); .*"),
    CkptCase("weight-neg-inf-bf16", _ckpt_tensors(lambda t: [_poke(k, float("-inf"), torch.bfloat16)(t)
                                                             for k in list(t) if k.endswith(".weight")] and None),
             r"error: model\.layers\.0\.block_sparse_moe\.\S+: 1 of \d+ values are NaN or infinite .*"),
    CkptCase("weight-nan-fp16", _ckpt_tensors(lambda t: [_poke(k, float("nan"), torch.float16)(t)
                                                         for k in list(t) if k.endswith(".weight")] and None),
             r"error: model\.layers\.0\.block_sparse_moe\.\S+: 1 of \d+ values are NaN or infinite .*"),
    CkptCase("router-nan", _ckpt_tensors(_poke(ROUTER, float("nan"))),
             rf"error: {re.escape(ROUTER)}: 1 of 128 values are NaN or infinite \(first at \[0, 3\] = nan\); .*"),
    CkptCase("router-shape", _ckpt_tensors(lambda t: t.__setitem__(ROUTER, torch.zeros(3, HIDDEN))),
             rf"error: {re.escape(ROUTER)}: shape \[3, 32\]; expected \[4, 32\] .*"),
    CkptCase("fp8-nan-code", _ckpt_tensors(_nan_fp8),
             rf"error: {re.escape(EXP)}\.0\.w1\.extra: unexpected tensor for scheme unquantized .*"),
    CkptCase("no-files", lambda d: (d / "model.safetensors").unlink(), r"error: {d}/m: no \.safetensors files"),
    CkptCase("pickle-only", lambda d: [(d / "model.safetensors").unlink(), (d / "pytorch_model.bin").write_bytes(b"x")],
             r"error: {d}/m: no \.safetensors files \(found pytorch_model\.bin: pickle checkpoints are not read, .*"),
    CkptCase("bad-header", lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 16),
             r"error: {d}/m/model\.safetensors: cannot read safetensors header: .*"),
]


@pytest.mark.parametrize("case", CKPT_CASES, ids=[c.name for c in CKPT_CASES])
def test_checkpoint(capsys, tmp_path: Path, case: CkptCase) -> None:
    d = make_model(tmp_path / "m")
    case.prepare(d)
    code, _, err = cli(capsys, "run", str(d), "--layer", "0", "--tokens", "2", "--repeat", "1", "--threads", "1")
    assert code == case.code, err
    check_line(err[-1], case.expected, tmp_path)


def test_fp8_and_e8m0_codes_are_refused_at_load() -> None:
    from moe_registry.core.guards import check_tensor_values

    fp8 = torch.tensor([0x00, 0x38, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(MoERegistryError, match=r"^w: 1 of 3 values are the fp8 e4m3fn NaN encoding \(0x7f/0xff\) "
                       r"\(first at \[2\] = 0xff\); expected finite values$"):
        check_tensor_values("w", fp8)
    e8 = torch.tensor([127, 0, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(MoERegistryError, match=r"^s: 1 of 3 values are 0xff \(NaN\) in e8m0 .*first at \[2\] = 0xff"):
        check_tensor_values("s", e8)
    # 0x00 is 2^-127, the scale MX quantizers give an all-zero block: kept
    check_tensor_values("zero-block", torch.tensor([0, 127], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    check_tensor_values("ok", torch.tensor([1, 2], dtype=torch.uint8).view(torch.float8_e4m3fn))


# ---------------------------------------------------------------- flags and run inputs


def _inputs(d: Path, **tensors: torch.Tensor) -> str:
    save_file(tensors, str(d / "in.safetensors"))
    return str(d / "in.safetensors")


FLAG_CASES = [
    ("tokens-1e9", ["--tokens", "1000000000"], r"error: --tokens: got 1000000000; wanted an integer in \[1, 65536\]"),
    ("tokens-zero", ["--tokens", "0"], r"error: --tokens: got 0; wanted at least 1"),
    ("tokens-neg", ["--tokens", "-3"], r"error: --tokens: got -3; wanted at least 1"),
    ("max-tokens-neg", ["--max-tokens", "-7"], r"error: --max-tokens: got -7; wanted at least 1"),
    ("max-tokens-below-tokens", ["--max-tokens", "1", "--tokens", "4"],
     r"error: --max-tokens: 4 tokens to run; the token budget is 1"),
    ("repeat-huge", ["--repeat", "1000000000"], r"error: --repeat: got 1000000000; wanted an integer in \[1, 100000\]"),
    ("repeat-zero", ["--repeat", "0"], r"error: --repeat: got 0; wanted at least 1"),
    ("threads-huge", ["--threads", "100000"], r"error: --threads: got 100000; wanted an integer in \[1, 4096\]"),
    ("threads-zero", ["--threads", "0"], r"error: --threads: got 0; wanted at least 1"),
    ("layer-neg", ["--layer", "-1"], r"error: .*layer.*-1.*"),
    ("layer-huge", ["--layer", "99999"], r"error: .*layer.*99999.*"),
    ("save-output-missing-dir", ["--save-output", "{d}/no/such/dir/out.safetensors"],
     r"error: --save-output: {d}/no/such/dir is not a directory; create it first \(nothing was run\)"),
    ("inputs-missing", ["--inputs", "{d}/nope.safetensors"], r"error: {d}/nope\.safetensors: no such file or directory"),
    ("ep-2", ["--ep", "2"], r"error: --ep 2: run is one process .*"),
    ("all2all", ["--all2all", "pplx"], r"error: --all2all pplx: .*"),
    ("tokens-not-int", ["--tokens", "1e3"], r"moe-registry run: error: argument --tokens: invalid int value: '1e3'.*"),
]


@pytest.mark.parametrize(("name", "flags", "expected"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_run_flags(capsys, tmp_path: Path, name: str, flags: list[str], expected: str) -> None:
    d = make_model(tmp_path / "m")
    flags = [f.replace("{d}", str(tmp_path)) for f in flags]
    base = {"--tokens": "2", "--repeat": "1", "--threads": "1"}
    for f in flags:
        base.pop(f, None)
    argv = ["run", str(d), "--layer", "0", *[x for kv in base.items() for x in kv], *flags]
    try:
        code, _, err = cli(capsys, *argv)
    except SystemExit as exc:  # argparse usage errors
        code, err = exc.code, capsys.readouterr().err.splitlines()
    assert code == 2, err
    check_line(err[-1], expected, tmp_path)


def test_explain_max_tokens_negative(capsys) -> None:
    code, _, err = cli(capsys, "explain", "examples/mixtral-8x7b-awq/config.json", "--platform", "cpu",
                       "--max-tokens", "-7")
    assert code == 2 and len(err) == 1
    assert re.fullmatch(r"error: --max-tokens: got -7; wanted .*", err[0]), err


INPUT_CASES = [
    ("bool-hidden", lambda: {"hidden_states": torch.ones(2, HIDDEN, dtype=torch.bool)},
     r"error: {d}/in\.safetensors: hidden_states dtype bool; wanted float16, bfloat16 or float32"),
    ("int-hidden", lambda: {"hidden_states": torch.ones(2, HIDDEN, dtype=torch.int32)},
     r"error: {d}/in\.safetensors: hidden_states dtype int32; wanted float16, bfloat16 or float32"),
    ("zero-tokens", lambda: {"hidden_states": torch.zeros(0, HIDDEN)},
     r"error: {d}/in\.safetensors: hidden_states has 0 tokens; wanted at least 1"),
    ("nan-hidden", lambda: {"hidden_states": torch.full((2, HIDDEN), float("nan"))},
     r"error: {d}/in\.safetensors: hidden_states holds NaN or infinite values; wanted finite values"),
    ("inf-hidden", lambda: {"hidden_states": torch.full((2, HIDDEN), float("inf"))},
     r"error: {d}/in\.safetensors: hidden_states holds NaN or infinite values; wanted finite values"),
    ("wrong-hidden", lambda: {"hidden_states": torch.zeros(2, HIDDEN + 1)},
     r"error: {d}/in\.safetensors: hidden_states shape \[2, 33\]; expected \[tokens, 32\]"),
    ("3d-hidden", lambda: {"hidden_states": torch.zeros(1, 2, HIDDEN)},
     r"error: {d}/in\.safetensors: hidden_states shape \[1, 2, 32\]; expected \[tokens, 32\]"),
    ("no-hidden", lambda: {"x": torch.zeros(2, HIDDEN)},
     r"error: {d}/in\.safetensors: no tensor named hidden_states \(found x\)"),
    ("topk-3", lambda: {"hidden_states": torch.randn(2, HIDDEN), "topk_ids": torch.tensor([[0, 1, 2], [1, 2, 3]]),
                        "topk_weights": torch.full((2, 3), 0.3)},
     r"error: {d}/in\.safetensors: topk_ids shape \[2, 3\]; wanted \[tokens, 2\] \(num_experts_per_tok 2 from "
     r"config\.json\)"),
    ("topk-1", lambda: {"hidden_states": torch.randn(2, HIDDEN), "topk_ids": torch.tensor([[0], [1]]),
                        "topk_weights": torch.ones(2, 1)},
     r"error: {d}/in\.safetensors: topk_ids shape \[2, 1\]; wanted \[tokens, 2\] .*"),
    ("ids-out-of-range", lambda: {"hidden_states": torch.randn(2, HIDDEN), "topk_ids": torch.tensor([[0, 9], [1, 2]]),
                                  "topk_weights": torch.ones(2, 2)}, r"error: {d}/in\.safetensors: .*"),
    ("ids-without-weights", lambda: {"hidden_states": torch.randn(2, HIDDEN), "topk_ids": torch.tensor([[0, 1]])},
     r"error: {d}/in\.safetensors: give both topk_ids and topk_weights, or neither"),
    ("float-ids", lambda: {"hidden_states": torch.randn(2, HIDDEN), "topk_ids": torch.zeros(2, 2),
                           "topk_weights": torch.ones(2, 2)},
     r"error: {d}/in\.safetensors: topk_ids repeats an expert within a token's row; wanted distinct experts"),
    ("repeated-ids", lambda: {"hidden_states": torch.randn(2, HIDDEN), "topk_ids": torch.tensor([[1, 1], [0, 2]]),
                              "topk_weights": torch.ones(2, 2)},
     r"error: {d}/in\.safetensors: topk_ids repeats an expert within a token's row; wanted distinct experts"),
]


@pytest.mark.parametrize(("name", "make", "expected"), INPUT_CASES, ids=[c[0] for c in INPUT_CASES])
def test_run_inputs(capsys, tmp_path: Path, name: str, make, expected: str) -> None:
    d = make_model(tmp_path / "m")
    path = _inputs(tmp_path, **make())
    code, _, err = cli(capsys, "run", str(d), "--layer", "0", "--inputs", path, "--repeat", "1", "--threads", "1")
    assert code == 2, err
    check_line(err[-1], expected, tmp_path)


def test_inputs_fifo(capsys, tmp_path: Path) -> None:
    d = make_model(tmp_path / "m")
    os.mkfifo(tmp_path / "in.safetensors")
    code, _, err = cli(capsys, "run", str(d), "--inputs", str(tmp_path / "in.safetensors"))
    assert code == 2
    check_line(err[-1], r"error: {d}/in\.safetensors: --inputs file is a FIFO; wanted a regular file", tmp_path)


def test_clean_model_runs(capsys, tmp_path: Path) -> None:
    """The corpus's base model is fine: every refusal above comes from the one thing broken."""
    d = make_model(tmp_path / "m")
    code, out, err = cli(capsys, "run", str(d), "--layer", "0", "--tokens", "2", "--repeat", "1", "--threads", "1",
                         "--save-output", str(tmp_path / "o.safetensors"))
    assert code == 0, err
    from safetensors.torch import load_file

    assert bool(torch.isfinite(load_file(str(tmp_path / "o.safetensors"))["output"]).all())


# ---------------------------------------------------------------- committed corpus files


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.yaml")), ids=lambda p: p.name)
def test_committed_spec_corpus(capsys, path: Path) -> None:
    want = path.read_text().splitlines()[0].removeprefix("# expect: ")
    code, out, _ = cli(capsys, "validate", str(path))
    assert code == 2
    check_line(out[0], re.escape(str(path)) + want, path.parent)


# ---------------------------------------------------------------- seeded fuzz

_ALPHABET = list("abcdefgsintuxzcpl0123456789()*:/$,_- .+%@[]{}\\^!") + [
    "uint4", "int8", "fp8e4m3", "e8m0", "float16", "scale:", "zp:", "group(", "block(", "token", "channel",
    "static", "dynamic", "in", "out", "ceil(", "groups(", "__", "\u0663", "//", "9" * 30, "-1", "x"]


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, n)))


def test_fuzz_key_parser() -> None:
    from moe_registry.core.keys import parse_quant_key

    rng = random.Random(24)
    for _ in range(400):
        text = _random_text(rng, 12)
        try:
            key = parse_quant_key(text)
        except MoERegistryError:
            continue
        assert parse_quant_key(str(key)) == key


def test_fuzz_shape_expressions() -> None:
    from moe_registry.spec.expr import parse_expr, parse_limit, parse_shape_dim

    rng = random.Random(24)
    for _ in range(400):
        text = _random_text(rng, 10)
        for fn in (parse_expr, parse_shape_dim, lambda t: parse_limit(t, "max")):
            try:
                expr = fn(text)
            except MoERegistryError:
                continue
            with contextlib.suppress(MoERegistryError):
                expr.evaluate({"in": rng.randint(-5, 4096), "out": rng.randint(0, 4096),
                               **{f"${b}": rng.choice([-1, 0, 1, 128]) for b in expr.bindings}})


def test_fuzz_detection() -> None:
    """Random quantization_configs: detection answers or raises the project's errors, nothing else."""
    from moe_registry.oracle.select import select
    from moe_registry.situation.config import read_model_config
    from moe_registry.situation.describe import Flags, situation_for_model
    from moe_registry.spec.loader import load_registry

    registry = load_registry()
    rng = random.Random(24)
    words = ["gptq", "awq", "fp8", "modelopt", "compressed-tensors", "quark", "MXFP8", "int", "float", "group",
             "channel", "token", "re:.*gate", "-:.*experts.*", "(a+)+", "[", "lm_head", "*"]
    values = [None, True, False, 0, -1, 4, 8, 64, 64.0, 128, 1e308, "x", [], {}, [1, "a"], {"a": 1}]

    def value(depth: int) -> object:
        r = rng.random()
        if depth < 3 and r < 0.15:
            return {rng.choice(words + ["bits", "group_size", "dynamic", "ignore", "config_groups"]): value(depth + 1)
                    for _ in range(rng.randint(0, 3))}
        if depth < 3 and r < 0.25:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return rng.choice(values + words)

    keys = ["quant_method", "bits", "group_size", "sym", "desc_act", "dynamic", "ignore", "format", "config_groups",
            "quant_algo", "quantization", "zero_point", "version", "weight_block_size", "fmt", "activation_scheme",
            "checkpoint_format", "modules_to_not_convert", "exclude_modules", "producer", "layer_quant_config",
            "global_quant_config"]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        for _ in range(300):
            q = {k: value(0) for k in rng.sample(keys, rng.randint(0, 6))}
            if rng.random() < 0.5:
                q["quant_method"] = rng.choice(words[:5])
            path.write_text(json.dumps({**base_config(), "quantization_config": q}))
            try:
                model = read_model_config(path, registry)
                select(registry, situation_for_model(model, registry, Flags(platform="cpu")))
            except MoERegistryError:
                pass


def test_output_overflow_is_refused_not_written(capsys, tmp_path: Path) -> None:
    """Finite float32 hidden states that overflow float16 give inf/NaN outputs: refused, nothing saved."""
    d = make_model(tmp_path / "m")
    path = _inputs(tmp_path, hidden_states=torch.full((2, HIDDEN), 1e30))
    out_file = tmp_path / "out.safetensors"
    code, _, err = cli(capsys, "run", str(d), "--layer", "0", "--inputs", path, "--dtype", "float16",
                       "--repeat", "1", "--threads", "1", "--save-output", str(out_file))
    assert code == 2, err
    check_line(err[-1], r"error: {d}/in\.safetensors: \d+ of 64 output values are NaN or infinite in float16 "
               r"\(the hidden states overflow it\); nothing was written", tmp_path)
    assert not out_file.exists()
