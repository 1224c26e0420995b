"""What a built layer really keeps in memory: the bytes of every tensor storage reachable from an object.

A kernel's own account of its bytes (``resident_weight_bytes``) cannot see a converted or checkpoint
tensor that something else still points at; this walk can. It follows what holds a reference in
practice: attributes (``__dict__`` and ``__slots__``: dataclasses, nn.Modules), tuples, lists, sets,
dicts, closures and bound methods. Each storage counts once, whole (a view pins all of its storage).
Modules, classes and a function's globals are not followed: they are the program, not the layer.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

import torch

__all__ = ["reachable_tensor_bytes", "reachable_tensors"]

_LEAVES = (type, types.ModuleType, str, bytes, bytearray, int, float, complex, bool, type(None),
           types.BuiltinFunctionType, torch.dtype, torch.device)


def _referents(obj: object) -> Iterator[object]:
    """The objects ``obj`` holds a reference to, as far as the walk follows them."""
    if isinstance(obj, dict):
        yield from obj.keys()
        yield from obj.values()
        return
    if isinstance(obj, (tuple, list, set, frozenset)):
        yield from obj
        return
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                yield cell.cell_contents
        yield from obj.__defaults__ or ()
        yield from (obj.__kwdefaults__ or {}).values()
        return
    if isinstance(obj, types.MethodType):
        yield obj.__self__
        yield obj.__func__
        return
    if isinstance(obj, functools.partial):
        yield obj.func
        yield from obj.args
        yield from obj.keywords.values()
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        yield from attrs.values()
    for klass in type(obj).__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                yield getattr(obj, slot)


def reachable_tensors(root: object) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``root`` (each object visited once)."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            if obj.grad is not None:
                todo.append(obj.grad)
            continue
        todo.extend(_referents(obj))


def reachable_tensor_bytes(root: object) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` (a storage shared by views counts once)."""
    storages: dict[tuple[str, int], int] = {}
    for t in reachable_tensors(root):
        s = t.untyped_storage()
        key = (str(t.device), s.data_ptr() or id(s))
        storages[key] = max(storages.get(key, 0), s.nbytes())
    return sum(storages.values())
