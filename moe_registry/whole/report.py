"""What ``load_model`` did, carried by the model as ``model.moe_registry_report``: each MoE layer's scheme
and kernel, the experts' resident bytes beside the checkpoint's expert bytes, and how every other tensor was
loaded (as stored, cast, or dequantised once), so what runs is never a surprise."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from moe_registry.whole.transformers_ep import REGISTRY, describe


@dataclass(frozen=True)
class LayerPlan:
    """One MoE layer: the scheme and kernel the oracle picked for it and the bytes its experts hold."""

    layer: int
    scheme: str
    kernel: str
    resident_bytes: int
    checkpoint_bytes: int


@dataclass(frozen=True)
class TensorLoad:
    """How a group of non-expert tensors was loaded: ``how`` is ``as stored``, ``cast to <dtype>``, ``dequantised
    once from <scheme>`` or ``run packed on <kernel>'s one-projection form from <scheme>`` (with how its activations
    run); ``names`` are the model's parameter names."""

    how: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class LoadReport:
    """The whole model's load: family, device, dtype, per-layer plans and non-expert tensor loads."""

    path: str
    family: str
    model_type: str
    architecture: str
    device: str
    dtype: str
    layers: tuple[LayerPlan, ...]
    non_expert: tuple[TensorLoad, ...]
    ignored: tuple[str, ...] = ()  # checkpoint tensors the model has no place for
    graph_tokens: int = 0  # experts calls of at most this many tokens replay captured CUDA graphs (0: none)
    ep_rank: int = 0  # expert parallelism: this rank, of ep_size, holds 1/ep_size of each layer's experts
    ep_size: int = 1
    ep_implementation: str = ""  # what moves the tokens between the ranks (transformers_ep.describe says it)
    # checkpoint layers past the decoder's that transformers' model does not load (multi-token prediction)
    unloaded_layers: tuple[int, ...] = ()

    @property
    def experts_resident_bytes(self) -> int:
        return sum(p.resident_bytes for p in self.layers)

    @property
    def experts_checkpoint_bytes(self) -> int:
        return sum(p.checkpoint_bytes for p in self.layers)

    def layer_runs(self) -> list[tuple[int, int, str, str]]:
        """Consecutive MoE layers with the same scheme and kernel, as (first, last, scheme, kernel)."""
        runs: list[tuple[int, int, str, str]] = []
        for p in self.layers:
            if runs and runs[-1][2:] == (p.scheme, p.kernel):
                runs[-1] = (runs[-1][0], p.layer, p.scheme, p.kernel)
            else:
                runs.append((p.layer, p.layer, p.scheme, p.kernel))
        return runs

    def to_text(self) -> str:
        lines = [f"{self.path}: {self.architecture} ({self.model_type}, family {self.family}) on {self.device}, "
                 f"{self.dtype}"]
        for first, last, scheme, kernel in self.layer_runs():
            which = f"layer {first}" if first == last else f"layers {first}-{last}"
            lines.append(f"  MoE {which}: scheme {scheme}, kernel {kernel}")
        resident, stored = self.experts_resident_bytes, self.experts_checkpoint_bytes
        ratio = f" ({resident / stored:.2f}x)" if stored else ""
        whose = "this rank's share of the checkpoint's expert tensors" if self.ep_size > 1 else \
            "checkpoint's expert tensors"
        lines.append(f"  experts hold {_bytes(resident)} ({whose}: {_bytes(stored)}){ratio}")
        if self.ep_size > 1:
            lines.append(f"  expert parallel: rank {self.ep_rank} of {self.ep_size} holds 1/{self.ep_size} of each "
                         f"layer's experts; {describe(self.ep_implementation or REGISTRY)}")
        if self.graph_tokens:
            lines.append(f"  experts calls of 1-{self.graph_tokens} tokens replay a CUDA graph per layer and token "
                         "bucket (the count rounded up by at most 1/8, padding rows weighted 0), captured on its "
                         "first call")
        elif self.device.startswith("cuda"):
            lines.append("  experts calls launch their kernels directly (cuda_graphs off)")
        for load in self.non_expert:
            lines.append(f"  {len(load.names)} other tensors {load.how}")
        if self.unloaded_layers:
            which = ", ".join(map(str, self.unloaded_layers))
            lines.append(f"  checkpoint layer{'s' if len(self.unloaded_layers) > 1 else ''} {which}: multi-token "
                         "prediction, left unloaded as transformers' model leaves it")
        if self.ignored:
            shown = ", ".join(self.ignored[:4]) + (" ..." if len(self.ignored) > 4 else "")
            lines.append(f"  {len(self.ignored)} checkpoint tensors not used by the model: {shown}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["experts_resident_bytes"] = self.experts_resident_bytes
        out["experts_checkpoint_bytes"] = self.experts_checkpoint_bytes
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
