"""``load_model``: a checkpoint dir to a transformers model (eval mode) whose MoE layers' routed experts run
on the registry's kernels.

The model is transformers' own, built from the checkpoint's config.json with its parameters on the meta
device (nothing allocated); each MoE layer's experts module (the one transformers' ``use_experts_implementation``
wraps: the experts contract) is replaced by a :class:`RegistryExperts` built for that layer through the oracle
(its own scheme and kernel; weights converted once, kept packed); every other tensor is read from the
checkpoint under transformers' own checkpoint-to-model renaming. Loading never holds a dequantised copy of all
experts. Cheap checks (family, layers, every tensor present, memory) run before any tensor is read."""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_registry.checkpoint.tensor_index import CheckpointIndex, TensorInfo, open_checkpoint
from moe_registry.core.errors import CheckpointError, ConfigError, MoERegistryError
from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.build import DTYPES, build, device_for, linear_class
from moe_registry.layer.linear import Linear
from moe_registry.oracle.contract import Report
from moe_registry.oracle.predicates import matching_pattern
from moe_registry.situation.config import ModelConfig, config_path, read_model_config
from moe_registry.situation.describe import check_kernel_names
from moe_registry.situation.runtime import parse_platform
from moe_registry.spec.loader import Registry, load_registry
from moe_registry.whole.dense_linear import RegistryLinear, convert_linear, dequantize_linear
from moe_registry.whole.experts_module import RegistryExperts
from moe_registry.whole.memory import check_fits
from moe_registry.whole.report import LayerPlan, LoadReport, TensorLoad
from moe_registry.whole.requirement import require_transformers
from moe_registry.whole.scaled_rows import ScaledRowsExperts
from moe_registry.whole.transformers_ep import REGISTRY, install, resolve

# experts calls of up to this many tokens (decode's batches, prefills) replay captured CUDA graphs of each MoE
# layer's experts, in token buckets (experts_module.graph_bucket): a layer's launches take hundreds of
# microseconds of host time (an H200's host: ~0.7 ms at 512 tokens), more than the GPU time of Qwen3-30B-A3B's
# layer up to about 1000 tokens; a longer call is launched as it comes
GRAPH_TOKENS = 2048
_LAYER_RE = re.compile(r"\.(?:layers|blocks|h)\.(\d+)\.")
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8, "int8": 1, "uint8": 1,
                  "float8_e4m3fn": 1, "float8_e8m0fnu": 1, "int16": 2, "float64": 8, "bool": 1}


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device (no memory) and keep their buffers real
    (rotary tables and the like are computed in ``__init__`` and are not in the checkpoint)."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


CONTRACT = ("hidden_states", "top_k_index", "top_k_weights")


