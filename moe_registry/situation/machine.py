"""This machine, probed once per situation: its first accelerator (asked of ``nvidia-smi``, so
explain never imports torch), the CPU's instruction-set flags, which of the packages the kernel specs
require are installed and which of the commands they require are on PATH.
The oracle only reads the result (situation.runtime.Environment)."""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
from collections.abc import Iterable

from moe_registry.situation.runtime import Environment, Platform


def _query(cmd: list[str]) -> str:
    import subprocess  # only when asked: subprocess costs a cached explain's start time

    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def probe_platform() -> Platform:
    """This machine's first accelerator, or the CPU. Asked once a process: the machine does not change while it
    runs, and each ask is an nvidia-smi run (about 20 ms; a 48-layer model's load asked once a layer)."""
    if shutil.which("nvidia-smi"):
        out = _query(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"])
        line = out.strip().splitlines()[0] if out.strip() else ""
        m = re.match(r"^(.*),\s*(\d+)\.(\d+)\s*$", line)
        if m:
            return Platform("cuda", (int(m.group(2)), int(m.group(3))), m.group(1).strip())
    return Platform("cpu", None, "cpu", probe_cpu_features())


def probe_cpu_features(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The instruction-set flags the CPU reports (Linux ``/proc/cpuinfo``'s names: avx2, fma, avx512_vnni ...):
    a kernel spec's platform ``cpu_features`` are checked against them; empty where the file is unreadable."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def probe_environment(packages: Iterable[str]) -> Environment:
    """Which of ``packages`` this interpreter can import (found, not imported)."""
    return Environment(frozenset(p for p in set(packages) if importlib.util.find_spec(p) is not None))


def probe_commands(commands: Iterable[str]) -> frozenset[str]:
    """Which of ``commands`` are on PATH (a kernel compiled on first use needs its compiler)."""
    return frozenset(c for c in set(commands) if shutil.which(c) is not None)
