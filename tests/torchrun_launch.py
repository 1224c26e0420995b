"""Start a command the way a user would under torchrun, from a test: a free rendezvous port each time, and an
environment without this process's own torchrun variables (a test run under torchrun must not pass them on)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from moe_registry.cli.run_ep import TORCHRUN_VARS


def clean_env() -> dict[str, str]:
    """This process's environment less the variables torchrun sets for its ranks."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node nproc ARGS`` (a script path, or ``-m module ...``), output captured."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(free_port()), *args],
                          capture_output=True, text=True, env=clean_env(), timeout=timeout)
