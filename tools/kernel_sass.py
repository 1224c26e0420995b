"""The fused MoE GEMM kernels as ptxas builds them for a GPU that is not here: what a scheme's two
GEMMs become at a model shape and token count, with the tile configs the layer would take there.

For decode work without a GPU. Per GEMM: registers per thread, local-memory
spills, the main K loop's instruction count by opcode, and how the loop reads global memory:
cp.async copies that Triton's pipeliner issues stages ahead (LDGSTS) against plain loads a step
waits on (LDG). The second kind in a decode loop is where MXFP4's scales stalled every step
before their loads were made one vector per row.

The kernel is specialised as Triton's JIT specialises it for the launch (pointers and integers
divisible by 16, integers equal to 1), from the arguments the layer's own launcher
(``triton_moe._gemm``) passes for meta-device tensors of the converted weights; ptxas and nvdisasm
are the ones in Triton's wheel. The Triton here may be newer than the GPU machine's (3.6 there):
compare variants under one Triton, and time them on the GPU.

    python tools/kernel_sass.py --scheme mxfp4 --shape qwen3 --m 8
    python tools/kernel_sass.py --scheme gptq-w4a16 --shape mixtral --m 64 --config '{"BLOCK_N": 128}'
    python tools/kernel_sass.py --scheme modelopt-nvfp4 --shape dsv2lite --m 8 --json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (tools/bench.py: scheme names, model shapes)

# the GPU whose tuned tile configs are read, and its SM count (the defaults' split-K rule)
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
DEVICE_SMS = 132
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

    @property
    def instructions_per_weight(self) -> float:
        """Warp instructions the loop issues per weight of a K step (every warp runs the loop over its
        share of the BLOCK_N x BLOCK_K tile): what a decode step costs where issue, not bandwidth,
        holds it."""
        return self.loop_instructions * self.config["num_warps"] / (self.config["BLOCK_N"] * self.config["BLOCK_K"])

    def to_text(self) -> str:
        top = ", ".join(f"{op} {n}" for op, n in sorted(self.loop_opcodes.items(), key=lambda kv: -kv[1])[:8])
        return (f"{self.gemm} {self.kernel}: {self.registers} registers, {self.spill_bytes} B spilled; main loop "
                f"{self.loop_instructions} instructions ({top}), {self.instructions_per_weight:.3f} warp "
                f"instructions per weight; loads in the loop: {self.loop_async_copies} "
                f"cp.async (LDGSTS), {self.loop_global_loads} waited on (LDG)"
                + (f"; quantises its input (scale: {self.input_quantised})" if self.input_quantised != "none" else "")
                + f"\n    config {json.dumps(self.config)}")


class _Recorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.fn, args, kwargs))
        return launch


def _meta(t: torch.Tensor | None, experts: int) -> torch.Tensor | None:
    """A meta-device tensor laid out as ``t`` (its strides: a transposed scale stays transposed) with
    ``experts`` on its first dimension, each expert right after the one before."""
    if t is None:
        return None
    expert_span = max((n * s for n, s in zip(t.shape[1:], t.stride()[1:], strict=True)), default=1)
    return torch.empty_strided((experts, *t.shape[1:]), (expert_span, *t.stride()[1:]), dtype=t.dtype,
                               device="meta")


def record_launches(scheme: bench.Scheme, shape: bench.Shape, m: int, overrides: dict | None = None) -> list:
    """[(kernel, args, kwargs, config)] of the layer's two GEMM launches for ``m`` tokens on an
    sm_90 GPU (paired PTX dequantisation, dependent launch), weights on the meta device; the
    tile configs are the layer's (tuned for DEVICE_NAME, or the defaults) with ``overrides``."""
    from moe_registry_kernels import quant_ref, tile_config, triton_moe, triton_ops

    from moe_registry.core.keys import parse_quant_key
    from moe_registry.formats.weights import ProjectionWeights

    wkey, akey = parse_quant_key(scheme.weight), parse_quant_key(scheme.activation)
    one = quant_ref.make_random_expert_weights(wkey, akey, num_experts=1, hidden=shape.hidden,
                                               intermediate=shape.intermediate, dtype=torch.bfloat16)
    kscheme = triton_moe.scheme_from_keys(scheme.weight, scheme.activation)
    e, top_k = shape.experts, shape.top_k

    def projection(p: ProjectionWeights) -> list:
        tensors = [_meta(t, e) for t in triton_moe._kernel_tensors(p, kscheme)]
        scale2 = None if p.scale2 is None else torch.empty(e, p.scale2.reshape(1, -1).shape[1], device="meta")
        return [*tensors, scale2]

    t13, t2 = projection(one.w13), projection(one.w2)
    # MX scales' code range from the random expert's (as TritonExperts reads it from the real ones)
    w13, w2 = triton_moe._projections(shape.hidden, *t13[:6], *t2[:6], t13[6], t2[6],
                                      triton_moe.mx_scale_codes(one, kscheme))
    launches: list = []
    with contextlib.ExitStack() as stack:
        # the tuned configs and sm_90's paths of DEVICE_NAME; the GEMM launches recorded, not run
        patches = [(tile_config, "_device_name", lambda device: DEVICE_NAME),
                   (tile_config, "_num_sms", lambda device: DEVICE_SMS),
                   (triton_moe, "_paired_halves", lambda device, dtype: True),
                   (triton_moe, "_hardware_fp8_cast", lambda device: True),
                   (triton_moe, "dp4a_in_ptx", lambda device: True)]
        patches += [(triton_moe, kernel, _Recorder(getattr(triton_moe, kernel), launches))
                    for kernel in ("_fused_moe_kernel", "_fused_moe_swap_kernel", "_decode_gemv_kernel")]
        # the decode GEMV's input quantisation launch: not a GEMM, not run (its outputs on the meta device)
        patches.append((triton_ops, "act_quant", lambda x, activation, quant, *, static_scale=None, **_:
                        triton_ops._fake_quant(x.shape[0], x.shape[1], quant, x, static_scale)))
        for module, name, value in patches:
            stack.enter_context(mock.patch.object(module, name, value))
        # one token's GEMMs may quantise their own input (16-bit A; GEMM2's scale from GEMM1's pieces)
        own = triton_moe._quantised_in_gemm(kscheme, m, top_k, w13, w2, None)
        config1, config2 = triton_moe._layer_configs(m, top_k, e, w13, w2, scheme.weight, scheme.activation, kscheme,
                                                     torch.device("meta"), split_gemm2=True,
                                                     tiles_read=(not own.gemv1, not own.gemv2))
        if overrides:
            config1 = tile_config._fit_config({**config1, **overrides}, kscheme, can_split=False)
            config2 = tile_config._fit_config({**config2, **overrides, "BLOCK_M": config1["BLOCK_M"]}, kscheme,
                                              can_split=True)
        pairs = m * top_k
        block_m = triton_moe.GEMV_BLOCK_M if own.gemv1 else config1["BLOCK_M"]  # the decode GEMV's blocks
        if m == 1:
            rows = triton_moe._Rows(expert_ids=torch.empty(top_k, dtype=torch.int32, device="meta"), num_valid=top_k,
                                    one_pair_blocks=True)
        else:  # alignment's buffers, sized as triton_ops.align sizes them
            padded, blocks = triton_ops.align_sizes(pairs, e, block_m)
            rows = triton_moe._Rows(torch.empty(padded, dtype=torch.int32, device="meta"),
                                    torch.empty(blocks, dtype=torch.int32, device="meta"),
                                    torch.empty(1, dtype=torch.int32, device="meta"), num_valid=pairs)
        static = kscheme.act_quant in triton_moe.STATIC_QUANTS
        a1, a1_scale = _activations(kscheme, config1, m, shape.hidden, own.gemm1)
        inter = torch.empty(pairs, w13.n // 2, dtype=torch.bfloat16, device="meta")
        weights = torch.empty(pairs, device="meta")
        # (a decode GEMV leaves no pieces and reads none)
        pieces = None if own.gemv1 or own.gemv2 else triton_moe._amax_pieces_shape(kscheme, m, top_k, config1, w13,
                                                                                    "silu")
        amax = torch.empty(pieces, device="meta") if pieces else None
        # a ZERO_SUMS GEMM2's input sums: GEMM1's per-tile pieces where it leaves them
        pieces2 = triton_moe._gemm1_sum_pieces(rows, pairs, config1, config2, w13, w2, kscheme, "silu",
                                               torch.device("meta"))
        triton_moe._gemm(a1, a1_scale, w13, kscheme, inter, rows, config1, compute_dtype=torch.bfloat16, top_k=top_k,
                         topk_weights=weights, fuse_act="silu", amax_pieces=amax, pdl=True,
                         input_scale=triton_moe._InputScale(rows=1, static=static, gemv=own.gemv1) if own.gemm1
                         else None,
                         row_sums=_row_sums(a1, config1, w13, kscheme, rows),
                         sums_out=pieces2.sums if pieces2 else None)
        a2, a2_scale = _activations(kscheme, config2, pairs, w2.k, own.gemm2)
        scale2 = None
        if own.gemv2:
            scale2 = triton_moe._InputScale(rows=pairs, pair_ids=torch.empty(pairs, dtype=torch.int32, device="meta"),
                                            static=static, gemv=True)
        elif own.gemm2 and (static or amax is not None):
            scale2 = triton_moe._InputScale(rows=pairs, pieces=amax, pair_ids=torch.empty(pairs, dtype=torch.int32,
                                                                                          device="meta"), static=static)
        elif own.gemm2:  # GEMM2's input quantised by its own launch after all
            a2, a2_scale = _activations(kscheme, config2, pairs, w2.k)
        split = 1 if own.gemv2 else config2["SPLIT_K"]
        out = (torch.empty(split, pairs, w2.n, device="meta") if split > 1
               else torch.empty(pairs, w2.n, dtype=torch.bfloat16, device="meta"))
        triton_moe._gemm(a2, a2_scale, w2, kscheme, out, rows, config2, compute_dtype=torch.bfloat16,
                         routed_weight="output", topk_weights=weights, pdl=True, input_scale=scale2,
                         row_sums=pieces2 or _row_sums(a2, config2, w2, kscheme, rows))
    return [(fn, args, kwargs, _launch_tile(fn, kwargs, cfg))
            for (fn, args, kwargs), cfg in zip(launches, (config1, config2), strict=True)]


def _launch_tile(fn, kwargs: dict, config: dict) -> dict:
    """The tile a launch runs: its tile config, or the decode GEMV's own (BLOCK_K: the columns of a
    K step), which reads no tile config."""
    if fn.__name__ != "_decode_gemv_kernel":
        return config
    return {"BLOCK_M": kwargs["BLOCK_M"], "BLOCK_N": kwargs["BLOCK_N"],
            "BLOCK_K": kwargs["STEP_WORDS"] * (8 if kwargs["PACKED"] else 4), "num_warps": kwargs["num_warps"]}


def _row_sums(a: torch.Tensor, config: dict, w, kscheme, rows):
    """The per-group input sums a ZERO_SUMS GEMM reads where GEMM1 left none, as
    triton_moe._input_row_sums gives them: none on one-pair blocks (the kernel sums its row),
    else a launch of triton_ops.row_group_sums's output (meta device)."""
    from moe_registry_kernels import triton_moe, triton_ops

    if not triton_moe._zero_sums(config, w):
        return None
    if rows.one_pair_blocks:
        return triton_moe._RowSums(None)
    return triton_moe._RowSums(triton_ops.row_sums_output(a, kscheme.weight_group))


def _activations(kscheme, config: dict, rows: int, k: int, own: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes or 16-bit activations, scales) a GEMM with tile ``config`` reads, on the meta device,
    shaped and typed as the layer's quantisation writes them: triton_ops' fake outputs (int8 codes
    as 16-bit floats where triton_moe._codes_dtype says so), fp8_act's for the dynamic fp8 modes;
    ``own``: the 16-bit input a GEMM quantises itself (and the static scale, if any)."""
    from moe_registry_kernels import triton_moe, triton_ops
    from moe_registry_kernels.fp8_act import FP8_DYNAMIC_MODES

    x = torch.empty(rows, k, dtype=torch.bfloat16, device="meta")
    quant = kscheme.act_quant
    if quant == "none":
        return x, None
    if own:
        return x, x.new_empty(1, dtype=torch.float32) if quant in triton_moe.STATIC_QUANTS else None
    if quant in FP8_DYNAMIC_MODES:  # per token [T, 1], per tensor [1]
        return (x.new_empty(rows, k, dtype=torch.float8_e4m3fn),
                x.new_empty((rows, 1) if quant == "fp8_token" else (1,), dtype=torch.float32))
    codes, scale = triton_ops._fake_quant(rows, k, quant, x, x.new_empty(1, dtype=torch.float32))
    codes_dtype = triton_moe._codes_dtype(kscheme, config, torch.bfloat16).get("out_dtype", codes.dtype)
    return codes.new_empty(codes.shape, dtype=codes_dtype), scale


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


def analyse(gemm: str, fn, config: dict, cubin: Path, input_quantised: str = "none") -> GemmSass:
    """Registers, spills and the main loop's instruction mix of a compiled kernel."""
    usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    spilled = sum(int(m.group(1)) for m in re.finditer(r"(?:STACK|LOCAL):(\d+)", usage))
    sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(INSTRUCTION.search(line).group(2) for line in main_loop(sass))
    return GemmSass(gemm, fn.__name__, {k: config[k] for k in sorted(config)}, int(regs.group(1)) if regs else -1,
                    spilled, sum(ops.values()), dict(ops), ops["LDGSTS"], ops["LDG"], input_quantised)


def kernel_sass(scheme: bench.Scheme, shape: bench.Shape, m: int, *, overrides: dict | None = None,
                arch: int = 90) -> list[GemmSass]:
    """GEMM1 and GEMM2 of the layer, compiled for sm_``arch`` and read."""
    with tempfile.TemporaryDirectory() as tmp:
        out = []
        for gemm, (fn, args, kwargs, cfg) in zip(("gemm1", "gemm2"), record_launches(scheme, shape, m, overrides),
                                                 strict=True):
            _, cubin = compile_launch(fn, args, kwargs, arch, Path(tmp))
            out.append(analyse(gemm, fn, cfg, cubin, kwargs.get("A_SCALE_IN", "none")))
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", required=True, help="a scheme spec name that lists triton-fused-moe")
    parser.add_argument("--shape", default="qwen3", choices=sorted(bench.SHAPES))
    parser.add_argument("--m", type=int, default=8, help="tokens (default 8)")
    parser.add_argument("--config", help="tile config keys (JSON) over the tuned or default ones, both GEMMs")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
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
    results = kernel_sass(schemes[args.scheme], bench.SHAPES[args.shape], args.m, overrides=overrides, arch=args.arch)
    if args.json:
        print(json.dumps([{**dataclasses.asdict(r), "instructions_per_weight": r.instructions_per_weight}
                          for r in results], indent=1))
    else:
        print(f"{args.scheme} on {bench.SHAPES[args.shape].name}, M = {args.m}, sm_{args.arch}:")
        for r in results:
            print("  " + r.to_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
