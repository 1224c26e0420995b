"""Broken specs must be refused with one precise line each (file:line, field, what was wanted),
and nothing in a spec may ever be executed. tests/spec_corpus/expected.yaml is the table of cases."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import yaml

from moe_registry.cli import main as cli
from moe_registry.core.errors import SpecError
from moe_registry.spec.loader import SPEC_PATH_ENV, load_registry
from moe_registry.spec.validation import validate_paths
from moe_registry.spec.yamlio import MAX_SPEC_BYTES, load_yaml_text

CORPUS = Path(__file__).parent / "spec_corpus"
EXPECTED: dict[str, list[str | list[str]]] = yaml.safe_load((CORPUS / "expected.yaml").read_text())

GOOD_SCHEME = """\
scheme: corpus-good
summary: a valid user scheme, the baseline the broken ones are mutations of
detect:
  quant_method: {equals: corpus}
bind:
  group: {from: group_size, one_of: [64, 128]}
weight: uint4b8 scale:float16:group($group):static
activation: unquantized
checkpoint:
  format: gptq
  tensors:
    qweight: {dtype: int32, shape: [in / 8, out]}
    scales: {dtype: float16, shape: ["groups(in, $group)", out]}
kernels: [corpus-good-kernel, torch-reference]
"""

GOOD_KERNEL = """\
kernel: corpus-good-kernel
summary: a valid user kernel
impl: moe_registry_kernels.reference:ReferenceExperts
platforms: [{device: cpu}, {device: cuda, capability: ">=8.0,<10.0"}]
dtypes: [bfloat16]
keys:
  - {weight: "uint4b8 scale:float16:group(*):static", activation: unquantized}
activations: [silu]
shapes:
  hidden: {multiple_of: $group}
"""


@pytest.fixture(autouse=True)
def builtin_specs_only(monkeypatch):
    monkeypatch.delenv(SPEC_PATH_ENV, raising=False)


def relative(problem: SpecError) -> str:
    return str(problem).replace(str(CORPUS) + "/", "")


def test_corpus_table_is_complete():
    on_disk = {p.name for p in CORPUS.iterdir() if p.name != "expected.yaml"}
    assert on_disk == set(EXPECTED), (
        f"files without an entry: {sorted(on_disk - set(EXPECTED))}; "
        f"entries without a file: {sorted(set(EXPECTED) - on_disk)}")
    assert len(EXPECTED) >= 32


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_spec_is_refused_with_its_message(name: str):
    problems = validate_paths([CORPUS / name])
    got = [relative(p) for p in problems]
    wanted = EXPECTED[name]
    assert len(got) == len(wanted), f"{name}: wanted {len(wanted)} problem(s), got {got}"
    for line, want in zip(got, wanted, strict=True):
        parts = [want] if isinstance(want, str) else want
        assert "\n" not in line
        # The first substring is the message's start: file[:line]: field: ...
        assert line.startswith(parts[0]), f"{line!r} does not start with {parts[0]!r}"
        for part in parts[1:]:
            assert part in line, f"{part!r} not in {line!r}"


def test_every_shipped_spec_validates():
    assert validate_paths([]) == []
    registry = load_registry()
    assert registry.problems == ()
    assert {"awq-w4a16", "gptq-w4a16", "unquantized"} <= set(registry.schemes)
    assert {"torch-reference", "triton-fused-moe"} <= set(registry.kernels)


def test_cli_validate_builtins(capsys):
    assert cli.main(["validate"]) == 0
    n = len(list((Path(__file__).parent.parent / "specs").glob("*/*.yaml")))
    assert capsys.readouterr().out.strip() == f"{n} files (the built-in specs), all valid"


def test_valid_user_specs_pass(tmp_path: Path, capsys):
    """The baseline the corpus mutates is itself valid: the errors above come from the mutation."""
    d = tmp_path / "specs"
    (d / "schemes").mkdir(parents=True)
    (d / "kernels").mkdir()
    (d / "schemes" / "good.yaml").write_text(GOOD_SCHEME)
    (d / "kernels" / "good.yaml").write_text(GOOD_KERNEL)
    assert validate_paths([d]) == []
    assert cli.main(["validate", str(d)]) == 0
    assert capsys.readouterr().out == "2 files, all valid\n"
    registry = load_registry([d])
    assert registry.scheme("corpus-good").kernels == ["corpus-good-kernel", "torch-reference"]
    assert not registry.schemes["corpus-good"].builtin


def test_validate_rejects_a_kernel_claim_no_scheme_exercises(tmp_path: Path, capsys):
    """A key pattern that no scheme listing the kernel binds cannot be conformance-tested."""
    d = tmp_path / "specs"
    d.mkdir()
    (d / "good.yaml").write_text(GOOD_SCHEME)
    extra = '  - {weight: "int8 scale:float32:channel:static", activation: "int8 scale:float32:token:dynamic"}\n'
    (d / "kernel.yaml").write_text(GOOD_KERNEL.replace("keys:\n", "keys:\n" + extra))
    assert cli.main(["validate", str(d)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "1 problem in 2 files"
    assert out[:-1] == [f"{d / 'kernel.yaml'}:1: keys[0]: no scheme that lists corpus-good-kernel binds a key pair "
                   "matching 'int8 scale:float32:channel:static' / 'int8 scale:float32:token:dynamic', "
                   "so no conformance case tests it"]


@pytest.mark.parametrize("name", ["unknown_field_top.yaml", "missing_required.yaml", "duplicate_scheme",
                                  "yaml_python_tag.yaml", "key_zero_point_on_float.yaml"])
def test_cli_validate_prints_one_line_per_problem(name: str, capsys):
    assert cli.main(["validate", str(CORPUS / name)]) == 2
    out, err = capsys.readouterr()
    lines = [relative_line(x) for x in out.splitlines()]
    summary = lines.pop()
    wanted = EXPECTED[name]
    assert len(lines) == len(wanted)
    for line, want in zip(lines, wanted, strict=True):
        assert line.startswith(want if isinstance(want, str) else want[0])
    assert summary.startswith(f"{len(wanted)} problem{'s' if len(wanted) > 1 else ''} in "), summary
    assert err == "" and "Traceback" not in out


def relative_line(line: str) -> str:
    return line.replace(str(CORPUS) + "/", "")


def test_cli_validate_several_files_lists_all(capsys):
    names = ["unknown_field_top.yaml", "missing_required.yaml", "expr_lambda.yaml"]
    assert cli.main(["validate", *(str(CORPUS / n) for n in names)]) == 2
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 5  # 1 + 2 + 1, then the count
    assert out.splitlines()[-1] == "4 problems in 3 files" and err == ""


def test_strict_load_of_a_bad_user_dir_raises_every_problem():
    with pytest.raises(SpecError) as info:
        load_registry([CORPUS / "duplicate_kernel"])
    assert "duplicate kernel name 'corpus-dup-kernel'" in str(info.value)
    lenient = load_registry([CORPUS / "duplicate_kernel"], strict=False)
    assert len(lenient.problems) == 1
    assert lenient.kernels["corpus-dup-kernel"].spec.dtypes == ["bfloat16"]  # the first one is kept


def test_missing_path():
    problems = validate_paths([CORPUS / "no-such-file.yaml"])
    assert [str(p) for p in problems] == [f"{CORPUS / 'no-such-file.yaml'}: no such file or directory"]


# ---------------------------------------------------------------- generated cases


def test_oversized_file_is_refused_before_reading(tmp_path: Path):
    big = tmp_path / "big.yaml"
    filler = "# padding padding padding padding padding padding padding padding\n"
    big.write_text("scheme: big\n" + filler * (MAX_SPEC_BYTES // len(filler) + 1))
    size = big.stat().st_size
    assert size > MAX_SPEC_BYTES
    problems = validate_paths([big])
    assert [str(p) for p in problems] == [f"{big}: file is {size} bytes; specs may be at most {MAX_SPEC_BYTES}"]
    with pytest.raises(SpecError, match="larger than 256 KiB"):
        load_yaml_text(big.read_text(), "text.yaml")


def test_non_utf8_file(tmp_path: Path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("scheme: caf\xe9\n".encode("latin-1"))
    assert [str(p) for p in validate_paths([bad])] == [f"{bad}: file is not UTF-8 text"]


def test_alias_bomb_costs_nothing(tmp_path: Path):
    """A bomb expanding to 10**10 strings is refused at the first alias, without expanding it."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 11):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\nscheme: bomb\n")
    tracemalloc.start()
    try:
        problems = validate_paths([bomb])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # expanding even one level-4 alias would hold 10**4 strings per use; all: 10**10
    assert [str(p) for p in problems] == [f"{bomb}:2: YAML aliases (*name) are not allowed in specs"]


