"""``"moe_registry"`` as a transformers experts implementation: a bf16/fp16/fp32 model a user already loaded with
transformers runs its experts on the registry's kernel when selected (``experts_implementation="moe_registry"``
at load, or ``model.set_experts_implementation("moe_registry")``), through transformers' own ``ExpertsInterface``.

On its first call an experts module's dense 3-D weights are converted once (gate/up fused, transposed or
interleaved as transformers' ``use_experts_implementation`` flags say) into the kernel the oracle picks for the
unquantized scheme on the tensors' device and dtype; the converted kernel is cached on the module.

Under transformers' expert parallelism (``distributed_config`` at load, where the installed transformers has its
expert-parallel dispatch: ``moe_registry.whole.transformers_ep``) the module's weights are this rank's shard of
the experts, so the kernel holds only those, and takes the local ids transformers' dispatch hands it (an id of
``num_experts``, another rank's pair, adds nothing); the kernel's report says ``ep`` and the local experts."""

from __future__ import annotations

from typing import Any

import torch

from moe_registry.checkpoint.read import LayerTensors
from moe_registry.checkpoint.tensor_index import LayerNames
from moe_registry.core.errors import ConfigError
from moe_registry.layer.build import DTYPES, build_from_tensors
from moe_registry.oracle.select import select
from moe_registry.situation.runtime import MoEShape, ParallelConfig, Platform, RuntimeConfig
from moe_registry.situation.values import Situation
from moe_registry.spec.loader import load_registry
from moe_registry.whole.experts_module import RegistryExperts
from moe_registry.whole.requirement import require_transformers
from moe_registry.whole.transformers_ep import STYLE

NAME = "moe_registry"
_CACHE = "_moe_registry_experts"
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu"}


def register_experts_implementation() -> str:
    """Register :func:`experts_forward` under ``"moe_registry"`` in transformers' ExpertsInterface; returns the name."""
    require_transformers()
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    return NAME


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts contract, on the registry's kernel (built on the first call, then cached)."""
    experts = self.__dict__.get(_CACHE)
    if experts is None:
        experts = _build(self, hidden_states.dtype, top_k_index.shape[-1])
        self.__dict__[_CACHE] = experts  # not a submodule: transformers' own weights stay its state dict
    return experts(hidden_states, top_k_index, top_k_weights)


def _platform(device: torch.device) -> Platform:
    if device.type == "cuda":
        return Platform("cuda", torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    return Platform("cpu", None, "cpu")


def _dense(module: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate [E, I, H], up [E, I, H] and down [E, H, I] (views) from transformers' stored layout."""
    cls = type(module).__name__
    if not module.has_gate or getattr(module, "has_post_expert_norm", False):
        raise ConfigError(f"experts_implementation={NAME!r}: {cls} is not gated down(act(gate(x)) * up(x)); "
                          "the registry's kernels run only that")
    from transformers.integrations.moe import _default_apply_gate

    if type(module)._apply_gate is not _default_apply_gate or module.has_bias:
        # gpt-oss-style experts (own gate function, biases): their family spec says how they compute
        raise ConfigError(f"experts_implementation={NAME!r}: {cls} has its own gate function or expert biases; "
                          "load the checkpoint with moe_registry.load_model instead")
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    if module.is_transposed:  # stored [E, in, out]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if module.is_concatenated:
        gate, up = gate_up.chunk(2, dim=1)
    else:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return gate, up, down


def _build(module: Any, dtype: torch.dtype, top_k: int) -> RegistryExperts:
    gate, up, down = _dense(module)
    config = module.config
    ep, dispatch = _expert_parallel(module)
    act = _ACTIVATIONS.get(str(getattr(config, "hidden_act", "silu")))
    if act is None:
        raise ConfigError(f"experts_implementation={NAME!r}: hidden_act {config.hidden_act!r}; the kernels here run "
                          f"{', '.join(sorted(_ACTIVATIONS))}")
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ConfigError(f"experts_implementation={NAME!r}: hidden states in {dtype}; wanted one of {list(DTYPES)}")
    num_experts, intermediate, hidden = gate.shape  # this rank's experts under expert parallelism
    shape = MoEShape(num_experts * ep, top_k, hidden, intermediate, act)
    device = gate.device
    runtime = RuntimeConfig(_platform(device), names[dtype], shape, ParallelConfig(ep=ep))
    registry = load_registry(())
    report = select(registry, Situation(None, runtime, quant_source="a transformers model in memory",
                                        model=type(module).__name__))
    experts = tuple({"gate": {"weight": gate[e]}, "up": {"weight": up[e]}, "down": {"weight": down[e]}}
                    for e in range(num_experts))
    names_ = LayerNames(router="(transformers' router)", correction_bias=None, expert_prefix="experts.{expert}",
                        projections={"gate": "gate", "up": "up", "down": "down"})
    built = build_from_tensors(registry, report, LayerTensors(experts, None, None, names_, False), device=device,
                               tensor_name=names_.tensor)
    experts = RegistryExperts(built.kernel, built.report, -1, top_k=top_k)
    if getattr(module, "_is_expert_parallel", False):
        experts._is_expert_parallel = True
        total = f" of {num_experts * ep}" if ep > 1 else ""
        experts.expert_parallel = f"{num_experts}{total} experts on this rank, ids from {dispatch}"
    return experts


def _expert_parallel(module: Any) -> tuple[int, str]:
    """The expert-parallel size transformers split ``module``'s experts over (1 without, or where its config does
    not say) and its dispatch in words, from the ``distributed_config`` transformers puts on the model's config."""
    if not getattr(module, "_is_expert_parallel", False):
        return 1, ""
    distributed = getattr(module.config, "distributed_config", None)
    ep, name = getattr(distributed, "ep_size", None), getattr(distributed, "ep_implementation", None)
    return (ep if isinstance(ep, int) and ep > 1 else 1,
            f"transformers' {STYLE}" + (f" (ep_implementation {name!r})" if isinstance(name, str) else ""))
