"""Peak memory while ``moe_registry.load_model`` loads a checkpoint, against what the loaded model keeps: loading
must never hold a dequantised copy of all experts, so the peak stays within ``--limit`` (default 1.5) times the
experts at their checkpoint's packed size plus every other tensor the model keeps.

The load runs in a child process of its own, twice: the first load brings in what any load needs once (modules,
the registry's specs, the CPU kernels' library, torch's thread pools), is dropped, and its freed heap is handed
back to the system (glibc ``malloc_trim``); the second is measured, so the figure is what loading this
checkpoint takes:

- CPU: resident set size; the kernel's peak (VmHWM) is reset (``/proc/self/clear_refs``) before the second load,
  and the peak the load adds is VmHWM less the resident size then. Pages of the safetensors files the load maps
  count while they are resident.
- CUDA: ``torch.cuda.max_memory_allocated`` over the load (nothing is on the device before it).

The second load's wall time is reported too (``load_s``: the checkpoint's files in the page cache by then).

    python tools/load_memory.py MODEL_DIR                  # CPU
    python tools/load_memory.py MODEL_DIR --device cuda --json

Exit status 1 when the peak is past the limit.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak() -> None:
    """The kernel's peak resident size (VmHWM) back to the current one."""
    Path("/proc/self/clear_refs").write_text("5")


def kept_bytes(model: Any) -> tuple[int, int]:
    """(bytes of every tensor storage the model keeps outside its experts modules, the experts modules' bytes)."""
    import torch

    from moe_registry.layer.resident import reachable_tensors
    from moe_registry.whole.experts_module import RegistryExperts

    experts = [m for m in model.modules() if isinstance(m, RegistryExperts)]
    inside = {id(t) for m in experts for t in m.parameters()} | {id(t) for m in experts for t in m.buffers()}
    seen: set[tuple[str, int]] = set()
    other = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in inside or t.is_meta:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            other += storage.nbytes()
    held: set[tuple[str, int]] = set()
    expert_bytes = 0
    for m in experts:
        for t in reachable_tensors(m.kernel):
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key not in held and isinstance(t, torch.Tensor):
                held.add(key)
                expert_bytes += storage.nbytes()
    return other, expert_bytes


def measure(path: Path, device: str) -> dict[str, Any]:
    """In this process: warm the imports, then load ``path`` once and report its peak against what it keeps."""
    import ctypes
    import gc

    import torch

    from moe_registry.whole.load import load_model

    first = load_model(path, device=device)
    del first
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        _reset_peak()
        before = _status("VmRSS")
    start = time.perf_counter()
    model = load_model(path, device=device)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - before
    other, experts = kept_bytes(model)
    stored = model.moe_registry_report.experts_checkpoint_bytes
    return {"path": str(path), "device": device, "load_s": seconds, "peak_bytes": peak, "kept_other_bytes": other,
            "experts_resident_bytes": experts, "experts_checkpoint_bytes": stored,
            "peak_over_packed": peak / (stored + other), "peak_over_kept": peak / (experts + other),
            "kernels": sorted({p.kernel for p in model.moe_registry_report.layers})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="a checkpoint dir load_model reads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", type=float, default=1.5, help="largest peak / (packed experts + other tensors)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.model, args.device)))
        return 0
    done = subprocess.run([sys.executable, __file__, str(args.model), "--device", args.device, "--child"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"load_memory.py: {args.model}: {last}", file=sys.stderr)
        return 2
    r = json.loads(done.stdout.strip().splitlines()[-1])
    r["limit"] = args.limit
    r["within_limit"] = r["peak_over_packed"] <= args.limit
    if args.json:
        print(json.dumps(r))
    else:
        mib = 2**20
        print(f"{r['path']} on {r['device']} ({', '.join(r['kernels'])}): peak during load "
              f"{r['peak_bytes'] / mib:.1f} MiB; experts packed {r['experts_checkpoint_bytes'] / mib:.1f} MiB "
              f"(held {r['experts_resident_bytes'] / mib:.1f}) + other tensors {r['kept_other_bytes'] / mib:.1f} MiB; "
              f"peak / (packed + other) = {r['peak_over_packed']:.2f} (limit {args.limit}); the load took "
              f"{r['load_s']:.2f} s")
    return 0 if r["within_limit"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
