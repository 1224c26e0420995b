"""Kernel predicates: pure checks of one kernel spec against bound keys and the runtime config.

Each returns a :class:`Check`; :func:`kernel_checks` runs them all (never stopping at the first
failure, so explain shows every reason a kernel was turned down).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_registry.core.checks import Check, Reason, failed, passed
from moe_registry.core.keys import QuantKey, key_matches
from moe_registry.core.vocab import ALL2ALL_DELIVERS
from moe_registry.situation.runtime import Platform, RuntimeConfig
from moe_registry.spec.expr import ExprError, parse_expr
from moe_registry.spec.view import KernelSpec, KeyPattern, PlatformSpec

_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
        "<": lambda a, b: a < b, "==": lambda a, b: a == b}



def check_platform(kernel: KernelSpec, runtime: RuntimeConfig) -> list[Check]:
    plat = runtime.platform
    wanted = ", ".join(f"{p.device}{' ' + p.capability if p.capability else ''}" for p in kernel.platforms)
    same_device = [p for p in kernel.platforms if p.device == plat.device]
    if not same_device:
        return [failed(Reason.PLATFORM, "platform", f"platform {plat.device}; kernel runs on {wanted}",
                       seen=plat.device, wanted=wanted)]
    for p in same_device:
        bounds = p.capability_bounds()
        if p.cpu_features:
            return [_cpu_features(p.cpu_features, plat)]
        if not bounds:
            return [passed("platform", f"platform {plat}")]
        if plat.capability is None:
            continue
        if all(_OPS[op](plat.capability, ver) for op, ver in bounds):
            return [passed("platform", f"capability {plat.capability[0]}.{plat.capability[1]} "
                                       f"in {p.capability}")]
    cap = f"{plat.capability[0]}.{plat.capability[1]}" if plat.capability else "unknown"
    return [failed(Reason.CAPABILITY, "platform.capability",
                   f"{plat.device} capability {cap}; kernel wants {wanted}", seen=cap, wanted=wanted)]


def _cpu_features(needs: list[str], plat: Platform) -> Check:
    """The instruction-set extensions a CPU kernel's build needs, against those the CPU reports."""
    if plat.cpu_features is None:
        return passed("platform.cpu_features", f"needs {', '.join(needs)} (not checked: the target is not this "
                                               "machine)")
    missing = [f for f in needs if f not in plat.cpu_features]
    if missing:
        return failed(Reason.CAPABILITY, "platform.cpu_features",
                      f"this CPU lacks {', '.join(missing)}; the kernel's build needs {', '.join(needs)}",
                      seen=sorted(f for f in needs if f in plat.cpu_features), wanted=needs)
    return passed("platform.cpu_features", f"the CPU has {', '.join(needs)}")


def check_packages(kernel: KernelSpec, runtime: RuntimeConfig) -> list[Check]:
    if not kernel.requires_packages:
        return []
    if runtime.environment is None:
        return [passed("requires_packages", f"needs {', '.join(kernel.requires_packages)} "
                                            "(not checked: the target is not this machine)")]
    missing = [p for p in kernel.requires_packages if p not in runtime.environment.installed]
    if missing:
        return [failed(Reason.PACKAGE_MISSING, "requires_packages",
                       f"package {', '.join(missing)} is not installed", seen=missing)]
    return [passed("requires_packages", f"{', '.join(kernel.requires_packages)} installed")]


def check_commands(kernel: KernelSpec, runtime: RuntimeConfig) -> list[Check]:
    """Programs the kernel needs on the target's PATH (a compiler for a kernel built on first use)."""
    if not kernel.requires_commands:
        return []
    needs = ", ".join(kernel.requires_commands)
    if runtime.environment is None:
        return [passed("requires_commands", f"needs {needs} on PATH (not checked: the target is not this machine)")]
    missing = [c for c in kernel.requires_commands if c not in runtime.environment.commands]
    if missing:
        return [failed(Reason.COMMAND_MISSING, "requires_commands",
                       f"needs {', '.join(missing)} on PATH: not found", seen=missing, wanted=kernel.requires_commands)]
    return [passed("requires_commands", f"{needs} on PATH")]


def _admits(platforms: list[PlatformSpec], plat: Platform) -> bool:
    """Whether one of ``platforms`` takes ``plat`` (device, and capability where bounded)."""
    for p in platforms:
        bounds = p.capability_bounds()
        if p.device == plat.device and (not bounds or plat.capability is not None
                                        and all(_OPS[op](plat.capability, ver) for op, ver in bounds)) and (
                plat.cpu_features is None or all(f in plat.cpu_features for f in p.cpu_features)):
            return True
    return False


