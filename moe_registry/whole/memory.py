"""Free memory on the device a model is loaded to, asked before anything is read, so a load that cannot fit
stops with one line (bytes needed and free) instead of failing half way."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_registry.core.errors import ConfigError


def free_bytes(device: torch.device) -> int | None:
    """Bytes free on ``device`` (CUDA: the driver's count; CPU: the kernel's MemAvailable); None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits(needed: int, device: torch.device, what: str) -> None:
    """ConfigError when ``needed`` bytes are more than ``device`` has free."""
    free = free_bytes(device)
    if free is not None and needed > free:
        raise ConfigError(f"{what}: needs {needed} bytes ({needed / 2**30:.2f} GiB) on {device}, "
                          f"{free} bytes ({free / 2**30:.2f} GiB) are free")
