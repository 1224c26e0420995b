"""The activation key a kernel is handed, which the weights are converted for (the build) and the conformance
cases hold it to: one rule, read from the words a key pattern's ``emulation`` writes.

An emulation that runs the checkpoint's quantised activations unquantized (weight-only: fp8 weights on a GPU
without an fp8 dot, W4A4-style checkpoints) hands the kernel 16-bit activations: no input scale is read and
none is applied. An emulation that quantises activations the scheme binds unquantized (integer dots on a CPU)
hands the kernel the scheme's key: the kernel quantises them itself.
"""

from __future__ import annotations

from moe_registry.core.keys import QuantKey, parse_quant_key
from moe_registry.spec.view import KeyPattern


def handed_activation(bound: QuantKey, pattern: KeyPattern | None) -> QuantKey:
    """The activation key a kernel whose key pattern ``pattern`` takes the pair is handed, for the bound one."""
    if pattern is None or pattern.emulation is None:
        return bound
    runs = parse_quant_key(pattern.emulation.activation)
    return runs if not runs.quantized else bound
