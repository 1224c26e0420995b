"""Checks on the values of tensors read from a checkpoint, with the one way every such refusal names what it
found: a value the scheme fixes must hold everywhere (``check_all_equal``), and ``describe_bad`` counts and
locates the offending entries for the converters' checks too."""

from __future__ import annotations

import torch

from moe_registry.core.errors import CheckpointError


def describe_bad(t: torch.Tensor, mask: torch.Tensor, what: str, of: str = "values") -> str:
    """'N of M <of> are <what> (first at [i, j] = v)' for the True entries of ``mask``."""
    first = tuple(int(i) for i in mask.nonzero()[0])
    value = t[first].item()
    return f"{int(mask.sum())} of {t.numel()} {of} are {what} (first at {list(first)} = {value})"


def check_all_equal(t: torch.Tensor, value: float, full_name: str, why: str) -> None:
    """Every element equals ``value`` (a tensor the scheme fixes, e.g. a symmetric scheme's zero
    points): a different value would change the model's numbers if it were ignored."""
    bad = t.float() != value
    if bool(bad.any()):
        want = int(value) if float(value).is_integer() else value
        raise CheckpointError(f"{full_name}: {describe_bad(t, bad, f'not {want}')}; expected all {want} ({why})")
