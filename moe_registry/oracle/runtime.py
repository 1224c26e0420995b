"""The runtime situation a kernel is chosen for: platform, dtype, MoE shape, parallel config.

Built from flags (``--platform cuda:9.0 --tp 2``), from a runtime YAML/JSON file, from a model's
``config.json`` (see model_config), or from the live machine. Reading the live machine does not
import torch (explain stays fast): it asks ``nvidia-smi`` / ``rocm-smi`` when present.
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_registry.core.errors import ConfigError
from moe_registry.core.keys import ACTIVATION_DTYPES

_PLATFORM_RE = re.compile(r"^(cpu|cuda|rocm|xpu)(?::(\d+)\.(\d+))?$")


@dataclass(frozen=True)
class Platform:
    """A device kind, its compute capability (GPUs) and name; ``live`` when read off this machine."""

    device: str
    capability: tuple[int, int] | None = None
    name: str = ""
    live: bool = False

    def __str__(self) -> str:
        cap = f":{self.capability[0]}.{self.capability[1]}" if self.capability else ""
        return f"{self.device}{cap}"


def parse_platform(text: str) -> Platform:
    """Parse ``cpu``, ``cuda:9.0``, ``rocm:9.4``, ``xpu``; ``auto`` reads the live machine."""
    text = text.strip().lower()
    if text == "auto":
        return live_platform()
    m = _PLATFORM_RE.match(text)
    if not m:
        raise ConfigError(f"--platform: got {text!r}; wanted cpu, cuda:<major>.<minor> (e.g. cuda:9.0), "
                          "rocm:<major>.<minor>, xpu or auto")
    device = m.group(1)
    if device in ("cuda", "rocm") and m.group(2) is None:
        raise ConfigError(f"--platform: {text!r} needs a capability, e.g. {device}:9.0")
    cap = (int(m.group(2)), int(m.group(3))) if m.group(2) is not None else None
    return Platform(device, cap)


def _query(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def live_platform() -> Platform:
    """This machine's first accelerator, or the CPU."""
    if shutil.which("nvidia-smi"):
        out = _query(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
        line = out.strip().splitlines()[0] if out.strip() else ""
        m = re.match(r"^(.*),\s*(\d+)\.(\d+)\s*$", line)
        if m:
            return Platform("cuda", (int(m.group(2)), int(m.group(3))), m.group(1).strip(), live=True)
    return Platform("cpu", None, "cpu", live=True)


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


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything about the situation that a kernel's constraints are tested against."""

    platform: Platform
    dtype: str = "bfloat16"
    shape: MoEShape | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    max_tokens: int = 8192
    router_weight_on_input: bool = False

    def local_shape(self) -> MoEShape | None:
        """The shape one rank computes: experts split by EP, intermediate split by TP without EP."""
        if self.shape is None:
            return None
        p = self.parallel
        if p.ep > 1:
            return replace(self.shape, num_experts=self.shape.num_experts // p.ep)
        return replace(self.shape, intermediate=self.shape.intermediate // p.tp)


class RuntimeFile(BaseModel):
    """A runtime description read from YAML/JSON (``moe-registry explain runtime.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    platform: str = "auto"
    dtype: Literal["float16", "bfloat16", "float32"] | None = None
    tp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    all2all: str = "none"
    max_tokens: int = Field(default=8192, ge=1)
    router_weight_on_input: bool = False
    model: str | None = None
    num_experts: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=1)
    hidden: int | None = Field(default=None, ge=1)
    intermediate: int | None = Field(default=None, ge=1)
    activation: Literal["silu", "gelu", "swigluoai"] = "silu"
    has_bias: bool = False
    quantization_config: dict[str, Any] | None = None


def parse_runtime_file(data: Any, path: str) -> RuntimeFile:
    """Validate a runtime file's data; the error names the file and field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a runtime file must be a mapping")
    body = data.get("runtime", data) if isinstance(data.get("runtime"), dict) else data
    try:
        return RuntimeFile.model_validate(body)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(e["loc"][-1]), list(RuntimeFile.model_fields), n=1, cutoff=0.6)
            msg = "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
        raise ConfigError(f"{path}: {where}: {msg}") from None


def check_dtype(dtype: str) -> str:
    """Reject activation dtypes no kernel could take, naming the wanted ones."""
    if dtype not in ACTIVATION_DTYPES:
        raise ConfigError(f"--dtype: got {dtype!r}; wanted one of {', '.join(ACTIVATION_DTYPES)}")
    return dtype
