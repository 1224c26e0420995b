"""What a safetensors checkpoint holds, by name: every tensor's file, dtype and shape from the headers, and
where one MoE layer's pieces sit under a family's naming.

Read without torch (a header is 8 bytes of length and a JSON table), so the command line can refuse a
checkpoint that lacks a layer's router or tensors in a fraction of a second, before torch is imported or a
kernel compiled. Tensors themselves are read by :meth:`CheckpointIndex.load`, which imports torch then.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open  # the reader without torch (safe_open imports torch at the first tensor read)

from moe_registry.core import guards
from moe_registry.core.errors import CheckpointError
from moe_registry.spec.view import ModelFamilySpec

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
_ST_DTYPES = {"I32": "int32", "I64": "int64", "I8": "int8", "U8": "uint8", "F16": "float16",
              "BF16": "bfloat16", "F32": "float32", "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu",
              "I16": "int16", "F64": "float64", "BOOL": "bool"}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: the file holding it, its dtype name and shape."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor name in the checkpoint with its header entry (nothing loaded)."""

    root: Path
    tensors: Mapping[str, TensorInfo]
    _held: dict[Path, Any] = field(default_factory=dict, compare=False, repr=False)
    _depth: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    @contextmanager
    def held_open(self) -> Iterator[None]:
        """Keep each file opened inside this block open until the outermost such block ends. Opening a
        safetensors file parses its whole header (thousands of entries in a real checkpoint), so reading a
        layer's tensors with one open each would parse it once per tensor; when the block ends the files are
        closed and their maps dropped, so no file stays mapped between layers."""
        self._depth[0] += 1
        try:
            yield
        finally:
            self._depth[0] -= 1
            if not self._depth[0]:
                handles = list(self._held.values())
                self._held.clear()
                for handle in handles:
                    handle.__exit__(None, None, None)

    @contextmanager
    def _open(self, file: Path) -> Iterator[Any]:
        """``file`` opened for reading: the held handle inside :meth:`held_open`, else opened for this read."""
        if not self._depth[0]:
            with safe_open(str(file), framework="pt") as f:
                yield f
            return
        handle = self._held.get(file)
        if handle is None:
            handle = self._held[file] = safe_open(str(file), framework="pt").__enter__()
        yield handle

    def load(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        with self._open(info.file) as f:
            tensor = f.get_tensor(name)
        guards.check_tensor_values(name, tensor)  # NaN/inf, fp8/e8m0 NaN codes: refused at load
        return tensor

    def load_experts(self, name: str, experts: Sequence[int] | None, rows: int = 1) -> torch.Tensor:
        """A tensor stacked over experts along dim 0 (``rows`` rows per expert), only ``experts``' slices in
        that order (``None``: the whole tensor). Runs of consecutive experts are read as one slice
        (``get_slice``), so no other expert's bytes are read."""
        if experts is None:
            return self.load(name)
        runs: list[list[int]] = []
        for e in experts:
            if runs and e == runs[-1][1]:
                runs[-1][1] = e + 1
            else:
                runs.append([e, e + 1])
        import torch

        info = self.tensors[name]
        with self._open(info.file) as f:
            sl = f.get_slice(name)
            parts = [sl[lo * rows:hi * rows] for lo, hi in runs]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        guards.check_tensor_values(name, tensor)
        return tensor


def open_checkpoint(model_dir: Path) -> CheckpointIndex:
    """Index a model dir's safetensors files by reading their headers only."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a model dir")
    files = guards.checkpoint_files(model_dir, INDEX_FILE)  # inside the model dir, regular files only
    if not files:
        pickles = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not read, convert them)" if pickles else ""
        raise CheckpointError(f"{model_dir}: no .safetensors files{hint}")
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        try:
            entries = read_header(path)
        except HeaderError as err:
            raise CheckpointError(f"{path}: cannot read safetensors header: {err}") from None
        for name, (dtype, shape) in entries.items():
            guards.no_duplicate_tensor(tensors, name, path)
            tensors[name] = TensorInfo(path, _ST_DTYPES.get(dtype, dtype), shape)
    return CheckpointIndex(model_dir, tensors)


class HeaderError(ValueError):
    """A safetensors header that does not read; the message says what is wrong."""


# bytes per element of each safetensors dtype code (for the size check of a header's offsets)
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (safetensors dtype code, shape) from ``path``'s header, checked as safetensors checks it:
    the length fits the file, the JSON is a table of tensors, each with a dtype, a shape and offsets that lie
    inside the data and match the shape's bytes. Sub-byte codes (F4) are taken without the byte check."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= length <= min(size - 8, guards.MAX_INDEX_BYTES):
                raise HeaderError(f"header length {length} does not fit a file of {size} bytes")
            table = json.loads(f.read(length))
    except OSError as err:
        raise HeaderError(str(err)) from None
    except (ValueError, RecursionError) as err:  # not UTF-8 or not JSON
        raise HeaderError(f"not a JSON header ({err})") from None
    if not isinstance(table, dict):
        raise HeaderError(f"the header is a JSON {type(table).__name__}, not a table of tensors")
    data = size - 8 - length
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (isinstance(dtype, str) and isinstance(shape, list)
                  and all(type(d) is int and d >= 0 for d in (*shape, begin, end)) and begin <= end <= data)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise HeaderError(f"tensor {guards.short_repr(name)}: entry {guards.short_repr(entry)} is not "
                              "{dtype, shape, data_offsets [begin, end] within the data}")
        width = _ST_BYTES.get(dtype)
        if width is not None and (end - begin) != math.prod(shape) * width:
            raise HeaderError(f"tensor {guards.short_repr(name)}: {end - begin} bytes for {dtype} shape {shape}")
        out[name] = (dtype, tuple(shape))
    return out


@dataclass(frozen=True)
class FusedNames:
    """Full names of a fused family's stacked expert tensors in one layer, with how to read them.
    Gate and up are one ``gate_up`` tensor or two, ``gate`` and ``up``."""

    gate_up: str | None
    down: str
    gate_up_bias: str | None
    down_bias: str | None
    layouts: tuple[tuple[str, ...], ...]
    gate_up_order: str
    gate: str | None = None
    up: str | None = None
    down_layout: tuple[str, ...] | None = None
    tensor_names: str | None = None  # the scheme's checkpoint.fused_names ('_{tensor}'), once read with it

    def of(self, what: str) -> str | None:
        """'gate_up', 'gate', 'up', 'down', 'gate_up_bias' or 'down_bias' -> full name (None: not named)."""
        return getattr(self, what)

    @property
    def parts(self) -> tuple[str, ...]:
        """Which weight tensors this layer has: ('gate_up', 'down') or ('gate', 'up', 'down')."""
        return ("gate_up", "down") if self.gate_up is not None else ("gate", "up", "down")

    def holder(self, role: str) -> str:
        """The part holding ``role`` ('gate', 'up' or 'down')."""
        return role if role in self.parts else "gate_up"


@dataclass(frozen=True)
class LayerNames:
    """Full checkpoint names of one MoE layer's pieces, as this checkpoint holds them: ``fused``, the
    3-D tensors of a fused family, or ``expert_prefix`` (with {expert}) and ``projections`` (role ->
    module name) for per-expert tensors."""

    router: str
    correction_bias: str | None
    expert_prefix: str | None  # with {expert}
    fused: FusedNames | None = None
    router_bias: str | None = None
    projections: Mapping[str, str] | None = None
    stacked: Mapping[str, str] | None = None  # per-expert naming: tensor -> full name ({part}) held stacked

    def projection(self, expert: int, role: str) -> str:
        if self.fused is not None:
            return f"{self.fused.of(self.fused.holder(role))}[{expert}]"
        assert self.expert_prefix is not None and self.projections is not None
        return f"{self.expert_prefix.format(expert=expert)}.{self.projections[role]}"

    def tensor(self, expert: int, role: str, tensor: str) -> str:
        """The checkpoint name of one expert's one tensor, for messages (fused: which slice of which tensor)."""
        if self.fused is None and self.stacked is not None and tensor in self.stacked:
            part = "down" if role == "down" else "gate_up"
            return f"{self.stacked[tensor].format(part=part)}[{expert}]" + (f" ({role} part)" if part != role else "")
        if self.fused is None:
            return f"{self.projection(expert, role)}.{tensor}"
        fused = self.fused.holder(role)
        name = self.fused.of(f"{fused}_bias" if tensor == "bias" else fused)
        if tensor != "bias" and self.fused.tensor_names is not None:
            name = f"{name}{self.fused.tensor_names.format(tensor=tensor)}"
        return f"{name}[{expert}]" + (f" ({role} part)" if fused == "gate_up" else "")


def layer_prefix(template: str, alternatives: Sequence[str], layer: int, index: CheckpointIndex) -> str:
    """``layer``'s tensor prefix: ``template``'s, or the first of ``alternatives`` under which ``index`` holds a
    tensor when it holds none under ``template``'s (a text-only checkpoint of a multimodal family)."""
    prefixes = [t.format(layer=layer) for t in (template, *alternatives)]
    if len(prefixes) > 1:
        for prefix in prefixes:
            if any(name.startswith(prefix + ".") for name in index.tensors):
                return prefix
    return prefixes[0]


def layer_names(family: ModelFamilySpec, layer: int, index: CheckpointIndex) -> LayerNames:
    """The names of ``layer``'s pieces as ``index`` holds them: the fused tensors when it has them (or
    the family names no others), else the first per-expert naming (the primary one, then
    ``naming.alternatives``) whose first expert or router it holds. A layer held under none of them
    is a CheckpointError naming what was looked for under each."""
    n = family.naming
    prefix = layer_prefix(n.layer, n.layer_alternatives, layer, index)
    fused = None
    if n.fused is not None:
        f = n.fused
        def full(name: str | None) -> str | None:
            return f"{prefix}.{name}" if name else None

        fused = FusedNames(full(f.gate_up), f"{prefix}.{f.down}", full(f.gate_up_bias), full(f.down_bias),
                           f.layouts, f.gate_up_order, full(f.gate), full(f.up), f.down_layout)
    primary = LayerNames(f"{prefix}.{n.router}.weight",
                         f"{prefix}.{n.correction_bias}" if n.correction_bias else None,
                         f"{prefix}.{n.expert}" if n.expert else None, fused, f"{prefix}.{n.router}.bias",
                         dict(n.projections) if n.projections else None)
    if fused is not None and (n.expert is None or fused.of(fused.parts[0]) in index.tensors):
        return primary
    primary = replace(primary, fused=None)  # per expert (a family naming both: this checkpoint's way)
    if not n.alternatives:
        return primary
    candidates: list[tuple[str, LayerNames]] = [("naming", primary)]
    for i, alt in enumerate(n.alternatives):
        candidates.append((f"naming.alternatives[{i}]", LayerNames(
            f"{prefix}.{alt.router}.weight", primary.correction_bias, f"{prefix}.{alt.expert}", None,
            f"{prefix}.{alt.router}.bias", dict(alt.projections))))
    for _, names in candidates:
        assert names.expert_prefix is not None and names.projections is not None
        first = tuple(f"{names.expert_prefix.format(expert=0)}.{p}." for p in names.projections.values())
        if names.router in index.tensors or any(t.startswith(first) for t in index.tensors):
            return names
    looked = "; ".join(f"{where}: {c.expert_prefix.format(expert='N')}.{{{','.join(c.projections.values())}}}.* "  # type: ignore[union-attr]
                       f"or {c.router}" for where, c in candidates)
    raise CheckpointError(f"layer {layer}: no expert tensors or router under any naming of family {family.family} "
                          f"in {index.root} ({looked}; is layer {layer} a MoE layer?)")
