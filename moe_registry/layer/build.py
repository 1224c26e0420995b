"""From a model dir to a built layer: the situation, the oracle's report, the checkpoint tensors of the chosen
scheme, the formats stage's conversion, and the chosen kernel's Experts class in a FusedMoEKernel with the
PrepareFinalize that ``layer.placement`` gives. Nothing half-built is returned: every check runs before the
kernel is constructed."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moe_registry.checkpoint.read import LayerTensors, read_layer
from moe_registry.checkpoint.tensor_index import CheckpointIndex, open_checkpoint
from moe_registry.core import guards
from moe_registry.core.errors import ConfigError
from moe_registry.formats import get_converter
from moe_registry.formats.layer import convert_layer
from moe_registry.formats.registry import ConvertContext
from moe_registry.formats.weights import BULK_FIELDS, ExpertWeights
from moe_registry.layer.experts import Experts, ExpertsConfig
from moe_registry.layer.linear import Linear
from moe_registry.layer.modular import FusedMoEKernel
from moe_registry.layer.placement import dispatch_for, placement_for
from moe_registry.oracle.contract import Report
from moe_registry.oracle.handed import handed_activation
from moe_registry.oracle.predicates import delivered_format, matching_pattern
from moe_registry.oracle.select import select
from moe_registry.situation.config import ModelConfig, read_model_config
from moe_registry.situation.describe import Flags, check_kernel_names, situation_for_model
from moe_registry.situation.runtime import Platform
from moe_registry.spec.loader import Registry, load_registry
from moe_registry.spec.view import KernelSpec

if TYPE_CHECKING:
    pass

log = logging.getLogger("moe_registry")
_LOGGED: set[tuple[str, str, str, str]] = set()
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def experts_class(kernel: KernelSpec) -> type[Experts]:
    """Import the kernel's implementation (only now: specs never import kernels)."""
    return _impl_class(kernel, "impl", kernel.impl, Experts)


def linear_class(kernel: KernelSpec) -> type[Linear] | None:
    """Import the kernel's one-projection form (its spec's ``linear_impl``; None: it has none)."""
    if kernel.linear_impl is None:
        return None
    return _impl_class(kernel, "linear_impl", kernel.linear_impl, Linear)


def _impl_class(kernel: KernelSpec, field: str, impl: str, base: type) -> Any:
    """The class ``impl`` (module:Class) names in the kernel spec's ``field``, checked to subclass ``base``."""
    module_name, _, cls_name = impl.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"kernel {kernel.kernel}: {field} {impl} cannot be imported: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        article = "an" if base.__name__[0] in "AEIOU" else "a"
        raise ConfigError(f"kernel {kernel.kernel}: {field} {impl} is not {article} {base.__name__} class")
    return cls


@dataclass(frozen=True)
class BuiltKernel:
    """The oracle's report, the converted weights and the ready kernel. ``converted`` is None when the
    kernel keeps its own copy of the weights (a packed or device copy): holding the converted tensors too
    would double the layer's memory, so ``weights`` converts again from the checkpoint when asked."""

    report: Report
    converted: ExpertWeights | None
    kernel: FusedMoEKernel
    tolerance: float
    reconvert: Callable[[], ExpertWeights] | None = None

    @property
    def weights(self) -> ExpertWeights:
        """The converted expert weights, in the chosen kernel's layout (this rank's experts)."""
        if self.converted is not None:
            return self.converted
        assert self.reconvert is not None
        return self.reconvert()


def device_for(platform: Platform, device: str | torch.device | None) -> torch.device:
    """The torch device to build on: ``device``, else the platform's; refused (one line) when this
    machine has no such device, rather than failing inside torch."""
    try:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if platform.device in ("cuda", "rocm") else "cpu")
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device={device!r}: not a torch device ({err})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        what = f"device={str(device)!r}" if device is not None else f"--platform {platform}"
        raise ConfigError(f"{what}: not available on this machine (this torch {torch.__version__} sees no "
                          "CUDA/ROCm GPU); run on the CPU (platform cpu), or use explain to see what would run there")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={str(device)!r}: wanted cpu or cuda")
    return dev


