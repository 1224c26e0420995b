"""The conformance suite's case generator, driven by the specs (docs/design.md,
"Declared support is tested support").

Every (scheme × kernel × declared option) the specs claim becomes cases, each held to the scheme's tolerance
(or the kernel's key pattern's, where its numerics differ from the reference's): a base case per binding
sample, then one case per declared option varied from it (dtype, activation function, bias,
act-order, activation format, router weight on input, the kernel's one-projection form), then edge shapes
(one token, experts that get no tokens, top-k equal to the number of experts, the smallest sizes allowed). An option the
generator cannot produce a case for is a claim that cannot be tested: ``validate`` rejects it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from moe_registry.core.keys import QuantKey, key_matches, parse_quant_key
from moe_registry.oracle.handed import handed_activation
from moe_registry.oracle.predicates import check_keys, matching_pattern
from moe_registry.spec.loader import Registry, binding_samples, fill_template
from moe_registry.spec.view import KernelSpec, KeyPattern

# What the generator can build a case for. Adding an option to the spec language means adding it here.
GENERATABLE = {
    "features": {"bias", "zero_point", "act_order", "router_weight_on_input"},
    "activations": {"silu", "gelu", "swigluoai"},
    "dtypes": {"float16", "bfloat16", "float32"},
    "activation_formats": {"standard", "batched"},
}


@dataclass(frozen=True)
class Case:
    """One conformance case: a kernel run against the reference on random data."""

    scheme: str
    kernel: str
    weight_key: QuantKey
    activation_key: QuantKey
    bindings: tuple[tuple[str, Any], ...]
    dtype: str
    activation: str = "silu"
    bias: bool = False
    act_order: bool = False
    activation_format: str = "standard"
    router_weight_on_input: bool = False
    num_experts: int = 4
    top_k: int = 2
    hidden: int = 128
    intermediate: int = 128
    tokens: int = 7
    skip_experts: int = 0  # route only to experts [skip_experts, E): the first ones get no tokens
    tolerance: float = 1e-2
    # the platform whose key pattern the case runs, where it is not the one the pair meets first (platform_runs)
    platform: str | None = None
    # the kernel's one-projection form (its spec's linear_impl): rows [tokens, hidden] times one projection
    # [intermediate, hidden], no routing
    linear: bool = False

    @property
    def id(self) -> str:
        opts = [self.dtype, self.activation]
        opts += [name for name, on in (("bias", self.bias), ("actorder", self.act_order),
                                       ("rwoi", self.router_weight_on_input)) if on]
        if self.activation_format != "standard":
            opts.append(self.activation_format)
        if self.linear:
            opts.append("linear")
        b = ",".join(f"{k}={v}" for k, v in self.bindings)
        shape = f"E{self.num_experts}k{self.top_k}H{self.hidden}I{self.intermediate}M{self.tokens}"
        if self.skip_experts:
            shape += f"s{self.skip_experts}"
        on = f"-{self.platform}" if self.platform else ""
        return f"{self.scheme}[{b}]-{self.kernel}{on}-{'-'.join(opts)}-{shape}"


@dataclass(frozen=True)
class Sizes:
    """Base sizes for a run: small for the interpreter, realistic for a GPU."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    tokens: tuple[int, ...]


SMALL = Sizes(4, 2, 128, 128, (7,))
REALISTIC = Sizes(8, 2, 2048, 1024, (1, 64, 512))


def _min_dim(keys: Iterable[QuantKey]) -> int:
    """Smallest hidden/intermediate size the keys' groups and blocks allow (a multiple of 32)."""
    need = 32
    for key in keys:
        if key.scale is not None:
            for extent in (key.scale.group.cols, key.scale.group.rows):
                if extent > 0:
                    need = need * extent // math.gcd(need, extent)
    return need


def platform_runs(kernel: KernelSpec, weight: QuantKey,
                  activation: QuantKey) -> list[tuple[str | None, KeyPattern | None]]:
    """How the kernel runs the pair: the pattern it meets first (no platform named), then each later pattern
    that takes the same pair with an ``emulation`` on platforms of its own (fp8 weight-only before sm_89),
    named by the lowest platform it admits. A claim per platform is a case per platform."""
    first = matching_pattern(kernel, weight, activation, None)
    runs: list[tuple[str | None, KeyPattern | None]] = [(None, first)]
    for pattern in kernel.key_patterns():
        if (pattern is first or pattern.emulation is None or not pattern.platforms
                or not (key_matches(weight, pattern.weights()) and key_matches(activation, pattern.activations()))):
            continue
        lowest = pattern.platforms[0]
        floor = next((ver for op, ver in lowest.capability_bounds() if op == ">="), None)
        runs.append((f"{lowest.device}:{floor[0]}.{floor[1]}" if floor else lowest.device, pattern))
    return runs


