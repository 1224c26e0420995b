"""Can the fused GEMM's weight reads reach the copy roofline? A GPU microbenchmark that reads packed
4-bit expert weights [E, N, K/2] (bytes) the way the decode GEMM does, and nothing else: each
program sums BLOCK_N weight rows, BLOCK_K/2 bytes of each per step, K/2 bytes apart (``strided``,
the checkpoint's layout), or the same tiles stored one after another (``tiled``, as a layout
pre-arranged offline would hold them), pipelined as the GEMM's loads are. Against torch's copy
of the same bytes. If the strided reads run near the copy bandwidth, a GEMM that does not is held
by its loop, not by its memory access pattern.

    python tools/bench_weight_reads.py            # Qwen3-30B-A3B's GEMM1 (128 experts, 1536 x 2048)
    python tools/bench_weight_reads.py --experts 8 --n 28672 --k 4096   # Mixtral's

Session 19 on an H100 (Qwen3 GEMM1, 192 MB; this kernel and these tiles, run as a script before
they became this tool): copy 2.95 TB/s (read + write); strided 64-row tiles 2.67-2.76 TB/s, tiled
2.79-2.87 TB/s; strided 128-row tiles of 64-byte rows 2.02 TB/s.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench  # noqa: E402  (tools/bench.py: its timing)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@dataclass(frozen=True)
class ReadTile:
    block_n: int  # weight rows
    block_k2: int  # bytes of each row per step (BLOCK_K / 2)
    num_warps: int
    num_stages: int


# the decode tiles the tuner picks, and wider ones
TILES = (ReadTile(64, 64, 4, 4), ReadTile(64, 128, 4, 4), ReadTile(32, 128, 4, 3), ReadTile(128, 64, 4, 4),
         ReadTile(64, 256, 4, 3), ReadTile(64, 64, 4, 2))


@triton.jit
def _read_weights(w_ptr, out_ptr, K2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K2: tl.constexpr,
                  TILED: tl.constexpr):
    """out[pid] = the sum of the bytes of weight rows pid * BLOCK_N ..+BLOCK_N (all K2 of them)."""
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK_K2, BLOCK_N), tl.int32)
    for k in range(0, K2, BLOCK_K2):
        if TILED:  # tile (pid, k) is BLOCK_N x BLOCK_K2 contiguous bytes
            start = (pid * K2 + k) * BLOCK_N
            offs = start + tl.arange(0, BLOCK_N)[None, :] * BLOCK_K2 + tl.arange(0, BLOCK_K2)[:, None]
        else:
            offs = (pid * BLOCK_N + tl.arange(0, BLOCK_N))[None, :] * K2 + k + tl.arange(0, BLOCK_K2)[:, None]
        acc += tl.load(w_ptr + offs).to(tl.int32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_weights(w: torch.Tensor, k2: int, block_n: int, block_k2: int, tiled: bool, num_warps: int = 4,
                 num_stages: int = 3) -> torch.Tensor:
    """Per-program byte sums of ``w`` (flat uint8, rows of ``k2`` bytes) read in tiles."""
    rows = w.numel() // k2
    if rows % block_n or k2 % block_k2:
        raise ValueError(f"{rows} rows of {k2} bytes do not split into {block_n} x {block_k2} tiles")
    out = torch.empty(rows // block_n, dtype=torch.int32, device=w.device)
    _read_weights[(rows // block_n,)](w, out, k2, block_n, block_k2, tiled, num_warps=num_warps,
                                      num_stages=num_stages)
    return out


def _seconds(fn) -> float:
    """Median seconds per call, as tools/bench.py times (CUDA events, after a warm-up)."""
    return bench._median_time(fn, 0.2, torch.device("cuda"), warmup_seconds=0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--n", type=int, default=1536, help="weight rows per expert")
    parser.add_argument("--k", type=int, default=2048, help="input columns (two 4-bit codes a byte)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_weight_reads: needs a CUDA GPU", file=sys.stderr)
        return 2
    k2 = args.k // 2
    w = torch.randint(0, 255, (args.experts * args.n * k2,), dtype=torch.uint8, device="cuda")
    copy = torch.empty_like(w)
    t = _seconds(lambda: copy.copy_(w))
    print(f"{torch.cuda.get_device_name()}: {w.numel() / 1e6:.0f} MB of weights; torch copy "
          f"{2 * w.numel() / t / 1e12:.2f} TB/s (read + write)")
    print(f"{'BLOCK_N':>8}{'BLOCK_K/2':>10}{'warps':>6}{'stages':>7}{'strided TB/s':>14}{'tiled TB/s':>12}")
    for tile in TILES:
        rates = [w.numel() / _seconds(functools.partial(read_weights, w, k2, tile.block_n, tile.block_k2, tiled,
                                                        tile.num_warps, tile.num_stages)) / 1e12
                 for tiled in (False, True)]
        print(f"{tile.block_n:>8}{tile.block_k2:>10}{tile.num_warps:>6}{tile.num_stages:>7}{rates[0]:>14.2f}"
              f"{rates[1]:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
