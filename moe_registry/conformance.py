"""The conformance suite's case generator, driven by the specs (DESIGN rule 5).

Every (scheme × kernel × declared option) the specs claim is turned into cases; an option the
generator cannot produce a case for is a claim that cannot be tested, and `validate` rejects it.
"""

from __future__ import annotations

from moe_registry.registry import Registry

# What the generator can build a case for. Adding an option to the spec language means adding it here.
GENERATABLE = {
    "features": {"bias", "zero_point", "act_order", "router_weight_on_input"},
    "activations": {"silu", "gelu", "swigluoai"},
    "dtypes": {"float16", "bfloat16", "float32"},
    "activation_formats": {"standard", "batched"},
}


def undeclarable_options(registry: Registry) -> list[str]:
    """One line per kernel option the conformance suite cannot generate a case for."""
    out = []
    for name, loaded in sorted(registry.kernels.items()):
        spec = loaded.spec
        for option, allowed in GENERATABLE.items():
            for value in getattr(spec, option):
                if value not in allowed:
                    out.append(f"{loaded.path}:{loaded.line}: {option}: {value!r} is declared by kernel {name} "
                               "but the conformance suite cannot generate a case for it")
    return out