PAYLOADS = {
    "apply": "!!python/object/apply:os.system ['touch {marker}']",
    "new": "!!python/object/new:subprocess.call [['touch', '{marker}']]",
    "name": "!!python/name:os.system",
    "module": "!!python/module:os",
    "nested": "[1, {{x: !!python/object/apply:os.system ['touch {marker}']}}]",
}


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_python_tags_are_never_executed(kind: str, tmp_path: Path):
    marker = tmp_path / f"pwned-{kind}"
    spec = tmp_path / "evil.yaml"
    spec.write_text("scheme: evil\nsummary: " + PAYLOADS[kind].format(marker=marker) + "\n")
    problems = validate_paths([spec])
    assert cli.main(["validate", str(spec)]) == 2
    assert len(problems) == 1
    assert "is not allowed (specs are plain data)" in str(problems[0])
    assert str(problems[0]).startswith(f"{spec}:2: YAML tag 'tag:yaml.org,2002:python/")
    assert not marker.exists()


def test_the_payload_is_live(tmp_path: Path):
    """The file those payloads would create does appear under an unsafe loader, so the test above
    would notice a loader that executes tags."""
    marker = tmp_path / "pwned-live"
    yaml.unsafe_load("summary: " + PAYLOADS["apply"].format(marker=marker))
    assert marker.exists()


def test_shape_expression_is_never_evaluated_by_python(tmp_path: Path):
    marker = tmp_path / "pwned-expr"
    spec = tmp_path / "evil.yaml"
    spec.write_text(GOOD_SCHEME.replace('"groups(in, $group)"',
                                        f"\"__import__('os').system('touch {marker}')\""))
    problems = validate_paths([spec])
    assert len(problems) == 1
    assert "checkpoint.tensors.scales.shape: name '__import__' is not allowed" in str(problems[0])
    assert not marker.exists()
