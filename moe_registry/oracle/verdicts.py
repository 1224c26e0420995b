"""The oracle's verdicts: on schemes and kernels, the downgrades, how the kernel was selected
(SelectedBy), and the runs of layers decided alike. Every check inside them is a ``core.checks.Check``.
The Report that holds them is ``oracle.contract``'s; ``oracle.render`` reads these to print it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from moe_registry.core.checks import Check
from moe_registry.core.keys import QuantKey

METHOD_FIELD = "quant_method"  # transformers' name for a quantization config's method (QuantizationConfigMixin)


@dataclass(frozen=True)
class SchemeVerdict:
    """Detection of one scheme for one layer, with every check that decided it."""

    scheme: str
    matched: bool
    checks: tuple[Check, ...]
    excluded: bool = False
    scope_note: str | None = None
    bindings: Mapping[str, Any] = field(default_factory=dict)
    weight_key: QuantKey | None = None
    activation_key: QuantKey | None = None
    features: Mapping[str, bool] = field(default_factory=dict)
    # a scheme with emulation: activation_key is the key the kernels run, this the checkpoint's, and why
    checkpoint_activation_key: QuantKey | None = None
    emulation_reason: str | None = None

    @property
    def emulation_note(self) -> str | None:
        """One line saying which activations run instead of the checkpoint's, and why (None: no emulation)."""
        if self.checkpoint_activation_key is None or self.activation_key is None:
            return None
        run = ("in the 16-bit activation dtype (weight-only emulation)" if not self.activation_key.quantized
               else f"as {self.activation_key} (emulation)")
        return (f"the checkpoint's activations are {self.checkpoint_activation_key}; they run {run}: "
                f"{self.emulation_reason}")

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    @property
    def claims_method(self) -> bool:
        """Whether this scheme's detect rules accept the config's quant_method (it failed on other fields)."""
        return any(c.field == METHOD_FIELD and c.passed for c in self.checks)


@dataclass(frozen=True)
class KernelVerdict:
    """One candidate kernel and every check run on it."""

    kernel: str
    eligible: bool
    checks: tuple[Check, ...]

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)


@dataclass(frozen=True)
class LayerRun:
    """Consecutive MoE layers the oracle decides alike: the same scheme (with the same bindings) on the same
    kernel, excluded from quantization by the same rule or not at all."""

    first: int
    last: int
    scheme: str | None
    kernel: str | None
    excluded: str | None = None  # the scope rule that left these layers unquantized
    count: int = 1

    @property
    def span(self) -> str:
        return f"layer {self.first}" if self.count == 1 else f"layers {self.first}-{self.last}"

    def to_dict(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "count": self.count, "scheme": self.scheme,
                "kernel": self.kernel, "excluded": self.excluded}


class DowngradeKind(str, Enum):
    """What about the run differs from what the checkpoint or the user asked for."""

    ACTIVATION = "activation"  # the checkpoint's activation quantisation is not what runs
    COMPUTE_DTYPE = "compute-dtype"  # the GEMMs compute in a narrower dtype than the one asked
    SLOW_PATH = "slow-path"  # the scheme's order fell to a kernel its spec calls a slow path


@dataclass(frozen=True)
class Downgrade:
    """One place where what runs differs from what was asked, derived by the oracle from spec words
    (a scheme's or a key pattern's ``emulation``, a key pattern's ``compute``, a kernel's ``slow_path``)."""

    kind: DowngradeKind
    asked: str
    runs: str
    why: str
    message: str  # the line explain and run print

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "asked": self.asked, "runs": self.runs, "why": self.why,
                "message": self.message}


class SelectedBy(str, Enum):
    """How the chosen kernel (or the failure to choose one) came about."""

    PREFERENCE = "preference"  # the first eligible kernel in the scheme's order
    PIN = "pin"  # --kernel / pin=: that kernel or an error
    PREFER = "prefer"  # --prefer / prefer=: that kernel, being eligible
    FALLBACK = "fallback"  # --prefer named a kernel that is not eligible: the scheme's order decided
