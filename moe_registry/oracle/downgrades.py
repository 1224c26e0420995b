"""Where what runs differs from what the checkpoint or the user asked for, derived from spec words only:

- a scheme's ``emulation`` (the checkpoint's activation quantisation is not run by any kernel);
- the chosen kernel's key pattern's ``emulation`` (this kernel, on this platform, runs other activations);
- the chosen kernel's key pattern's ``compute`` (its GEMMs compute in a narrower dtype than the one asked);
- the chosen kernel's ``slow_path`` (the scheme's order fell to a yardstick), with why each faster kernel
  the scheme lists did not take the layer.

The one selection rule that reads them (``faithful_first``): a kernel that would compute in a narrower dtype
than asked, or whose key pattern declares a ``tolerance`` beyond the scheme's for the dtype asked (its
emulation's numbers), gives way to a later eligible one that does neither and is no slow path.

Nothing here knows a scheme or kernel by name: a new scheme or kernel gets its notes by writing the words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from moe_registry.core.keys import QuantKey, parse_quant_key
from moe_registry.oracle.contract import Report
from moe_registry.oracle.predicates import matching_pattern
from moe_registry.oracle.verdicts import Downgrade, DowngradeKind, KernelVerdict, SelectedBy
from moe_registry.situation.runtime import RuntimeConfig
from moe_registry.spec.loader import Registry


def narrowed(registry: Registry, kernel: str, weight: QuantKey, activation: QuantKey,
             runtime: RuntimeConfig) -> str | None:
    """The dtype ``kernel`` would compute this pair in where its key pattern's ``compute`` narrows the one asked."""
    if kernel not in registry.kernels:
        return None
    pattern = matching_pattern(registry.kernel(kernel), weight, activation, runtime.platform)
    return None if pattern is None or pattern.compute is None else pattern.compute.dtypes.get(runtime.dtype)


def beyond_tolerance(registry: Registry, kernel: str, weight: QuantKey, activation: QuantKey,
                     runtime: RuntimeConfig, scheme_tolerance: Mapping[str, float] | None) -> float | None:
    """The error ``kernel``'s key pattern declares for the asked dtype where it exceeds the scheme's tolerance."""
    if kernel not in registry.kernels or not scheme_tolerance:
        return None
    pattern = matching_pattern(registry.kernel(kernel), weight, activation, runtime.platform)
    if pattern is None or not pattern.tolerance or runtime.dtype not in pattern.tolerance:
        return None
    declared = pattern.tolerance[runtime.dtype]
    return declared if declared > scheme_tolerance.get(runtime.dtype, max(scheme_tolerance.values())) else None


def faithful_first(registry: Registry, eligible: list[str], weight: QuantKey, activation: QuantKey,
                   runtime: RuntimeConfig, scheme_tolerance: Mapping[str, float] | None = None) -> str | None:
    """The scheme's first eligible kernel, unless it computes in a narrower dtype than asked, or declares an error
    beyond the scheme's tolerance for it, and a later eligible one that is no slow path does neither: correct
    numbers before speed (--prefer restores it)."""
    if not eligible:
        return None

    def faithful(k: str) -> bool:
        return (narrowed(registry, k, weight, activation, runtime) is None
                and beyond_tolerance(registry, k, weight, activation, runtime, scheme_tolerance) is None)

    first = eligible[0]
    if faithful(first):
        return first
    return next((k for k in eligible if faithful(k) and not registry.kernel(k).slow_path), first)


def _runs_as(key: QuantKey) -> str:
    return "in the 16-bit activation dtype (weight-only)" if not key.quantized else f"as {key}"


