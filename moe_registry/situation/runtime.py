"""The runtime situation a kernel is chosen for: platform, dtype, MoE shape, parallel config.

Built by situation.describe from flags (``--platform cuda:9.0 --tp 2``), a runtime YAML/JSON file, a
model's ``config.json``, or this machine as situation.machine probes it once. Values only: nothing
here reads files or probes the machine, so selection stays pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from moe_registry.core.errors import ConfigError
from moe_registry.core.keys import ACTIVATION_DTYPES

_PLATFORM_RE = re.compile(r"^(cpu|cuda|rocm|xpu)(?::(\d+)\.(\d+))?$")


@dataclass(frozen=True)
class Platform:
    """A device kind, its compute capability (GPUs) and name (when read off this machine)."""

    device: str
    capability: tuple[int, int] | None = None
    name: str = ""
    # a CPU's instruction-set flags as read off this machine (situation.machine); None: not probed (--platform cpu)
    cpu_features: frozenset[str] | None = None

    def __str__(self) -> str:
        cap = f":{self.capability[0]}.{self.capability[1]}" if self.capability else ""
        return f"{self.device}{cap}"


def parse_platform(text: str) -> Platform:
    """Parse ``cpu``, ``cuda:9.0``, ``rocm:9.4``, ``xpu`` (``auto`` is situation.machine's to probe)."""
    text = text.strip().lower()
    m = _PLATFORM_RE.match(text)
    if not m:
        raise ConfigError(f"--platform: got {text!r}; wanted cpu, cuda:<major>.<minor> (e.g. cuda:9.0), "
                          "rocm:<major>.<minor>, xpu or auto")
    device = m.group(1)
    if device in ("cuda", "rocm") and m.group(2) is None:
        raise ConfigError(f"--platform: {text!r} needs a capability, e.g. {device}:9.0")
    cap = (int(m.group(2)), int(m.group(3))) if m.group(2) is not None else None
    return Platform(device, cap)




@dataclass(frozen=True)
class Environment:
    """This machine, probed once (situation.machine): present in a RuntimeConfig only when the target
    platform is this machine, so a predicate can say what is installed here."""

    installed: frozenset[str] = frozenset()  # of the packages the kernel specs require
    commands: frozenset[str] = frozenset()  # of the programs the kernel specs require, found on PATH


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer as the kernel sees it (intermediate is per partition after TP)."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    activation: str = "silu"
    has_bias: bool = False
    shared_experts: int = 0  # dense MLPs beside the routed experts (reported, not run by the kernels)
    shared_intermediate: int = 0  # one shared expert's intermediate size


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor, expert and data parallel sizes and the all2all backend used for EP dispatch."""

    tp: int = 1
    ep: int = 1
    dp: int = 1
    all2all: str = "none"
    expert_placement: str = "contiguous"  # core.vocab.ExpertPlacement


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything about the situation that a kernel's constraints are tested against."""

    platform: Platform
    dtype: str = "bfloat16"
    shape: MoEShape | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    max_tokens: int = 8192
    router_weight_on_input: bool = False
    environment: Environment | None = None  # this machine, when the platform is this machine

    def local_shape(self) -> MoEShape | None:
        """The shape one rank computes: experts split by EP, intermediate split by TP without EP."""
        if self.shape is None:
            return None
        p = self.parallel
        if p.ep > 1:
            return replace(self.shape, num_experts=self.shape.num_experts // p.ep)
        return replace(self.shape, intermediate=self.shape.intermediate // p.tp)




def check_dtype(dtype: str) -> str:
    """Reject activation dtypes no kernel could take, naming the wanted ones."""
    if dtype not in ACTIVATION_DTYPES:
        raise ConfigError(f"--dtype: got {dtype!r}; wanted one of {', '.join(ACTIVATION_DTYPES)}")
    return dtype