def build_from_tensors(registry: Registry, report: Report, tensors: LayerTensors, *,
                       device: str | torch.device | None = None, tensor_name: Any = None,
                       reread: Callable[[], LayerTensors] | None = None) -> BuiltKernel:
    """Convert checked checkpoint tensors with the converter for (format, kernel layout) and wrap
    the chosen kernel. With ``reread`` (reads the same tensors again), a kernel that keeps its own copy
    of the weights is returned without the converted ones (``BuiltKernel.weights`` converts again)."""
    assert report.scheme is not None and report.chosen is not None
    scheme = registry.scheme(report.scheme.scheme)
    kernel_spec = registry.kernel(report.chosen)
    runtime = report.situation.runtime
    convert = get_converter(scheme.checkpoint.format, kernel_spec.layout, registry)
    # the key the kernel is handed: unquantized where its key pattern runs the checkpoint's quantised
    # activations weight-only (e.g. fp8 weights on sm_80), so no input scale is read
    weight_key, bound = report.scheme.weight_key, report.scheme.activation_key
    assert weight_key is not None and bound is not None  # a matched scheme binds both
    handed = handed_activation(bound, matching_pattern(kernel_spec, weight_key, bound, runtime.platform))
    ctx = ConvertContext(weight_key, handed, DTYPES[runtime.dtype], dict(report.scheme.bindings),
                         **({"tensor_name": tensor_name} if tensor_name else {}))
    dev = device_for(runtime.platform, device)
    # converted where the kernel runs: a GPU transposes and repacks a layer in milliseconds where the CPU
    # takes a large share of a model's load time, and the layer crosses to it once, at its checkpoint size
    full = convert_layer(convert, tensors.experts_to(dev), ctx)
    fmt = delivered_format(runtime.parallel.all2all, kernel_spec)
    assert fmt is not None  # the oracle chose the kernel for a format the backend delivers
    prepare_finalize, weights = dispatch_for(report, full, fmt, tensors.expert_ids)
    loaded = registry.kernels[report.chosen]
    # checked again right before importing it (the spec dir may have changed since loading)
    guards.check_impl(kernel_spec.impl, f"kernel {kernel_spec.kernel}", loaded.path, loaded.builtin)
    cls = experts_class(kernel_spec)
    shape = runtime.shape
    routed = prepare_finalize.num_global_experts(weights.num_experts)
    config = ExpertsConfig(activation=shape.activation if shape else "silu",  # type: ignore[arg-type]
                           apply_router_weight_on_input=runtime.router_weight_on_input,
                           activation_format=fmt,  # type: ignore[arg-type]
                           routed_experts=routed if routed != weights.num_experts else None)
    experts = cls(weights.to(dev), config)
    key = (scheme.scheme, kernel_spec.kernel, str(runtime.platform), runtime.dtype)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("moe-registry: scheme %s runs on kernel %s (%s, %s)", *key)
    tol = scheme.tolerance.get(runtime.dtype, max(scheme.tolerance.values()))  # type: ignore[call-overload]
    fused = FusedMoEKernel(prepare_finalize, experts)
    # a rank's share taken out of every expert's (not read alone) is not what reread gives: kept
    if reread is None or weights is not full or _same_storage(experts.weights, weights):
        return BuiltKernel(report, weights, fused, tol)
    return BuiltKernel(report, None, fused, tol, lambda: convert_layer(convert, reread(), ctx))


def _same_storage(held: ExpertWeights, converted: ExpertWeights) -> bool:
    """Whether the kernel holds the converted codes, scales and zero points themselves (then keeping them
    costs nothing; a kernel that copied any of them keeps stand-ins, and the converted ones are read again
    when asked for)."""
    return not any(c.not_held_in({f: getattr(h, f) for f in BULK_FIELDS})
                   for h, c in ((held.w13, converted.w13), (held.w2, converted.w2)))


