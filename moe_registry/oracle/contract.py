"""The oracle's contract with the stages after it: the Report of one layer's decision, which holds the
situation, every verdict (``oracle.verdicts``) and the choice, and prints itself through ``oracle.render``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from moe_registry.core.keys import QuantKey
from moe_registry.oracle import render
from moe_registry.oracle.verdicts import Downgrade, KernelVerdict, LayerRun, SchemeVerdict, SelectedBy
from moe_registry.situation.values import Situation

NEAREST_SHOWN = 3  # turned-down schemes shown without --verbose


@dataclass(frozen=True)
class Report:
    """Everything the oracle decided for one layer, and why."""

    situation: Situation
    schemes: tuple[SchemeVerdict, ...]
    scheme: SchemeVerdict | None
    excluded_note: str | None = None
    kernels: tuple[KernelVerdict, ...] = ()
    chosen: str | None = None
    selected_by: SelectedBy | None = None  # None when no scheme matched
    requested: str | None = None  # the kernel named by pin or prefer
    overrides: tuple[str, ...] = field(default=())
    unclaimed: str | None = None  # no scheme matched: the config's quant_method is one no scheme spec claims
    layers: tuple[LayerRun, ...] = ()  # the model's MoE layers grouped, when they are not all decided alike
    downgrades: tuple[Downgrade, ...] = ()  # where what runs differs from what was asked (explain says each)
    # the activation key the chosen kernel runs, where its key pattern's emulation differs from the scheme's
    kernel_activation_key: QuantKey | None = None
    # why the scheme's first eligible kernel gave way to the chosen one (downgrades.faithful_first); None: the
    # narrower compute dtype, the rule's first reason
    passed_over: str | None = None

    def with_kernels(self, kernels: tuple[KernelVerdict, ...], chosen: str | None, selected_by: SelectedBy,
                     requested: str | None) -> Report:
        return replace(self, kernels=kernels, chosen=chosen, selected_by=selected_by, requested=requested)

    @property
    def run_activation_key(self) -> QuantKey | None:
        """The activation key the chosen kernel runs (and the weights are converted for)."""
        if self.kernel_activation_key is not None:
            return self.kernel_activation_key
        return self.scheme.activation_key if self.scheme is not None else None

    def verdict(self, kernel: str) -> KernelVerdict | None:
        return next((k for k in self.kernels if k.kernel == kernel), None)

    @property
    def notes(self) -> tuple[str, ...]:
        """The selection in words (derived from ``selected_by``; programs read that)."""
        asked = self.requested
        if self.selected_by is SelectedBy.PIN:
            return (f"pinned to {asked}",) if self.chosen == asked else (f"pinned kernel {asked} is not eligible",)
        if self.selected_by is SelectedBy.PREFER:
            return (f"preferred {asked}",)
        if self.selected_by is SelectedBy.PREFERENCE:
            first = next((k for k in self.kernels if k.eligible), None)
            if first is not None and first.kernel != self.chosen:  # downgrades.faithful_first
                why = self.passed_over or f"it computes {self.situation.runtime.dtype} in a narrower dtype"
                return (f"{first.kernel} passed over: {why}; {self.chosen} computes it as asked "
                        f"(--prefer {first.kernel} runs it)",)
            return ()
        if self.selected_by is SelectedBy.FALLBACK:
            v = self.verdict(asked or "")
            why = "; ".join(c.message for c in v.failures) if v else "unknown kernel"
            return (f"preferred {asked} is not eligible ({why}); fell back to {self.chosen or 'nothing'}",)
        return ()

    def turned_down(self) -> list[SchemeVerdict]:
        """Schemes that did not match, nearest first: excluded-by-scope ones, then those claiming the config's
        quant_method, then by fewest failed and most passed checks, then by name."""
        chosen = self.scheme.scheme if self.scheme is not None else None
        rest = [v for v in self.schemes if v.scheme != chosen]
        return sorted(rest, key=lambda v: (not v.excluded, not v.claims_method, len(v.failures), -len(v.checks),
                                           v.scheme))

    def shown_turned_down(self, verbose: bool) -> list[SchemeVerdict]:
        rest = self.turned_down()
        if verbose:
            return rest
        return [] if self.unclaimed else rest[:NEAREST_SHOWN]  # unclaimed: none of them is near

    # rendering lives in render.py; these keep the report's one public face
    def rows(self) -> list[tuple[str, str]]:
        return render.head_rows(self)

    def summary(self) -> str:
        return render.summary_line(self)

    def notice_rows(self) -> list[tuple[str, str]]:
        return render.notice_rows(self)

    def to_dict(self, verbose: bool = False) -> dict[str, Any]:
        return render.to_dict(self, verbose)

    def to_json(self, verbose: bool = False, indent: int | None = None) -> str:
        return render.to_json(self, verbose, indent)

    def to_text(self, verbose: bool = False, width: int = render.TEXT_WIDTH) -> str:
        return render.to_text(self, verbose, width)

    def to_markdown(self, verbose: bool = False) -> str:
        return render.to_markdown(self, verbose)
