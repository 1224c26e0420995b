"""A runtime description read from YAML/JSON (``moe-registry explain runtime.yaml``): the situation
without a model, or a model with runtime overrides. Validated like every file (extra="forbid")."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from moe_registry.core.errors import ConfigError
from moe_registry.core.vocab import ActivationFn, Dtype


class RuntimeFile(BaseModel):
    """A runtime description read from YAML/JSON (``moe-registry explain runtime.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    platform: str = "auto"
    dtype: Dtype | None = None
    tp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    all2all: str = "none"  # checked with the flags, so a typo gets "did you mean"
    expert_placement: str = "contiguous"  # likewise (core.vocab.ExpertPlacement)
    max_tokens: int = Field(default=8192, ge=1)
    router_weight_on_input: bool = False
    model: str | None = None
    num_experts: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=1)
    hidden: int | None = Field(default=None, ge=1)
    intermediate: int | None = Field(default=None, ge=1)
    activation: ActivationFn = "silu"
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