def takes_experts_contract(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module taking :data:`CONTRACT`: wrapped by transformers'
    ``use_experts_implementation``, or with exactly those forward arguments."""
    if hasattr(module, "is_concatenated") and hasattr(module, "has_gate"):
        return True
    return _forward_params(module) == CONTRACT


def _forward_params(module: torch.nn.Module) -> tuple[str, ...] | None:
    """The names of ``module``'s forward arguments after self (None where they cannot be read)."""
    try:
        return tuple(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return None


def takes_scaled_rows(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an experts module its block calls with scaled rows (``forward(hidden_states)``)."""
    return _forward_params(module) == ("hidden_states",)


# the family spec's experts_call -> how to find the experts modules it names, and the module that replaces them
EXPERTS_CALLS: dict[str, tuple[Any, Any]] = {
    "contract": (takes_experts_contract, RegistryExperts),
    "scaled_rows": (takes_scaled_rows, ScaledRowsExperts),
}


def experts_modules(model: torch.nn.Module, call: str = "contract") -> dict[int, str]:
    """Decoder layer -> path of the experts module in it that its block calls as ``call`` (a family spec's
    ``experts_call``: transformers' experts contract, or scaled rows)."""
    takes = EXPERTS_CALLS[call][0]
    found: dict[int, str] = {}
    for name, module in model.named_modules():
        if (call == "contract" or name.endswith(".experts")) and takes(module):
            m = _LAYER_RE.search(f".{name}.")
            if m:
                found[int(m.group(1))] = name
    return found


def _other_experts(model: torch.nn.Module) -> list[str]:
    """Experts modules transformers does not wrap with its experts contract (named ``experts``)."""
    return [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
            if name.endswith(".experts") and not takes_experts_contract(m)]


@dataclass(frozen=True)
class _Plan:
    """Where every checkpoint tensor goes: a model tensor, an experts module, or nowhere."""

    to_model: Mapping[str, str]  # model name -> checkpoint name
    expert_bytes: Mapping[int, int]  # MoE layer -> bytes of its expert tensors in the checkpoint
    ignored: tuple[str, ...]
    quantized: Mapping[str, Mapping[str, str]]  # a quantized linear (module name) -> tensor suffix -> checkpoint name
    unloaded_layers: tuple[int, ...] = ()  # checkpoint layers past the decoder's that transformers leaves unloaded


def _nbytes(info: TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n * _ELEMENT_BYTES.get(info.dtype, 4)


def non_expert_tensors(model: torch.nn.Module, experts: Mapping[int, str]) -> dict[str, torch.Tensor]:
    """The model's state dict without its experts modules' tensors (the registry's kernels hold those)."""
    prefixes = tuple(f"{p}." for p in experts.values())
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefixes)}


def _plan(model: Any, index: CheckpointIndex, experts: Mapping[int, str], num_layers: int,
          mtp_layers: int) -> _Plan:
    """Map checkpoint names to model names with transformers' own renaming (``conversion_mapping``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    wanted = non_expert_tensors(model, experts)
    prefixes = {f"{path}.": layer for layer, path in experts.items()}
    to_model: dict[str, str] = {}
    expert_bytes = dict.fromkeys(experts, 0)
    ignored: list[str] = []
    unloaded: set[int] = set()
    for name, info in index.tensors.items():
        target, converted = rename_source_key(name, renamings, converters, model.base_model_prefix, wanted)
        layer = next((lay for p, lay in prefixes.items() if target.startswith(p)), None)
        if layer is not None:
            expert_bytes[layer] += _nbytes(info)
            continue
        m = _LAYER_RE.search(f".{target}")
        if m and int(m.group(1)) >= num_layers:
            if _left_unloaded(model, (name, target), int(m.group(1)), num_layers, mtp_layers):
                ignored.append(name)
                unloaded.add(int(m.group(1)))
                continue
            raise ConfigError(f"{index.root}: the checkpoint holds layer {m.group(1)} ({name}), but config.json has "
                              f"{num_layers} layers")
        if converted is not None:  # transformers merges or splits it into another tensor: not read here
            raise CheckpointError(f"{name}: transformers converts it into {target} ({converted}); only experts' "
                                  "tensors are converted by the registry, other tensors must load as stored")
        if target in wanted:
            to_model[target] = name
        else:
            ignored.append(name)
    # a linear whose checkpoint tensors are more than weight and bias is stored quantized (GPTQ qweight/scales,
    # an fp8 weight with its weight_scale, ...): its tensors go to the dequantiser together
    quantized: dict[str, dict[str, str]] = {}
    for name in list(ignored):
        target, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, wanted)
        module, _, suffix = target.rpartition(".")
        if f"{module}.weight" in wanted:
            quantized.setdefault(module, {})[suffix] = name
            ignored.remove(name)
    for module, parts in quantized.items():
        if f"{module}.weight" in to_model:
            parts["weight"] = to_model.pop(f"{module}.weight")
    return _Plan(to_model, expert_bytes, tuple(sorted(ignored)), quantized, tuple(sorted(unloaded)))


def _left_unloaded(model: Any, names: tuple[str, str], layer: int, num_layers: int, mtp_layers: int) -> bool:
    """Whether a checkpoint tensor of ``layer`` (past the decoder's ``num_layers``; ``names``: as stored and as
    transformers renames it) is one transformers' model does not load: one of the config's ``mtp_layers``
    multi-token-prediction layers (the family spec's field; DeepSeek-V3 ships one as layer 61 of 61), or a key
    the model's class ignores on load (``_keys_to_ignore_on_load_unexpected``)."""
    if num_layers <= layer < num_layers + mtp_layers:
        return True
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()
    return any(re.search(pattern, name) for pattern in patterns for name in names)


def _expected_file(index: CheckpointIndex, plan: _Plan, name: str) -> str:
    """The checkpoint file a missing model tensor belongs in: the one holding its layer's (or module's) others."""
    m = _LAYER_RE.search(f".{name}")
    scope = name[:m.end() - 1] if m else name.rsplit(".", 1)[0]
    for model_name, ckpt in plan.to_model.items():
        if model_name.startswith(scope):
            return index.tensors[ckpt].file.name
    files = sorted({i.file.name for i in index.tensors.values()})
    return files[0] if len(files) == 1 else f"one of {', '.join(files)}"


def _check_tensors(model: Any, index: CheckpointIndex, plan: _Plan, experts: Mapping[int, str]) -> None:
    """Every model tensor (not tied to another, not an experts module's) is in the checkpoint with its shape."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    for name, tensor in non_expert_tensors(model, experts).items():
        if name in tied or name.removesuffix(".weight") in plan.quantized:
            continue
        ckpt = plan.to_model.get(name)
        if ckpt is None:
            raise CheckpointError(f"{name}: missing from the checkpoint (expected in "
                                  f"{_expected_file(index, plan, name)} in {index.root})")
        shape = index.tensors[ckpt].shape
        if tuple(shape) != tuple(tensor.shape):
            raise CheckpointError(f"{ckpt}: shape {list(shape)}; config.json wants {list(tensor.shape)} for {name}")


def _keep_float32(model: Any, name: str, dtype: torch.dtype) -> bool:
    """Whether transformers keeps ``name`` in float32 at ``dtype``, as its from_pretrained does:
    ``_keep_in_fp32_modules`` under float16, ``_keep_in_fp32_modules_strict`` under float16 and bfloat16."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else set()
    if dtype in (torch.float16, torch.bfloat16):
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return any(re.search(rf"(^|\.){re.escape(k)}(\.|$)", name) for k in keep)


def _load_tensors(model: Any, index: CheckpointIndex, plan: _Plan, dtype: torch.dtype,
                  device: torch.device) -> tuple[TensorLoad, ...]:
    """Read every non-expert tensor once, cast floating ones to the model's dtype, and put it in its place."""
    how: dict[str, list[str]] = {}
    with index.held_open():
        loaded = {name: index.load(ckpt) for name, ckpt in plan.to_model.items()}
    for name, tensor in loaded.items():
        stored = str(tensor.dtype).removeprefix("torch.")
        want = torch.float32 if _keep_float32(model, name, dtype) else dtype
        if tensor.is_floating_point() and tensor.dtype != want:
            tensor = tensor.to(want)
            how.setdefault(f"cast from {stored} to {str(want).removeprefix('torch.')}", []).append(name)
        else:
            how.setdefault(f"as stored ({stored})", []).append(name)
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        tensor = tensor.to(device)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor
    return tuple(TensorLoad(k, tuple(v)) for k, v in how.items())


def _load_quantized_linears(model: Any, index: CheckpointIndex, plan: _Plan, reports: Mapping[int, Report],
                            registry: Registry, dtype: torch.dtype, device: torch.device) -> tuple[TensorLoad, ...]:
    """Every quantized linear read once with the scheme and kernel the oracle chose for its decoder layer (the first
    MoE layer's for a linear outside the decoder layers): run packed on that kernel's one-projection form where
    it has one and takes the linear, else dequantised once (the load report says which, and why)."""
    how: dict[str, list[str]] = {}
    first = reports[min(reports)]
    for module, parts in plan.quantized.items():
        m = _LAYER_RE.search(f".{module}.")
        report = reports.get(int(m.group(1)), first) if m else first
        assert report.scheme is not None and report.chosen is not None
        with index.held_open():
            stored = {k: index.load(v) for k, v in parts.items()}
        weights = convert_linear(registry, report, stored, module)
        owner = model.get_submodule(module)
        want = tuple(owner._parameters["weight"].shape)
        linear, why = _kernel_linear(registry, report, weights, device)
        if linear is not None:  # ``why``: how the kernel runs the activations
            stored_shape = (weights.hidden_size, int(weights.w2.weight.shape[2]) * 8 // weights.weight_key.dtype.bits)
            if stored_shape != want:
                raise CheckpointError(f"{module}: stored as {list(stored_shape)}; config.json wants {list(want)}")
            runs = RegistryLinear(linear, owner._parameters.get("bias"), want[1], want[0], report.chosen,
                                  report.scheme.scheme)
            parent, _, attr = module.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, runs)
            key = f"run packed on {report.chosen}'s one-projection form from {report.scheme.scheme} ({why})"
            how.setdefault(key, []).append(f"{module}.weight")
            continue
        weight = dequantize_linear(weights, dtype)
        if tuple(weight.shape) != want:
            raise CheckpointError(f"{module}: dequantised to {list(weight.shape)}; config.json wants {list(want)}")
        owner._parameters["weight"] = torch.nn.Parameter(weight.to(device), requires_grad=False)
        key = f"dequantised once from {report.scheme.scheme} (weights; activations run unquantized{why})"
        how.setdefault(key, []).append(f"{module}.weight")
    return tuple(TensorLoad(k, tuple(v)) for k, v in how.items())


def _kernel_linear(registry: Registry, report: Report, weights: ExpertWeights,
                   device: torch.device) -> tuple[Linear | None, str]:
    """The layer's kernel's one-projection form holding the converted linear and how it runs the activations, or
    None and why not (``; ...``: text for the load report; empty where the kernel has no such form)."""
    assert report.chosen is not None
    kernel = registry.kernel(report.chosen)
    cls = linear_class(kernel)
    if cls is None:
        return None, ""
    try:
        linear = cls(weights.w2.to(device), weights.weight_key, weights.activation_key)
    except (ValueError, MoERegistryError) as err:
        return None, f"; {report.chosen}'s one-projection form refused it: {err}"
    pattern = matching_pattern(kernel, weights.weight_key, weights.activation_key, None)
    if pattern is not None and pattern.emulation is not None:
        return linear, f"activations quantised to {pattern.emulation.activation}, as the kernel's experts run them"
    if weights.activation_key.quantized:
        return linear, f"activations quantised to {weights.activation_key}, as the scheme binds them"
    return linear, "activations unquantized"


def _dtype_name(dtype: str | torch.dtype | None, model: ModelConfig) -> str:
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ConfigError(f"dtype={dtype}: wanted one of {', '.join(DTYPES)}")
        return names[dtype]
    name = dtype or model.dtype or "bfloat16"
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r}: wanted one of {', '.join(DTYPES)}")
    return name


# transformers' auto classes a whole model is built with, in order: a text model, else a multimodal model whose
# language model holds the MoE layers (Qwen3-VL-MoE, GLM-4.5V, Mistral 4, Step3): it generates from token ids too
MODEL_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText")


def generating_class(transformers: Any, config: Any) -> Any | None:
    """The first of :data:`MODEL_CLASSES` that maps ``config``'s class to a model (None: none does)."""
    return next((getattr(transformers, name) for name in MODEL_CLASSES
                 if type(config) in getattr(transformers, name)._model_mapping), None)


def _skeleton(transformers: Any, path: Path, dtype: torch.dtype) -> Any:
    """transformers' generating model for config.json (the first of :data:`MODEL_CLASSES` that maps its
    config), parameters on the meta device."""
    config = transformers.AutoConfig.from_pretrained(str(path))
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the registry runs the quantized experts; transformers must not
    auto = generating_class(transformers, config)
    if auto is None:
        raise ConfigError(f"{config_path(path)}: transformers has no generating model for model_type "
                          f"{config.model_type!r} (none of {', '.join(MODEL_CLASSES)} maps {type(config).__name__})")
    with parameters_on_meta():
        return auto.from_config(config, dtype=dtype)


def _check_expert_parallel(ep: int, cuda_graphs: bool | None, model: ModelConfig, target: Path) -> None:
    """``ep`` is a positive integer, the model's experts split evenly over ``ep`` ranks, and no CUDA graphs are
    asked for with it (checks on the arguments and config.json alone)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"ep={ep!r}: wanted a positive integer")
    if ep == 1:
        return
    for experts in sorted({model.shape_at(layer).num_experts for layer in model.moe_layers}):
        if experts % ep:
            raise ConfigError(f"ep={ep}: {config_path(target)} gives {experts} experts per MoE layer, which do not "
                              f"split evenly over {ep} ranks; wanted ep dividing {experts}")
    if cuda_graphs:
        raise ConfigError(f"cuda_graphs=True with ep={ep}: an experts call under expert parallelism runs "
                          "collectives between the ranks, which these graphs do not capture; leave cuda_graphs unset")


def _expert_parallel_rank(ep: int) -> int:
    """This rank under ``ep`` ranks (0 without expert parallelism), after checking that the process group the
    dispatch needs exists with ``ep`` ranks."""
    if ep == 1:
        return 0
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(f"ep={ep}: no torch.distributed process group; start {ep} ranks (torchrun "
                          f"--nproc-per-node {ep} ...) that each call torch.distributed.init_process_group() and "
                          f"then load_model(..., ep={ep})")
    if dist.get_world_size() != ep:
        raise ConfigError(f"ep={ep}, but the process group has {dist.get_world_size()} ranks; wanted {ep}")
    return dist.get_rank()


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               platform: str | None = None, kernel: str | None = None, prefer: str | None = None,
               cuda_graphs: bool | None = None, ep: int = 1, ep_implementation: str | None = None,
               max_tokens: int | None = None) -> Any:
    """A transformers ``PreTrainedModel`` (eval mode) for the checkpoint dir ``path``, its MoE layers' routed
    experts on the registry's kernels (the oracle decides per layer; ``kernel`` pins one, ``prefer`` prefers
    one). ``cuda_graphs`` (default: on for a CUDA device): each MoE layer's experts call of at most
    :data:`GRAPH_TOKENS` tokens replays a CUDA graph captured on its token bucket's first call (the count rounded
    up by at most 1/8, :func:`~moe_registry.whole.experts_module.graph_bucket`).
    ``ep`` above 1 (under torchrun, one process per rank, the process group already initialised with ``ep``
    ranks): each rank holds 1/ep of each layer's experts (rank r the r-th contiguous share) and runs its own
    tokens; the ranks may run different prompts but must call the model the same number of times (``generate``
    with ``min_new_tokens`` equal to ``max_new_tokens``: no rank stops early at EOS). ``ep_implementation`` says
    what moves the tokens, named as transformers' ``DistributedConfig`` names it: a dispatch transformers has
    registered that moves tokens between ranks (``all_to_all``, the default where the installed transformers has
    it, or ``auto``), or ``moe_registry``, the project's ``allgather_reducescatter`` dispatcher (the default
    elsewhere: each experts call gathers every rank's tokens padded to ``max_tokens``, runs this rank's experts on
    them and reduces the sums back; ``max_tokens`` bounds a rank's tokens per call).
    ``model.moe_registry_report`` (a :class:`LoadReport`) says what runs and how each tensor was loaded.
    Raises ConfigError/CheckpointError (one line) on bad input, SelectionError when no kernel runs a layer."""
    transformers = require_transformers()
    target = Path(path)
    if not target.is_dir():
        raise ConfigError(f"{target}: not a model dir (wanted a dir with config.json and safetensors)")
    registry = load_registry(())
    check_kernel_names(registry, kernel=kernel, prefer=prefer)
    model_config = read_model_config(target, registry)  # an unknown family: one line with the closest ones
    dtype_name = _dtype_name(dtype, model_config)
    torch_dtype = DTYPES[dtype_name]
    platform_text = platform or ("cpu" if str(device).startswith("cpu") else "auto")
    dev = device_for(parse_platform("cpu"), device)  # the device is given: the platform is not read
    _check_expert_parallel(ep, cuda_graphs, model_config, target)
    call = registry.families[model_config.family].spec.experts_call
    dispatch = resolve(ep_implementation, ep, call)
    ep_rank = _expert_parallel_rank(ep)
    dispatcher = "allgather_reducescatter" if dispatch == REGISTRY else None
    if cuda_graphs and dev.type != "cuda":
        raise ConfigError(f"cuda_graphs=True: the model is loaded to {dev}; CUDA graphs need a CUDA device")
    graph_tokens = GRAPH_TOKENS if (dev.type == "cuda" and ep == 1 if cuda_graphs is None else cuda_graphs) else 0
    model = _skeleton(transformers, target, torch_dtype)
    experts = experts_modules(model, call)
    if not experts:
        others = _other_experts(model)
        raise ConfigError(f"{config_path(target)}: transformers' {type(model).__name__} has no experts module taking "
                          f"the experts contract (hidden_states, top_k_index, top_k_weights)"
                          + (f"; its experts: {', '.join(others[:2])}" if others else ""))
    for layer in sorted(set(model_config.moe_layers) ^ set(experts)):
        where = f"transformers builds an experts module at {experts[layer]}" if layer in experts else \
            "transformers builds no experts module there"
        raise ConfigError(f"{config_path(target)}: layer {layer}: the family spec {model_config.family} says "
                          f"{'MoE' if layer in model_config.moe_layers else 'dense'}, but {where}")
    index = open_checkpoint(target)
    plan = _plan(model, index, experts, model_config.num_layers, model_config.mtp_layers)
    for layer, size in plan.expert_bytes.items():
        if size == 0:
            raise CheckpointError(f"layer {layer}: no expert tensors for {experts[layer]} in {index.root}")
    _check_tensors(model, index, plan, experts)
    wanted = non_expert_tensors(model, experts)
    other = sum(_nbytes(index.tensors[c]) for c in plan.to_model.values()) + sum(
        wanted[f"{m}.weight"].numel() * torch_dtype.itemsize for m in plan.quantized)
    # a layer is converted on the device: its checkpoint tensors and its converted copy (with the
    # converter's transposes) beside the layers already loaded
    check_fits(other * max(1, torch_dtype.itemsize // 2) + (sum(plan.expert_bytes.values())
               + 2 * max(plan.expert_bytes.values())) // ep, dev, f"loading {target}")
    plans, reports = [], []
    for layer, module_path in sorted(experts.items()):
        built = build(target, layer=layer, platform=platform_text, dtype=dtype_name, kernel=kernel, prefer=prefer,
                      device=dev, ep=ep if ep > 1 else None, all2all=dispatcher, max_tokens=max_tokens,
                      model_config=model_config, index=index, registry=registry,
                      ep_rank=ep_rank if ep > 1 and dispatcher is None else None).built
        module = EXPERTS_CALLS[call][1](built.kernel, built.report, layer, graph_tokens, top_k=model_config.shape.top_k)
        owner, _, attr = module_path.rpartition(".")
        setattr(model.get_submodule(owner), attr, module)
        assert built.report.scheme is not None and built.report.chosen is not None
        reports.append(built.report)
        plans.append(LayerPlan(layer, built.report.scheme.scheme, built.report.chosen, module.resident_bytes,
                               plan.expert_bytes[layer] // ep))
    loads = _load_tensors(model, index, plan, torch_dtype, dev)
    loads += _load_quantized_linears(model, index, plan, {p.layer: r for p, r in zip(plans, reports, strict=True)},
                                 registry, torch_dtype, dev)
    model.tie_weights()
    if ep > 1 and dispatcher is None:
        install(model, experts, ep, dispatch, dev)
    for name, buffer in list(model.named_buffers()):
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buffer.to(dev)
    generation = target / "generation_config.json"
    if generation.is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(target))
    model.eval()
    model.moe_registry_report = LoadReport(str(target), model_config.family, model.config.model_type,
                                           type(model).__name__, str(dev), dtype_name, tuple(plans), loads,
                                           plan.ignored, graph_tokens, ep_rank, ep, dispatch, plan.unloaded_layers)
    return model
