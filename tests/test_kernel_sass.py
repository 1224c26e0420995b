"""tools/kernel_sass.py: the GEMM kernels compiled offline for Hopper (sm_90) from the layer's own
launches, read back from ptxas's output. Runs on a CPU machine (Triton's wheel carries ptxas and
nvdisasm), in a process of its own: the tests run with TRITON_INTERPRET=1, under which the kernels
are interpreted functions that do not compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "kernel_sass.py"


def _run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("scheme", ["mxfp4", "modelopt-nvfp4"])
def test_fp4_scales_stream_with_the_codes(scheme):
    """With 128-row tiles a K step's FP4 group scales are one vector per row, which the pipeliner
    copies ahead (cp.async) like the codes: no global load is waited on inside the main loop. Without a
    register cap (``maxnreg`` 0; a tuned cap may spill a few bytes under another Triton than the GPU's),
    on the tuned decode tiles' 256-wide K steps (at 128, Triton 3.9's ptxas keeps NVFP4's GEMM2 uncapped
    at 128 registers and spills 16 bytes; Triton 3.6's, the GPU's, spills none)."""
    done = _run("--scheme", scheme, "--shape", "qwen3", "--m", "8", "--config",
                '{"BLOCK_N": 128, "BLOCK_K": 256, "maxnreg": 0}', "--json")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [r["gemm"] for r in results] == ["gemm1", "gemm2"]
    for r in results:
        assert r["kernel"] == "_fused_moe_kernel" and r["config"]["BLOCK_N"] == 128 and r["config"]["BLOCK_M"] == 16
        assert 0 < r["registers"] <= 255 and r["spill_bytes"] == 0
        assert r["loop_opcodes"].get("HMMA", 0) > 0  # 16-row tiles: mma.sync
        assert r["loop_async_copies"] >= 2 and r["loop_global_loads"] == 0, r
        assert r["loop_instructions"] == sum(r["loop_opcodes"].values())
        warps, tile = r["config"]["num_warps"], r["config"]["BLOCK_N"] * r["config"]["BLOCK_K"]
        assert r["instructions_per_weight"] == r["loop_instructions"] * warps / tile


def test_text_report_and_refusals():
    done = _run("--scheme", "gptq-w4a16", "--shape", "dsv2lite", "--m", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "gptq-w4a16 on DeepSeek-V2-Lite, M = 1, sm_90, NVIDIA H100 80GB HBM3's tiles:"
    assert lines[1].startswith("  gemm1 _fused_moe_kernel: ") and "registers" in lines[1] and "main loop" in lines[1]
    assert "warp instructions per weight" in lines[1]
    assert any(line.startswith("  gemm2 ") for line in lines)
    unknown = _run("--scheme", "no-such-scheme")
    assert unknown.returncode == 2 and "unknown scheme 'no-such-scheme'" in unknown.stderr
    interpreted = _run("--scheme", "mxfp4", interpret=True)
    assert interpreted.returncode == 2 and "TRITON_INTERPRET=1" in interpreted.stderr


def test_a_device_of_the_same_sms_compiles_its_own_tiles():
    """``--device``: the tiles of a GPU with the H100's SMs (its own table's entries first), as the layer would
    take them there; a device of other SMs is refused by name."""
    configs = Path(__file__).resolve().parents[1] / "kernels" / "configs"
    own = json.loads((configs / "NVIDIA_H200__uint4b8_scale_float16_group_128_static__unquantized.json").read_text())
    h100 = json.loads((configs / "NVIDIA_H100_80GB_HBM3__uint4b8_scale_float16_group_128_static__unquantized.json")
                      .read_text())
    gemm1 = "E8_top2_N28672_K4096"
    assert own[gemm1]["1"]["BLOCK_K"] != h100[gemm1]["1"]["BLOCK_K"]
    for device, table in (("NVIDIA H200", own), ("NVIDIA H100 80GB HBM3", h100)):
        done = _run("--scheme", "gptq-w4a16", "--shape", "mixtral", "--m", "1", "--device", device, "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)[0]["config"]["BLOCK_K"] == table[gemm1]["1"]["BLOCK_K"], device
    refused = _run("--scheme", "gptq-w4a16", "--device", "NVIDIA A100")
    assert refused.returncode == 2 and "invalid choice: 'NVIDIA A100'" in refused.stderr


def test_a_register_cap_reaches_the_compiled_kernels():
    """A tile config's ``maxnreg`` is a launch option of both GEMMs: ptxas keeps each under it (the
    int4 decode kernels take over 100 registers uncapped)."""
    uncapped = json.loads(_run("--scheme", "gptq-w4a16", "--shape", "qwen3", "--m", "8", "--json").stdout)
    done = _run("--scheme", "gptq-w4a16", "--shape", "qwen3", "--m", "8", "--config", '{"maxnreg": 80}', "--json")
    assert done.returncode == 0, done.stderr
    capped = json.loads(done.stdout)
    assert all(r["registers"] > 96 for r in uncapped)
    assert all(r["config"]["maxnreg"] == 80 and r["registers"] <= 80 for r in capped)
    # what no longer fits in registers goes to ptxas's stack frame, which counts as spilled
    assert all(r["spill_bytes"] == 0 for r in uncapped) and any(r["spill_bytes"] > 0 for r in capped)


def test_one_token_gemms_are_compiled_as_the_layer_launches_them():
    """A token of a per-tensor fp8 scheme: the tool compiles the GEMMs that quantise their own input
    (GEMM1 from its rows, GEMM2 from GEMM1's pieces), their weights still copied ahead and only the
    token's row loaded in the step; past GEMM1's weight budget (Mixtral's shape) GEMM1 takes codes
    and GEMM2 still quantises from the pieces (dynamic fp8's own budget), where per-token int8
    runs the decode GEMV in both, which reads codes its own launch wrote."""
    done = _run("--scheme", "fp8-w8a8-dynamic", "--shape", "qwen3", "--m", "1", "--json")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [r["input_quantised"] for r in results] == ["rows", "pieces"]
    assert all(r["loop_async_copies"] >= 2 and r["loop_global_loads"] == 1 for r in results), results
    assert "quantises its input (scale: rows)" in _run("--scheme", "fp8-w8a8-dynamic", "--shape", "qwen3",
                                                       "--m", "1").stdout
    mixtral = json.loads(_run("--scheme", "fp8-w8a8-dynamic", "--shape", "mixtral", "--m", "1", "--json").stdout)
    assert [r["input_quantised"] for r in mixtral] == ["none", "pieces"]
    int8 = json.loads(_run("--scheme", "quark-w8a8-int8", "--shape", "mixtral", "--m", "1", "--json").stdout)
    assert [(r["kernel"], r["input_quantised"]) for r in int8] == [("_decode_gemv_kernel", "none")] * 2


def test_the_decode_gemv_is_compiled_as_the_layer_launches_it():
    """W4A8 at Qwen3's M = 1 runs the decode GEMV: its own tile is reported (16 weight rows, 512
    columns a step), and its loop is dp4a on whole words, fewer than 10 instructions a dp4a (two
    dp4a a word of 8 weights: under 0.08 warp instructions a weight, where the tile kernels' loop
    was 0.136; Triton 3.6: 8.25); at M = 64 the tile kernels run."""
    results = json.loads(_run("--scheme", "compressed-tensors-w4a8-int", "--shape", "qwen3", "--m", "1",
                              "--json").stdout)
    for r in results:
        assert r["kernel"] == "_decode_gemv_kernel" and r["spill_bytes"] == 0, r
        assert r["config"] == {"BLOCK_K": 512, "BLOCK_M": 1, "BLOCK_N": 16, "num_warps": 4}
        dp4a = r["loop_opcodes"].get("IDP", 0)
        assert dp4a > 0 and "HMMA" not in r["loop_opcodes"]
        assert r["loop_instructions"] < 10 * dp4a, r["loop_opcodes"]
    prefill = json.loads(_run("--scheme", "compressed-tensors-w4a8-int", "--shape", "qwen3", "--m", "64",
                              "--json").stdout)
    assert [r["kernel"] for r in prefill] == ["_fused_moe_kernel"] * 2


def test_the_k_loop_is_reported_where_a_zero_sums_tile_has_a_longer_loop_after_it():
    """AWQ on a ZERO_SUMS tile at Qwen3's shape: GEMM2's K (768) holds 6 groups, and the zero-point
    terms' loop after the K loop (no pipelining; shared-memory stores converting its operands) has
    more instructions than a K step. The report reads the pipelined K loop (cp.async copies ahead),
    not that one (none). In bfloat16 that loop dots the raw codes (RAW_CODES): no paired subtract a weight pair."""
    done = _run("--scheme", "awq-w4a16", "--shape", "qwen3", "--m", "8", "--config",
                '{"ZERO_SUMS": true, "BLOCK_K": 128, "BLOCK_N": 128, "maxnreg": 0}', "--json")
    assert done.returncode == 0, done.stderr
    for r in json.loads(done.stdout):
        assert r["config"].get("ZERO_SUMS") is True
        assert r["loop_async_copies"] >= 2 and r["loop_opcodes"]["HMMA"] > 0, r
        ops = r["loop_opcodes"]  # a subtract a weight pair would be two paired adds a dot
        assert 10 * ops.get("HADD2", 0) < ops["HMMA"] and "HMUL2" not in ops, ops


def test_shared_memory_and_programs_an_sm_follow_the_pipeline_and_the_registers():
    """Each GEMM's shared memory (Triton's metadata) grows with its pipeline's stages, and the programs an SM holds
    are the fewest that its registers, its shared memory and its warps allow (H100/H200 limits): GPTQ int4 at
    Mixtral's M = 8 on 128x256 tiles of 4 warps, 4 stages against 3."""
    runs = {stages: json.loads(_run("--scheme", "gptq-w4a16", "--shape", "mixtral", "--m", "8", "--config",
                                    json.dumps({"BLOCK_N": 128, "BLOCK_K": 256, "num_stages": stages, "maxnreg": 0,
                                                "SPLIT_K": 1}), "--json").stdout)
            for stages in (3, 4)}
    for deep, shallow in zip(runs[4], runs[3], strict=True):
        assert deep["shared_bytes"] > shallow["shared_bytes"] > 32 * 1024
    for r in runs[3] + runs[4]:
        by_registers = 65536 // (-(-r["registers"] * 32 // 256) * 256 * 4)
        by_shared = 233472 // (r["shared_bytes"] + 1024)
        assert r["programs_per_sm"] == min(by_registers, by_shared, 16) >= 1, r


def test_programs_an_sm_take_the_tightest_limit():
    """GemmSass.programs_per_sm on made-up kernels: registers (allocated 256 a warp), shared memory (1 KiB more a
    program, held back by the driver) or warps, whichever runs out first; an sm_86 SM holds less shared memory
    and fewer warps."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        import kernel_sass
    finally:
        sys.path.remove(str(TOOL.parent))

    def kernel(registers: int, shared_kib: int, warps: int = 4, arch: int = 90):
        return kernel_sass.GemmSass("gemm1", "k", {"num_warps": warps, "BLOCK_N": 64, "BLOCK_K": 64}, registers, 0, 1,
                                    {}, 0, 0, shared_bytes=shared_kib * 1024, arch=arch)

    assert kernel(168, 72).programs_per_sm == 3  # registers: 168 x 32 = 5376 a warp, 3.05 programs
    assert kernel(209, 96).programs_per_sm == 2  # both at 2
    assert kernel(140, 96).programs_per_sm == 2  # shared memory: 97 KiB a program
    assert kernel(32, 8).programs_per_sm == 16  # warps: 64 an SM
    assert kernel(32, 8, warps=8, arch=86).programs_per_sm == 6  # 48 warps; 100 KiB of shared memory: 11
    assert kernel(101, 0).programs_per_sm == 4  # 101 registers take 104 a thread: 3328 a warp