def cases_for(registry: Registry, *, kernels: Iterable[str] | None = None, dtypes: Iterable[str] | None = None,
              sizes: Sizes = SMALL) -> list[Case]:
    """Every case the specs claim for the given kernels (default: all) and dtypes."""
    wanted_kernels = set(kernels) if kernels is not None else set(registry.kernels)
    out: list[Case] = []
    for sname, loaded in sorted(registry.schemes.items()):
        scheme = loaded.spec
        for kname in scheme.kernels:
            if kname not in wanted_kernels or kname not in registry.kernels:
                continue
            kernel = registry.kernel(kname)
            kdtypes = [d for d in kernel.dtypes if dtypes is None or d in set(dtypes)]
            for n_sample, sample in enumerate(binding_samples(scheme)):
                weight = parse_quant_key(fill_template(scheme.weight, sample))
                activation = parse_quant_key(fill_template(scheme.run_activation, sample))
                if not all(c.passed for c in check_keys(kernel, weight, activation)):
                    continue
                features = {n: (v if isinstance(v, bool) else fill_template(v, sample) == "true")
                            for n, v in scheme.features.items()}
                act_order = features.get("act_order", False)
                if act_order and "act_order" not in kernel.features:
                    continue
                dim = max(_min_dim([weight, activation]), 32)
                hidden = max(sizes.hidden, dim) // dim * dim
                inter = max(sizes.intermediate, dim) // dim * dim
                for dtype, (platform, pattern) in ((d, r) for r in platform_runs(kernel, weight, activation)
                                                   for d in kdtypes):
                    tol = pattern.tolerance if pattern is not None and pattern.tolerance else scheme.tolerance
                    base = Case(sname, kname, weight, handed_activation(activation, pattern),
                                tuple(sorted(sample.items())), dtype,
                                act_order=act_order, activation_format=kernel.activation_formats[0],
                                num_experts=sizes.num_experts, top_k=sizes.top_k,
                                hidden=hidden, intermediate=inter, tokens=sizes.tokens[0],
                                tolerance=tol.get(dtype, max(tol.values())),  # type: ignore[call-overload]
                                platform=platform)
                    first = dtype == kdtypes[0] and n_sample == 0
                    out += [replace(base, tokens=m) for m in (sizes.tokens if first else sizes.tokens[-1:])]
                    if kernel.linear_impl is not None and n_sample == 0:  # the one-projection form, each dtype
                        out += [replace(base, linear=True, num_experts=1, top_k=1, tokens=m)
                                for m in (*sizes.tokens[-1:], 1)]
                    if not first:
                        continue  # vary the other options once: first dtype, first binding sample
                    out += [replace(base, activation=a) for a in kernel.activations if a != "silu"]
                    if "bias" in kernel.features:
                        out.append(replace(base, bias=True))
                    out += [replace(base, activation_format=f) for f in kernel.activation_formats[1:]]
                    if "router_weight_on_input" in kernel.features:
                        out.append(replace(base, router_weight_on_input=True, top_k=1))
                    out.append(replace(base, tokens=1))
                    out.append(replace(base, top_k=base.num_experts, tokens=3))
                    out.append(replace(base, skip_experts=base.num_experts - base.top_k, tokens=5))
                    out.append(replace(base, hidden=dim, intermediate=dim, tokens=4))
    seen: set[str] = set()
    unique = []
    for case in out:
        if case.id not in seen:
            seen.add(case.id)
            unique.append(case)
    return unique


def undeclarable_options(registry: Registry) -> list[str]:
    """One line per kernel claim the conformance suite cannot generate a case for."""
    out = []
    for name, loaded in sorted(registry.kernels.items()):
        spec = loaded.spec
        for option, allowed in GENERATABLE.items():
            for value in getattr(spec, option):
                if value not in allowed:
                    out.append(f"{loaded.path}:{loaded.line}: {option}: {value!r} is declared by kernel {name} "
                               "but the conformance suite cannot generate a case for it")
        produced = [(parse_quant_key(fill_template(s.spec.weight, b)),
                     parse_quant_key(fill_template(s.spec.run_activation, b)))
                    for s in registry.schemes.values() if name in s.spec.kernels for b in binding_samples(s.spec)]
        for i, pattern in enumerate(spec.key_patterns()):
            single = spec.replace(keys=[pattern])
            if not any(all(c.passed for c in check_keys(single, w, a)) for w, a in produced):
                out.append(f"{loaded.path}:{loaded.line}: keys[{i}]: no scheme that lists {name} binds a key pair "
                           f"matching {pattern.weight!r} / {pattern.activation!r}, so no conformance case tests it")
    return out
