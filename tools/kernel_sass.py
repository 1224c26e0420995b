"""The fused MoE GEMM kernels as ptxas builds them for a GPU that is not here: what a scheme's two
GEMMs become at a model shape and token count, with the tile configs the layer would take there.

For decode work without a GPU. Per GEMM: registers per thread, local-memory
spills, shared memory and the programs an SM holds by them (where a decode GEMM waits on memory, more
programs keep more bytes in flight), the main K loop's instruction count by opcode, and how the loop reads
global memory:
cp.async copies that Triton's pipeliner issues stages ahead (LDGSTS) against plain loads a step
waits on (LDG). The second kind in a decode loop is where MXFP4's scales stalled every step
before their loads were made one vector per row.

The kernel is specialised as Triton's JIT specialises it for the launch (pointers and integers
divisible by 16, integers equal to 1), from the arguments the layer's own launcher
(``api.gemm_launches``) passes for meta-device tensors of the converted weights; ptxas and nvdisasm
are the ones in Triton's wheel. The Triton here may be newer than the GPU machine's (3.6 there):
compare variants under one Triton, and time them on the GPU.

    python tools/kernel_sass.py --scheme mxfp4 --shape qwen3 --m 8
    python tools/kernel_sass.py --scheme gptq-w4a16 --shape mixtral --m 64 --config '{"BLOCK_N": 128}'
    python tools/kernel_sass.py --scheme awq-w4a16 --shape qwen3 --m 8 --device "NVIDIA H200"
    python tools/kernel_sass.py --scheme modelopt-nvfp4 --shape dsv2lite --m 8 --json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (tools/bench.py: scheme names, model shapes)

# the GPU whose tuned tile configs are read (--device names another of the same SMs), and its SM count (the
# defaults' split-K rule)
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
DEVICE_SMS = 132
# what an SM holds (CUDA's occupancy limits by compute capability x 10): 32-bit registers, shared memory for
# programs (bytes), resident warps and programs; each program also holds SHARED_RESERVED bytes the driver keeps,
# and a warp's registers are allocated in units of REGISTER_UNIT
SM_LIMITS = {90: {"registers": 65536, "shared": 233472, "warps": 64, "programs": 32},
             89: {"registers": 65536, "shared": 102400, "warps": 48, "programs": 24},
             86: {"registers": 65536, "shared": 102400, "warps": 48, "programs": 16},
             80: {"registers": 65536, "shared": 167936, "warps": 64, "programs": 32}}
SHARED_RESERVED = 1024
REGISTER_UNIT = 256
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)")


@dataclasses.dataclass(frozen=True)
class GemmSass:
    """What ptxas made of one GEMM launch."""

    gemm: str  # "gemm1" or "gemm2"
    kernel: str  # the Triton kernel's name
    config: dict
    registers: int
    spill_bytes: int  # per thread: ptxas's stack frame (where spilled registers go) and local memory
    loop_instructions: int  # the main K loop's body, once
    loop_opcodes: dict[str, int]  # opcode (without modifiers) -> count in the loop body
    loop_async_copies: int  # LDGSTS: global -> shared copies the pipeliner issues ahead
    loop_global_loads: int  # LDG: global loads into registers, waited on in the step
    input_quantised: str = "none"  # A_SCALE_IN: how the GEMM quantises one token's input itself ("none": it does not)
    shared_bytes: int = 0  # dynamic shared memory a program takes (the pipeline's stages and layout conversions)
    arch: int = 90

    @property
    def programs_per_sm(self) -> int:
        """Programs an SM holds at once, by registers, shared memory and warps, whichever runs out first: at
        decode, where a GEMM waits on memory, what keeps more bytes in flight."""
        sm = SM_LIMITS.get(self.arch, SM_LIMITS[90])
        warps = self.config["num_warps"]
        warp_registers = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        by_registers = sm["registers"] // (warp_registers * warps) if self.registers > 0 else sm["programs"]
        by_shared = sm["shared"] // (self.shared_bytes + SHARED_RESERVED)
        return min(by_registers, by_shared, sm["warps"] // warps, sm["programs"])

    @property
    def instructions_per_weight(self) -> float:
        """Warp instructions the loop issues per weight of a K step (every warp runs the loop over its
        share of the BLOCK_N x BLOCK_K tile): what a decode step costs where issue, not bandwidth,
        holds it."""
        return self.loop_instructions * self.config["num_warps"] / (self.config["BLOCK_N"] * self.config["BLOCK_K"])

    def to_text(self) -> str:
        top = ", ".join(f"{op} {n}" for op, n in sorted(self.loop_opcodes.items(), key=lambda kv: -kv[1])[:8])
        return (f"{self.gemm} {self.kernel}: {self.registers} registers, {self.spill_bytes} B spilled, "
                f"{self.shared_bytes // 1024} KiB shared, {self.programs_per_sm} programs an SM; main loop "
                f"{self.loop_instructions} instructions ({top}), {self.instructions_per_weight:.3f} warp "
                f"instructions per weight; loads in the loop: {self.loop_async_copies} "
                f"cp.async (LDGSTS), {self.loop_global_loads} waited on (LDG)"
                + (f"; quantises its input (scale: {self.input_quantised})" if self.input_quantised != "none" else "")
                + f"\n    config {json.dumps(self.config)}")


def record_launches(scheme: bench.Scheme, shape: bench.Shape, m: int, overrides: dict | None = None,
                    arch: int = 90, device_name: str = DEVICE_NAME) -> list:
    """[(kernel, args, kwargs, tile)] of the layer's two GEMM launches for ``m`` tokens on an sm_``arch``
    GPU (paired PTX dequantisation and dependent launch where it has them, the activations the kernel spec
    hands it there), weights on the meta device; the tile configs are the layer's (tuned for ``device_name``, or
    the defaults) with ``overrides``."""
    from moe_registry_kernels import quant_ref
    from moe_registry_kernels.triton import api

    from moe_registry import load_registry
    from moe_registry.core.keys import parse_quant_key
    from moe_registry.oracle.handed import handed_activation
    from moe_registry.oracle.predicates import matching_pattern
    from moe_registry.situation.runtime import Platform

    wkey, akey = parse_quant_key(scheme.weight), parse_quant_key(scheme.activation)
    # the activations the kernel is handed on that GPU (fp8 checkpoints before sm_89: 16-bit, weight-only)
    platform = Platform("cuda", (arch // 10, arch % 10))
    akey = handed_activation(akey, matching_pattern(load_registry().kernel(bench.KERNEL), wkey, akey, platform))
    # one random expert: its layout (and MX scale codes) stands for the shape's experts
    one = quant_ref.make_random_expert_weights(wkey, akey, num_experts=1, hidden=shape.hidden,
                                               intermediate=shape.intermediate, dtype=torch.bfloat16)
    launches = api.gemm_launches(one, shape.experts, shape.top_k, m, device_name=device_name, sms=DEVICE_SMS,
                                 capability=(arch // 10, arch % 10),
                                 overrides=overrides)
    return [(launch.kernel, launch.args, launch.kwargs, launch.tile) for launch in launches]


def compile_launch(fn, args: tuple, kwargs: dict, arch: int, workdir: Path):
    """Compile one recorded launch for sm_``arch`` as Triton's JIT would: (compiled kernel, cubin path)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    cubin = workdir / f"{fn.__name__}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    return kernel, cubin


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def main_loop(sass: str) -> list[str]:
    """The instructions of the K loop of a disassembly: the longest backward-branching loop among
    those that copy ahead (LDGSTS: the pipeliner's), else the longest. (A ZERO_SUMS tile's loop
    after the K loop, not pipelined, can be the longer one where K holds few groups.)"""
    lines = [line for line in sass.splitlines() if "//##" not in line]
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if INSTRUCTION.search(x)]
            loops.append((any("LDGSTS" in x for x in body), len(body), body))
    return max(loops, key=lambda loop: loop[:2])[2] if loops else []


