"""The support matrix (scheme × platform → kernels), generated from the specs alone."""

from __future__ import annotations

from moe_registry.core.keys import parse_quant_key
from moe_registry.oracle.predicates import kernel_checks
from moe_registry.situation.runtime import RuntimeConfig, parse_platform
from moe_registry.spec.loader import Registry, binding_samples, fill_template
from moe_registry.spec.view import SchemeSpec

MATRIX_PLATFORMS = ("cpu", "cuda:8.0", "cuda:9.0", "cuda:10.0", "rocm:9.4")


_SENTINEL = 987654321  # an integer no spec uses, standing in for a binding while a key is rendered


def key_with_choices(template: str, scheme: SchemeSpec) -> str:
    """A key template in its canonical form with each integer binding shown as the set of values it
    may take: ``group(32|64|128|-1)``, not the one sample value the matrix was computed with."""
    samples = binding_samples(scheme)
    choices: dict[str, list[object]] = {}
    for name in scheme.bind:
        values = list(dict.fromkeys(s[name] for s in samples))
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            choices[name] = values
    sentinels = {name: _SENTINEL + i for i, name in enumerate(choices)}
    text = str(parse_quant_key(fill_template(template, {**samples[0], **sentinels})))
    for name, value in sentinels.items():
        text = text.replace(str(value), "|".join(map(str, choices[name])))
    return text


def support_matrix(registry: Registry, platforms: tuple[str, ...] = MATRIX_PLATFORMS) -> list[dict[str, object]]:
    """For each scheme and platform, the eligible kernels in preference order (shape-independent,
    bf16 activations, no parallelism; a scheme with bindings is checked with their first listed
    values, and its keys are shown with every value a binding may take)."""
    rows = []
    for name, loaded in sorted(registry.schemes.items()):
        scheme = loaded.spec
        bindings = binding_samples(scheme)[0]
        weight = parse_quant_key(fill_template(scheme.weight, bindings))
        activation = parse_quant_key(fill_template(scheme.run_activation, bindings))
        cells = {}
        for plat in platforms:
            runtime = RuntimeConfig(parse_platform(plat), "bfloat16")
            cells[plat] = [k for k in scheme.kernels if k in registry.kernels and all(
                c.passed for c in kernel_checks(registry.kernel(k), runtime, weight, activation, bindings,
                                                {}, scheme.checkpoint.format, registry.converters))]
        rows.append({"scheme": name, "weight": key_with_choices(scheme.weight, scheme),
                     "activation": key_with_choices(scheme.activation, scheme)
                     + (f" (runs as {scheme.emulation.activation})" if scheme.emulation else ""), "cells": cells})
    return rows


def matrix_markdown(registry: Registry) -> str:
    """The matrix as the Markdown page checked in at docs/support-matrix.md."""
    lines = ["# Support matrix", "",
             "Generated from the specs by `moe-registry matrix`; a test keeps this file current. "
             "Each cell lists the eligible kernels, preferred first (bf16 activations, no parallelism). "
             "`group(32|64|128|-1)` lists the values a scheme's binding may take; cells are computed with the "
             "first.", "",
             "| scheme | weight | activation | " + " | ".join(MATRIX_PLATFORMS) + " |",
             "|" + " --- |" * (3 + len(MATRIX_PLATFORMS))]
    for r in support_matrix(registry):
        cells = r["cells"]
        assert isinstance(cells, dict)
        weight, activation = (str(r[k]).replace("|", "\\|") for k in ("weight", "activation"))
        lines.append(f"| `{r['scheme']}` | `{weight}` | `{activation}` | "
                     + " | ".join(", ".join(cells[p]) or "—" for p in MATRIX_PLATFORMS) + " |")
    return "\n".join(lines) + "\n"