def _slow_path_why(report: Report, registry: Registry) -> str:
    """Why each kernel the scheme lists that is not a slow path did not take the layer."""
    def fast(v: KernelVerdict) -> bool:
        return v.kernel != report.chosen and v.kernel in registry.kernels and not registry.kernel(v.kernel).slow_path

    reasons = [f"{v.kernel}: {v.failures[0].message}" if not v.eligible  # eligible: after the chosen one
               else f"{v.kernel}: eligible, after {report.chosen} in the scheme's order (--prefer {v.kernel} runs it)"
               for v in report.kernels if fast(v)]
    if not reasons:
        assert report.scheme is not None
        return f"scheme {report.scheme.scheme} lists no other kernel"
    return "; ".join(reasons)


def derive(report: Report, registry: Registry) -> Report:
    """The report with its downgrades (and the chosen kernel's own activation key, where its pattern emulates)."""
    v = report.scheme
    if v is None or v.activation_key is None or v.weight_key is None:
        return report
    out: list[Downgrade] = []
    if v.checkpoint_activation_key is not None and v.emulation_note is not None:
        out.append(Downgrade(DowngradeKind.ACTIVATION, str(v.checkpoint_activation_key), str(v.activation_key),
                             v.emulation_reason or "", v.emulation_note))
    kernel_activation = None
    if report.chosen is not None and report.chosen in registry.kernels:
        kernel = registry.kernel(report.chosen)
        runtime = report.situation.runtime
        pattern = matching_pattern(kernel, v.weight_key, v.activation_key, runtime.platform)
        if pattern is not None and pattern.emulation is not None:
            kernel_activation = parse_quant_key(pattern.emulation.activation)
            if kernel_activation != v.activation_key:
                asked = v.checkpoint_activation_key or v.activation_key
                out.append(Downgrade(
                    DowngradeKind.ACTIVATION, str(asked), str(kernel_activation), pattern.emulation.reason,
                    f"the checkpoint's activations are {asked}; {kernel.kernel} runs them "
                    f"{_runs_as(kernel_activation)} on {runtime.platform}: {pattern.emulation.reason}"))
            else:
                kernel_activation = None
        if pattern is not None and pattern.compute is not None and runtime.dtype in pattern.compute.dtypes:
            runs = pattern.compute.dtypes[runtime.dtype]
            out.append(Downgrade(
                DowngradeKind.COMPUTE_DTYPE, runtime.dtype, runs, pattern.compute.reason,
                f"{runtime.dtype} asked; {kernel.kernel} computes these weights' GEMMs in {runs}: "
                f"{pattern.compute.reason}"))
        if kernel.slow_path and report.selected_by in (SelectedBy.PREFERENCE, SelectedBy.FALLBACK):
            why = _slow_path_why(report, registry)
            out.append(Downgrade(
                DowngradeKind.SLOW_PATH, f"a fast kernel for {v.scheme} on {runtime.platform}", kernel.kernel, why,
                f"{kernel.kernel} is the slow path: it {kernel.slow_path}. No faster kernel takes this layer: {why}"))
    return replace(report, downgrades=tuple(out), kernel_activation_key=kernel_activation,
                   passed_over=_passed_over(report, registry))


def _passed_over(report: Report, registry: Registry) -> str | None:
    """Why faithful_first passed over the scheme's first eligible kernel, where its declared error was the reason."""
    v, runtime = report.scheme, report.situation.runtime
    first = next((k.kernel for k in report.kernels if k.eligible), None)
    if (v is None or v.weight_key is None or v.activation_key is None or first is None or first == report.chosen
            or report.selected_by is not SelectedBy.PREFERENCE or v.scheme not in registry.schemes):
        return None
    tolerance = registry.scheme(v.scheme).tolerance
    declared = beyond_tolerance(registry, first, v.weight_key, v.activation_key, runtime, tolerance)
    if declared is None or narrowed(registry, first, v.weight_key, v.activation_key, runtime) is not None:
        return None
    scheme_tol = tolerance.get(runtime.dtype, max(tolerance.values()))
    return (f"its numbers for {runtime.dtype} (emulation; declared error up to {declared:g}) exceed scheme "
            f"{v.scheme}'s tolerance {scheme_tol:g}")