@dataclass(frozen=True)
class LayerBuild:
    """A built layer with what is needed to route tokens to it: ``report``, ``weights``, ``kernel``
    and ``tolerance`` (shortcuts into ``built``), the model's config and the layer's tensors. It keeps
    the router's tensors, not the experts' checkpoint tensors (the kernel holds its own copy of those):
    ``tensors`` reads them again."""

    built: BuiltKernel
    model: ModelConfig
    router_tensors: LayerTensors
    reread: Callable[[], LayerTensors]

    @property
    def tensors(self) -> LayerTensors:
        """The layer's checkpoint tensors, router included, read again from the checkpoint."""
        return self.reread()

    @property
    def report(self) -> Report:
        """Why this scheme and kernel were chosen (``print(report.to_text())``)."""
        return self.built.report

    @property
    def weights(self) -> ExpertWeights:
        """The converted expert weights, in the chosen kernel's layout."""
        return self.built.weights

    @property
    def kernel(self) -> FusedMoEKernel:
        """The ready kernel: ``kernel(hidden, topk_weights, topk_ids)``."""
        return self.built.kernel

    @property
    def tolerance(self) -> float:
        """The scheme's relative-error tolerance for this activation dtype."""
        return self.built.tolerance


def build(model_dir: str | Path, *, layer: int | None = None, platform: str | None = None,
          dtype: str | None = None, kernel: str | None = None, prefer: str | None = None,
          device: str | torch.device | None = None, spec_dirs: Iterable[str | Path] = (),
          tp: int | None = None, ep: int | None = None, max_tokens: int | None = None,
          all2all: str | None = None, expert_placement: str | None = None, keep_weights: bool = False,
          model_config: ModelConfig | None = None, index: CheckpointIndex | None = None,
          ep_rank: int | None = None, registry: Registry | None = None) -> LayerBuild:
    """Explain, load, convert and build one MoE layer of a checkpoint. Returns a LayerBuild
    (``.report``, ``.weights``, ``.kernel``, ``.tolerance``, ``.model``, ``.tensors``); raises
    SelectionError (with the report) when nothing can run it, ConfigError/CheckpointError on bad input.
    With ``ep`` > 1 and ``all2all="allgather_reducescatter"``, call it in each of ep ranks of an existing
    torch.distributed process group: each rank's kernel holds its experts (``expert_placement``: contiguous, the
    default, or round_robin) and takes its own tokens. With ``ep`` > 1, no all2all and ``ep_rank``, the kernel holds
    rank ``ep_rank``'s experts and takes their local ids (the caller moves the tokens: transformers' expert
    parallelism). ``keep_weights``: hold the converted weights beside a
    kernel's own copy (for a caller that reads ``.weights`` again, as ``run``'s float64 reference does), instead
    of converting them again from the checkpoint on each access. ``model_config`` / ``index`` / ``registry``: this
    checkpoint's config and header index, and the specs (of ``spec_dirs``), as the caller already read them
    (``load_model`` builds every layer from one read)."""
    if registry is None:
        registry = load_registry(spec_dirs)
    check_kernel_names(registry, kernel=kernel, prefer=prefer)
    target = Path(model_dir)
    if not target.exists():
        raise ConfigError(f"{target}: no such file or directory")
    flags = Flags(platform=platform, dtype=dtype, layer=layer, tp=tp, ep=ep, max_tokens=max_tokens, all2all=all2all,
                  expert_placement=expert_placement)
    model = model_config if model_config is not None else read_model_config(target, registry)
    situation = situation_for_model(model, registry, flags)
    device_for(situation.runtime.platform, device)  # refuse an absent GPU before reading tensors
    report = select(registry, situation, prefer=prefer, pin=kernel)  # a refusal reads no tensor headers
    if index is None:
        index = open_checkpoint(target if target.is_dir() else target.parent)
    assert report.scheme is not None and situation.layer is not None
    scheme = registry.scheme(report.scheme.scheme)
    family = registry.families[model.family].spec
    shape = situation.runtime.shape
    assert shape is not None
    placement = placement_for(situation.runtime, ep_rank)  # an expert-parallel rank reads only its own experts
    owned = None if placement is None else tuple(placement.local_experts().tolist())
    reread = functools.partial(read_layer, index, family, situation.layer, scheme, report.scheme.bindings, shape,
                               owned)
    tensors = reread()
    if tensors.has_bias and not shape.has_bias:
        # The checkpoint carries expert biases the config did not announce: decide again with them.
        runtime = replace(situation.runtime, shape=replace(shape, has_bias=True))
        report = select(registry, replace(situation, runtime=runtime), prefer=prefer, pin=kernel)
    built = build_from_tensors(registry, report, tensors, device=device, tensor_name=tensors.names.tensor,
                               reread=None if keep_weights else reread)
    return LayerBuild(built, model, tensors.router_only(), reread)