def matching_pattern(kernel: KernelSpec, weight: QuantKey, activation: QuantKey,
                     platform: Platform | None) -> KeyPattern | None:
    """The first of the kernel's key patterns that takes the pair on ``platform`` (None: on any of its
    platforms): the one whose ``emulation`` and ``compute`` words say how the pair runs there."""
    return next((p for p in kernel.key_patterns()
                 if key_matches(weight, p.weights()) and key_matches(activation, p.activations())
                 and (not p.platforms or platform is None or _admits(p.platforms, platform))), None)


def check_keys(kernel: KernelSpec, weight: QuantKey, activation: QuantKey,
               platform: Platform | None = None) -> list[Check]:
    """The key pair against the kernel's patterns; with ``platform``, also the platforms a matching
    pattern narrows the kernel to (e.g. fp8 dots on cuda >=8.9)."""
    weight_ok = [p for p in kernel.key_patterns() if key_matches(weight, p.weights())]
    if not weight_ok:
        wanted = "; ".join(w for p in kernel.key_patterns() for w in p.weights())
        return [failed(Reason.WEIGHT_KEY, "weight", f"weight key {weight}; kernel takes {wanted}",
                       seen=str(weight), wanted=wanted)]
    pair_ok = [p for p in weight_ok if key_matches(activation, p.activations())]
    if not pair_ok:
        wanted = "; ".join(a for p in weight_ok for a in p.activations())
        return [passed("weight", f"weight key {weight}"),
                failed(Reason.ACTIVATION_KEY, "activation",
                       f"activation key {activation} with that weight; kernel takes {wanted}",
                       seen=str(activation), wanted=wanted)]
    if platform is not None and not any(not p.platforms or _admits(p.platforms, platform) for p in pair_ok):
        wanted = "; ".join(f"{q.device}{' ' + q.capability if q.capability else ''}"
                           for p in pair_ok for q in p.platforms)
        cap = f" capability {platform.capability[0]}.{platform.capability[1]}" if platform.capability else ""
        return [passed("keys", f"weight {weight}, activation {activation}"),
                failed(Reason.CAPABILITY, "keys.platforms", f"{platform.device}{cap}; these keys run on {wanted}",
                       seen=f"{platform.device}{cap}", wanted=wanted)]
    return [passed("keys", f"weight {weight}, activation {activation}")]


def _member(reason: Reason, field: str, value: str, allowed: list[str]) -> Check:
    """``value`` must be one of the kernel's declared ``allowed`` values."""
    if value in allowed:
        return passed(field, f"{field} {value}")
    return failed(reason, field, f"{field} {value}; kernel takes " + ", ".join(allowed), seen=value, wanted=allowed)


def delivered_format(all2all: str, kernel: KernelSpec) -> str | None:
    """The activation format the backend hands this kernel: the first it delivers that the kernel takes."""
    return next((f for f in ALL2ALL_DELIVERS.get(all2all, ()) if f in kernel.activation_formats), None)


def check_runtime(kernel: KernelSpec, runtime: RuntimeConfig) -> list[Check]:
    out = [_member(Reason.DTYPE, "dtype", runtime.dtype, list(kernel.dtypes))]
    p = runtime.parallel
    formats = ALL2ALL_DELIVERS.get(p.all2all)
    fmt = delivered_format(p.all2all, kernel)
    if formats is None:
        out.append(failed(Reason.ALL2ALL, "parallel.all2all", f"unknown all2all backend {p.all2all!r}; "
                          f"known: {', '.join(ALL2ALL_DELIVERS)}", seen=p.all2all))
    elif p.ep > 1 and p.all2all not in kernel.parallel.all2all:
        out.append(failed(Reason.ALL2ALL, "parallel.all2all", f"all2all {p.all2all}; kernel supports "
                          + (", ".join(kernel.parallel.all2all) or "no all2all backend"), seen=p.all2all,
                          wanted=kernel.parallel.all2all))
    elif fmt is None:
        delivered = " or ".join(formats)
        out.append(failed(Reason.ACTIVATION_FORMAT, "activation_format",
                          f"all2all {p.all2all} delivers the {delivered} format; kernel takes "
                          + ", ".join(kernel.activation_formats), seen=delivered, wanted=kernel.activation_formats))
    else:
        out.append(passed("activation_format", f"{fmt} format"))
    for mode, size in (("tp", p.tp), ("ep", p.ep), ("dp", p.dp)):
        if size > 1 and not getattr(kernel.parallel, mode):
            out.append(failed(Reason.PARALLEL, f"parallel.{mode}", f"{mode} = {size}; kernel does not "
                              f"support {mode.upper()}", seen=size, wanted=1))
    return out


