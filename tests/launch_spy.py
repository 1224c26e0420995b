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


class ArgSpy:
    """A stand-in for a Triton kernel that records ``look(args, kwargs)`` of each launch (a tensor
    the launcher handed it, a constexpr it chose), then runs the real one."""

    def __init__(self, kernel: Any, look: Any, seen: list) -> None:
        self.kernel, self.look, self.seen = kernel, look, seen

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(self.look(args, kwargs))
            return launch(*args, **kwargs)

        return spy


class KwargSpy(ArgSpy):
    """An ArgSpy that records one keyword argument of each launch (a constexpr the launcher chose)."""

    def __init__(self, kernel: Any, name: str, seen: list) -> None:
        super().__init__(kernel, lambda args, kwargs: kwargs.get(name), seen)
