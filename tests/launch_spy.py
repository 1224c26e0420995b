"""A stand-in for a Triton kernel that records each launch's grid, then runs the real one: tests use
it to check which kernels a layer call launched (split-K, alignment paths), not only its numbers."""

from __future__ import annotations

from typing import Any


class LaunchSpy:
    def __init__(self, kernel: Any, launched: list) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid: Any) -> Any:
        self.launched.append(grid)
        return self.kernel[grid]
