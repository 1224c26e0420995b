"""Shared fixtures: example checkpoints are generated once per session (they are not committed);
NaN-filled fresh buffers for tests of rows a kernel must never read unwritten."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# Without a GPU, Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The spec cache of a test run lives and dies with it (tests/test_spec_cache.py tests the cache itself).
os.environ.setdefault("MOE_REGISTRY_CACHE_DIR", tempfile.mkdtemp(prefix="moe-registry-test-cache-"))
sys.path.insert(0, str(ROOT / "tools"))


@pytest.fixture(scope="session")
def example(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """example(name) -> path of that example checkpoint, written on first use."""
    from make_examples import make_example

    out = tmp_path_factory.mktemp("examples")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = Path(make_example(name, out))
        return made[name]

    return get


@pytest.fixture
def nan_filled_empty(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call it to make every later floating-point ``torch.empty`` come back filled with NaN, so a
    buffer row that is read before anything wrote it shows up in the output."""
    real_empty = torch.empty

    def nan_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    return lambda: monkeypatch.setattr(torch, "empty", nan_empty)
