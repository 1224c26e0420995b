"""The generated support matrix is current, and the schema / list commands print what they claim."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from moe_registry.cli import main as cli
from moe_registry.cli.matrix import MATRIX_PLATFORMS, matrix_markdown, support_matrix
from moe_registry.spec.loader import SPEC_PATH_ENV, load_registry

ROOT = Path(__file__).resolve().parent.parent
MATRIX_DOC = ROOT / "docs" / "support-matrix.md"
REGENERATE = "regenerate it with: python -m moe_registry matrix > docs/support-matrix.md"


@pytest.fixture(autouse=True)
def builtin_specs_only(monkeypatch):
    monkeypatch.delenv(SPEC_PATH_ENV, raising=False)


def test_support_matrix_doc_is_current():
    assert MATRIX_DOC.is_file(), f"docs/support-matrix.md is missing; {REGENERATE}"
    assert MATRIX_DOC.read_text() == matrix_markdown(load_registry()), \
        f"docs/support-matrix.md is out of date with the specs; {REGENERATE}"


def test_matrix_command_prints_the_doc(capsys):
    assert cli.main(["matrix"]) == 0
    assert capsys.readouterr().out == MATRIX_DOC.read_text()


def test_matrix_rows():
    registry = load_registry()
    rows = {r["scheme"]: r for r in support_matrix(registry)}
    assert set(rows) == set(registry.schemes)
    awq = rows["awq-w4a16"]
    # every group size the scheme allows, not only the first one the cells were computed with
    assert awq["weight"] == "uint4 scale:float16:group(32|64|128|-1):static zp:group"
    assert rows["compressed-tensors-w4a8-int"]["weight"] == "uint4b8 scale:float32:group(32|64|128):static"
    assert awq["activation"] == "unquantized"
    assert awq["cells"] == {"cpu": ["torch-cpu-dot8", "torch-cpu-packed", "torch-cpu-native", "torch-reference"],
                            "cuda:8.0": ["triton-fused-moe", "torch-reference"],
                            "cuda:9.0": ["triton-fused-moe", "torch-reference"],
                            "cuda:10.0": ["triton-fused-moe", "torch-reference"], "rocm:9.4": ["torch-reference"]}
    w4a8 = rows["compressed-tensors-w4a8-int"]
    assert w4a8["activation"] == "int8 scale:float32:token:dynamic"
    # int4 weights with int8 activations: Triton on CUDA, the compiled CPU kernel's int32 dots, else the reference
    assert w4a8["cells"]["cpu"] == ["torch-cpu-native", "torch-reference"]
    assert w4a8["cells"]["rocm:9.4"] == ["torch-reference"]
    assert w4a8["cells"]["cuda:9.0"] == ["triton-fused-moe", "torch-reference"]
    # fp8-block128 lists the reference before the CPU packed kernel on purpose; the cell keeps that order
    assert rows["fp8-block128"]["cells"]["cpu"] == ["torch-cpu-dot8", "torch-cpu-native", "torch-reference",
                                                    "torch-cpu-packed"]
    for row in rows.values():
        assert list(row["cells"]) == list(MATRIX_PLATFORMS)
        for cell in row["cells"].values():
            kernels = registry.scheme(row["scheme"]).kernels
            assert cell == [k for k in kernels if k in cell], "cells keep the scheme's preference order"


def test_matrix_markdown_table():
    text = matrix_markdown(load_registry())
    lines = text.splitlines()
    header = "| scheme | weight | activation | " + " | ".join(MATRIX_PLATFORMS) + " |"
    assert header in lines
    table = lines[lines.index(header):]
    assert table[1] == "|" + " --- |" * (3 + len(MATRIX_PLATFORMS))
    assert len(table) == 2 + len(load_registry().schemes)
    assert ("| `awq-w4a16` | `uint4 scale:float16:group(32\\|64\\|128\\|-1):static zp:group` | `unquantized` | "
            "torch-cpu-dot8, torch-cpu-packed, torch-cpu-native, torch-reference |") in "\n".join(table), \
        "a | inside a cell is escaped"
    for row in table:
        assert row.replace("\\|", "").count("|") == 4 + len(MATRIX_PLATFORMS), row
    assert ("| `fp8-block128` | `fp8e4m3 scale:float32:block(128x128):static` | "
            "`fp8e4m3 scale:float32:group(128):dynamic` | torch-cpu-dot8, torch-cpu-native, torch-reference, "
            "torch-cpu-packed | "
            "triton-fused-moe, torch-reference | "  # before sm_89: weight-only (the key pattern's emulation)
            "triton-fused-moe, torch-reference | triton-fused-moe, torch-reference | torch-reference |") in table


def test_matrix_json_and_user_specs(tmp_path, capsys):
    d = tmp_path / "schemes"
    d.mkdir()
    awq = (ROOT / "specs" / "schemes" / "awq-w4a16.yaml").read_text()
    kernels_line = ("kernels: [triton-fused-moe, triton-batched-moe, torch-cpu-dot8, torch-cpu-packed, "
                    "torch-cpu-native, torch-reference]")
    assert kernels_line in awq
    (d / "awq-cpu-only.yaml").write_text(
        awq.replace("scheme: awq-w4a16", "scheme: awq-cpu-only")
           .replace("quant_method: {one_of: [awq, awq_marlin], case: insensitive}", "quant_method: {equals: awq-cpu}")
           .replace(kernels_line, "kernels: [torch-reference]"))
    assert cli.main(["matrix", "--json", "--spec-dir", str(tmp_path)]) == 0
    rows = {r["scheme"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["awq-cpu-only"]["cells"]["cuda:9.0"] == ["torch-reference"]
    assert rows["awq-w4a16"]["cells"]["cuda:9.0"] == ["triton-fused-moe", "torch-reference"]


def test_schema_command(capsys):
    """Without a kind: one JSON Schema an editor can use for any spec file (oneOf the five kinds)."""
    assert cli.main(["schema"]) == 0
    top = json.loads(capsys.readouterr().out)
    assert top["$schema"].startswith("https://json-schema.org/")
    assert top["oneOf"] == [{"$ref": "#/$defs/SchemeSpec"}, {"$ref": "#/$defs/KernelSpec"},
                            {"$ref": "#/$defs/ModelFamilySpec"}, {"$ref": "#/$defs/FormatSpec"},
                            {"$ref": "#/$defs/KeySetSpec"}]
    schema = {k: top["$defs"][t] for k, t in (("scheme", "SchemeSpec"), ("kernel", "KernelSpec"),
                                              ("family", "ModelFamilySpec"))}
    refs = set(re.findall(r'"#/\$defs/([A-Za-z]+)"', json.dumps(top)))
    assert refs <= set(top["$defs"]), "every $ref resolves inside the one document"
    for kind, body in schema.items():
        assert body["type"] == "object"
        assert kind in body["properties"] and kind in body["required"]
        assert body["additionalProperties"] is False, "unknown fields are errors"
    assert {"detect", "bind", "weight", "activation", "checkpoint", "kernels"} <= set(schema["scheme"]["properties"])
    assert {"impl", "platforms", "keys", "dtypes"} <= set(schema["kernel"]["properties"])
    assert {"match", "fields", "naming"} <= set(schema["family"]["properties"])
    # aliases, as written in YAML: a binding reads `from`, not `from_`
    assert "from" in top["$defs"]["BindRule"]["properties"]
    assert "from_" not in top["$defs"]["BindRule"]["properties"]


def test_schema_of_one_kind(capsys):
    assert cli.main(["schema", "kernel"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "KernelSpec"
    assert schema["properties"]["platforms"]["minItems"] == 1


def test_list_schemes_json(capsys):
    assert cli.main(["list", "schemes", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    registry = load_registry()
    assert [r["scheme"] for r in rows] == sorted(registry.schemes)
    by_name = {r["scheme"]: r for r in rows}
    assert by_name["gptq-w4a16"]["kernels"] == ["triton-fused-moe", "triton-batched-moe", "torch-cpu-dot8",
                                                "torch-cpu-packed", "torch-cpu-native", "torch-reference"]
    assert by_name["gptq-w4a16"]["summary"] == registry.scheme("gptq-w4a16").summary
    for r in rows:
        assert Path(r["path"]).is_file() and Path(r["path"]).name == f"{r['scheme']}.yaml"


def test_list_kernels_and_families(capsys):
    assert cli.main(["list", "kernels", "--json"]) == 0
    rows = {r["kernel"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["triton-fused-moe"]["platforms"] == ["cuda >=8.0"]
    assert rows["torch-reference"]["platforms"] == ["cpu", "cuda >=7.0", "rocm"]
    assert cli.main(["list", "families"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(load_registry().families)