def check_shape(kernel: KernelSpec, runtime: RuntimeConfig, bindings: Mapping[str, Any]) -> list[Check]:
    shape = runtime.local_shape()
    if shape is None:
        return [passed("shape", "no model shape given: shape limits not checked")] if kernel.shapes else []
    out = [_member(Reason.ACTIVATION_FN, "activation", shape.activation, list(kernel.activations))]
    dims = {"hidden": shape.hidden, "intermediate": shape.intermediate, "experts": shape.num_experts,
            "top_k": shape.top_k, "tokens": runtime.max_tokens}
    values = {f"${k}": v for k, v in bindings.items() if isinstance(v, int) and not isinstance(v, bool)}
    for dim, limit in kernel.shapes.items():
        seen = dims[dim]
        for attr, reason in (("multiple_of", Reason.SHAPE_MULTIPLE), ("min", Reason.SHAPE_MIN),
                             ("max", Reason.SHAPE_MAX)):
            raw = getattr(limit, attr)
            if raw is None:
                continue
            try:
                bound = parse_expr(raw).evaluate(values)
            except ExprError as err:
                out.append(failed(Reason.SHAPE_UNKNOWN, f"shapes.{dim}.{attr}", str(err)))
                continue
            ok = (seen % bound == 0 if bound > 0 else True) if attr == "multiple_of" else (
                seen >= bound if attr == "min" else seen <= bound)
            if not ok:
                word = {"multiple_of": "a multiple of", "min": "at least", "max": "at most"}[attr]
                out.append(failed(reason, f"shapes.{dim}", f"{dim} = {seen}; kernel wants {word} {bound}",
                                  seen=seen, wanted=bound))
    if len(out) == 1 and kernel.shapes:
        out.append(passed("shapes", "within " + ", ".join(kernel.shapes) + " limits"))
    return out


def check_features(kernel: KernelSpec, runtime: RuntimeConfig, scheme_features: Mapping[str, bool],
                   weight: QuantKey) -> list[Check]:
    needed = {name for name, on in scheme_features.items() if on}
    if weight.zero_point != "none":
        needed.add("zero_point")
    shape = runtime.shape
    if shape is not None and shape.has_bias:
        needed.add("bias")
    if runtime.router_weight_on_input:
        needed.add("router_weight_on_input")
    missing = sorted(needed - set(kernel.features))
    if missing:
        return [failed(Reason.FEATURE, "features", f"needs {', '.join(missing)}; kernel has "
                       + (", ".join(kernel.features) or "none"), seen=sorted(needed), wanted=kernel.features)]
    return [passed("features", f"features {', '.join(sorted(needed))}")] if needed else []


def check_converter(kernel: KernelSpec, checkpoint_format: str, converters: frozenset[tuple[str, str]]) -> list[Check]:
    """A format spec must declare a converter from the scheme's checkpoint format to the kernel's layout."""
    if (checkpoint_format, kernel.layout) in converters:
        return []
    return [failed(Reason.CONVERTER, "layout", f"no converter from {checkpoint_format} to layout "
                   f"{kernel.layout}", seen=checkpoint_format, wanted=kernel.layout)]


def kernel_checks(kernel: KernelSpec, runtime: RuntimeConfig, weight: QuantKey, activation: QuantKey,
                  bindings: Mapping[str, Any], scheme_features: Mapping[str, bool],
                  checkpoint_format: str, converters: frozenset[tuple[str, str]]) -> tuple[Check, ...]:
    """Every declared constraint of ``kernel`` against the situation (``converters``: the registry's
    declared (format, layout) pairs)."""
    platform = check_platform(kernel, runtime)
    on_platform = runtime.platform if all(c.passed for c in platform) else None  # else that one reason says it
    return tuple(platform + check_packages(kernel, runtime) + check_commands(kernel, runtime)
                 + check_keys(kernel, weight, activation, on_platform) + check_runtime(kernel, runtime)
                 + check_shape(kernel, runtime, bindings)
                 + check_features(kernel, runtime, scheme_features, weight)
                 + check_converter(kernel, checkpoint_format, converters))
