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


def without_and_with(experts: Any, inputs: tuple, plain: tuple[dict, dict], asked: tuple[dict, dict], kernel: str,
                     look: Any, monkeypatch: Any) -> tuple[Any, Any, list]:
    """A layer's output under the tile configs ``plain`` (GEMM1's, GEMM2's), then under ``asked`` with the
    launches of the GEMM kernel named ``kernel`` watched (``look(args, kwargs)`` of each): (plain output,
    asked output, what was seen). For tile options that must not change a number, or change it only so."""
    from moe_registry_kernels.triton import gemm, launch, tile_config

    with tile_config.config_override(*plain):
        without = experts.apply(*inputs)
    seen: list = []
    monkeypatch.setattr(launch, kernel, ArgSpy(getattr(gemm, kernel), look, seen))
    with tile_config.config_override(*asked):
        with_option = experts.apply(*inputs)
    return without, with_option, seen
