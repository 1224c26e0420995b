"""The support matrix (scheme × platform → kernels), generated from the specs alone."""

from __future__ import annotations

from moe_registry.keys import parse_quant_key
from moe_registry.predicates import kernel_checks
from moe_registry.registry import Registry, binding_samples, fill_template
from moe_registry.runtime import RuntimeConfig, parse_platform

MATRIX_PLATFORMS = ("cpu", "cuda:8.0", "cuda:9.0", "cuda:10.0", "rocm:9.4")


def support_matrix(registry: Registry, platforms: tuple[str, ...] = MATRIX_PLATFORMS) -> list[dict[str, object]]:
    """For each scheme and platform, the eligible kernels in preference order (shape-independent,
    bf16 activations, no parallelism; a scheme with bindings uses their first listed values)."""
    rows = []
    for name, loaded in sorted(registry.schemes.items()):
        scheme = loaded.spec
        bindings = binding_samples(scheme)[0]
        weight = parse_quant_key(fill_template(scheme.weight, bindings))
        activation = parse_quant_key(fill_template(scheme.activation, bindings))
        cells = {}
        for plat in platforms:
            runtime = RuntimeConfig(parse_platform(plat), "bfloat16")
            cells[plat] = [k for k in scheme.kernels if k in registry.kernels and all(
                c.passed for c in kernel_checks(registry.kernel(k), runtime, weight, activation, bindings,
                                                {}, scheme.checkpoint.format))]
        rows.append({"scheme": name, "weight": str(weight), "activation": str(activation), "cells": cells})
    return rows


def matrix_markdown(registry: Registry) -> str:
    """The matrix as the Markdown page checked in at docs/support-matrix.md."""
    lines = ["# Support matrix", "",
             "Generated from the specs by `moe-registry matrix`; a test keeps this file current. "
             "Each cell lists the eligible kernels, preferred first (bf16 activations, no parallelism).", "",
             "| scheme | weight | activation | " + " | ".join(MATRIX_PLATFORMS) + " |",
             "|" + " --- |" * (3 + len(MATRIX_PLATFORMS))]
    for r in support_matrix(registry):
        cells = r["cells"]
        assert isinstance(cells, dict)
        lines.append(f"| `{r['scheme']}` | `{r['weight']}` | `{r['activation']}` | "
                     + " | ".join(", ".join(cells[p]) or "—" for p in MATRIX_PLATFORMS) + " |")
    return "\n".join(lines) + "\n"