def analyse(gemm: str, fn, config: dict, cubin: Path, input_quantised: str = "none", shared_bytes: int = 0,
            arch: int = 90) -> GemmSass:
    """Registers, spills and the main loop's instruction mix of a compiled kernel (``shared_bytes``: its
    shared memory, from Triton's metadata)."""
    usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    spilled = sum(int(m.group(1)) for m in re.finditer(r"(?:STACK|LOCAL):(\d+)", usage))
    sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(INSTRUCTION.search(line).group(2) for line in main_loop(sass))
    return GemmSass(gemm, fn.__name__, {k: config[k] for k in sorted(config)}, int(regs.group(1)) if regs else -1,
                    spilled, sum(ops.values()), dict(ops), ops["LDGSTS"], ops["LDG"], input_quantised, shared_bytes,
                    arch)


def kernel_sass(scheme: bench.Scheme, shape: bench.Shape, m: int, *, overrides: dict | None = None,
                arch: int = 90, device_name: str = DEVICE_NAME) -> list[GemmSass]:
    """GEMM1 and GEMM2 of the layer, compiled for sm_``arch`` and read."""
    with tempfile.TemporaryDirectory() as tmp:
        out = []
        launches = record_launches(scheme, shape, m, overrides, arch, device_name)
        for gemm, (fn, args, kwargs, cfg) in zip(("gemm1", "gemm2"), launches, strict=True):
            kernel, cubin = compile_launch(fn, args, kwargs, arch, Path(tmp))
            out.append(analyse(gemm, fn, cfg, cubin, kwargs.get("A_SCALE_IN", "none"), kernel.metadata.shared, arch))
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", required=True, help="a scheme spec name that lists triton-fused-moe")
    parser.add_argument("--shape", default="qwen3", choices=sorted(bench.SHAPES))
    parser.add_argument("--m", type=int, default=8, help="tokens (default 8)")
    parser.add_argument("--config", help="tile config keys (JSON) over the tuned or default ones, both GEMMs")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    from moe_registry_kernels.triton.tile_config import TUNED_STAND_INS

    same_sms = [device for device, stand_in in TUNED_STAND_INS.items() if stand_in == DEVICE_NAME]
    parser.add_argument("--device", default=DEVICE_NAME, choices=[DEVICE_NAME, *same_sms],
                        help=f"the GPU whose tile tables are read (default {DEVICE_NAME}; "
                             "one of the same SMs takes its own entries first)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_sass: TRITON_INTERPRET=1 turns the kernels into interpreted functions; it compiles them "
              "for a GPU and needs it unset", file=sys.stderr)
        return 2
    schemes = bench.registry_schemes()
    if args.scheme not in schemes:
        print(f"kernel_sass: unknown scheme {args.scheme!r}; wanted one of {', '.join(sorted(schemes))}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default on the GPU machine
    overrides = json.loads(args.config) if args.config else None
    results = kernel_sass(schemes[args.scheme], bench.SHAPES[args.shape], args.m, overrides=overrides, arch=args.arch,
                          device_name=args.device)
    if args.json:
        print(json.dumps([{**dataclasses.asdict(r), "instructions_per_weight": r.instructions_per_weight,
                           "programs_per_sm": r.programs_per_sm}
                          for r in results], indent=1))
    else:
        print(f"{args.scheme} on {bench.SHAPES[args.shape].name}, M = {args.m}, sm_{args.arch}, "
              f"{args.device}'s tiles:")
        for r in results:
            print("  " + r.to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
