"""Tune the fused MoE kernel's tile configs for this GPU and write them where the kernel reads them.

For each model shape × scheme × token count, time the whole layer (CUDA graphs, weight copies
rotated out of L2, as tools/bench.py does) under candidate configs: first GEMM1's tile for each
BLOCK_M (today's first) with GEMM2 at its default, then GEMM2's tile and split-K with GEMM1's best, then the
winning GEMM2 reading its input in halves where the scheme's tiles can (``INPUT_HALVES``, 4-bit
weights on 16-bit dots: GEMM1's epilogue stores them), then register caps on the winner
(``maxnreg``, GEMM1's then GEMM2's: fewer registers per thread let more programs share an SM;
``--registers-only`` tries just those on today's configs; ``--try`` just the given keys laid over
today's configs, then halves and caps on the winner). Before the
search, the configs this device's tables hold for the same GEMM shapes and token count under
other key pairs are timed as seeds (a scheme whose GEMMs run the same loop as another's, as
W4A8's 16-bit-dot tiles run GPTQ int4's, starts from that one's winner; ``--seeds-only`` tries
just those and the register caps on the winner). A candidate
counts only if its output is within the scheme spec's conformance tolerance of the reference, so
speed never buys accuracy. The winner is then timed again in alternation with the configs the
kernel picks today, and replaces them only if it is still faster by CONFIRM_MARGIN: a candidate
timed once, minutes apart from the incumbent, can win on the GPU's clocks alone. An entry's
candidates are compiled first by parallel worker processes (Triton's disk cache is shared; the
log says how many compiled), then timed in this one.

    python tools/tune.py                                  # every shape, key pair and M (resumes)
    python tools/tune.py --shapes qwen3 --schemes awq-w4a16 --m 1 8 64
    python tools/tune.py --dry-run                        # tiny shapes through the interpreter
    python tools/tune.py --redo --registers-only --m 1 8 64   # register caps on today's configs
    python tools/tune.py --redo --seeds-only --m 1 8 64       # other key pairs' configs, then caps
    python tools/tune.py --redo --shapes mixtral --m 8 --try '{"ZERO_SUMS": true, "num_stages": 3}' --verbose

The schemes are the scheme specs that list the Triton kernel, bound as tools/bench.py binds
them (``--help`` lists them); schemes with the same keys share a config file, tuned once to the
strictest of their tolerances. Results go to
kernels/configs/<device>__<weight key>__<activation key>.json (the canonical keys: the file the
kernel reads; ``--out`` to put them elsewhere), one entry per GEMM shape and token count,
rewritten in one step after every entry: an interrupted run keeps every finished entry and picks
up where it stopped (``--resume``, the default; ``--redo`` to tune entries again). Within an entry,
each candidate's measurement is kept as it is taken (``<config file>.partial`` beside the table,
removed when the entry is written), so a search cut off by ``--budget-s`` or killed by a time
limit goes on from its last measurement: one prefill entry of Mixtral's shape takes longer than
a GPU lent for 10 minutes a call.

On a machine with several GPUs of one kind, ``--gpus N`` runs one tuner per GPU, each on every N-th entry
(``--share I/N``): the entries are independent, and the tables and ``.partial`` files are read again and written
under a lock for each entry, so the tuners fill the same tables.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import bench  # noqa: E402  (tools/bench.py: shapes, schemes, weights, timing)
import torch  # noqa: E402

from moe_registry.core.keys import parse_quant_key  # noqa: E402
from moe_registry.layer.experts import ExpertsConfig  # noqa: E402


@dataclass(frozen=True)
class Target:
    shape: str
    scheme: str
    m: int


def block_ms(m: int, shape: bench.Shape) -> list[int]:
    """BLOCK_M worth trying: about the rows one expert sees, and its neighbours. Routing is random,
    so many experts get more than the mean: past a mean of 8 rows a 16-row block would read some
    experts' weights twice, and 32 is worth trying. 256 is for the swapped kernel only."""
    rows = math.ceil(m * shape.top_k / shape.experts)
    if rows <= 8:
        return [16]
    if rows <= 24:
        return [16, 32]
    if rows <= 48:
        return [32, 64]
    if rows <= 192:
        return [32, 64, 128]
    return [64, 128, 256]


def tile_candidates(bm: int, narrow: bool, limit: int | None = None, swap: bool = False,
                    group_dots: int = 0, zero_sums: bool = False) -> list[dict]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages[, SWAP_AB][, maxnreg]) worth trying at one BLOCK_M
    (the first ``limit``); ``swap``: also the swapped-operand kernel (schemes it runs);
    ``group_dots``: the scheme's group_dot_width, and decode tiles spanning several such groups
    are tried with one dot per group too (GROUP_DOTS); ``zero_sums``: zero-point schemes
    (api.takes_zero_sums), whose decode tiles are tried on the factored dot too (ZERO_SUMS)."""
    bks = (128, 256) if narrow else (64, 128)
    if bm <= 32:  # decode: streaming weights; narrow tiles and deep pipelines
        tiles = [*itertools.product((32, 64, 128), bks, (4,), (3, 4), (False,)),
                 (128, bks[0], 8, 4, False), (256, bks[0], 8, 3, False)]
        if narrow:  # a packed tile is small: deeper pipelines and longer K keep more bytes in flight
            tiles += [(64, 256, 4, 5, False), (128, 256, 4, 5, False), (64, 512, 4, 3, False),
                      (128, 512, 4, 3, False), (64, 512, 4, 4, False)]
            # an H200 streams more bytes than an H100 from the same SMs and wants more of them in flight:
            # its int4 winners at Mixtral's M = 1 were the deepest pipelines above (K 512, or 5 stages)
            tiles += [(32, 512, 4, 4, False), (64, 256, 4, 6, False), (128, 512, 4, 4, False)]
            # 128 columns a warp group spread the per-step activation split over twice the weights
            # of 64 (fewer instructions per weight), but take ~145 registers a thread (3 programs
            # an SM): capped, they keep 5 (H100, GPTQ int4 at M = 8: none won on the Qwen3 or
            # DeepSeek shapes; the uncapped 128-column tiles did on Qwen3's)
            tiles += [(128, 128, 4, 3, False, WIDE_TILE_CAP), (128, 128, 4, 4, False, WIDE_TILE_CAP),
                      (128, 256, 4, 4, False, WIDE_TILE_CAP)]
            # K 256 tiles under 128 registers in 48 KiB of shared memory: four programs an SM where
            # the uncapped ones hold two or three (sm_90 SASS, GPTQ int4 on Mixtral's M = 8 shape on
            # ZERO_SUMS: 128 registers, 8-40 B spilled), which the winner's register caps never reach
            tiles += [(128, 256, 4, 3, False, 128), (64, 256, 4, 4, False, 128)]
        if swap:  # weights are the dot's M side there: 64 or 128 rows per warp group
            tiles += [*itertools.product((64, 128), bks, (4,), (3, 4), (True,)), (128, bks[0], 8, 4, True)]
            if not narrow:  # byte-wide codes stream as the decode tiles above do, K 256 a step (fp8 dots: 8 wgmma)
                tiles += [(64, 256, 4, 4, True), (128, 256, 4, 3, True)]
    elif bm > 128:  # only the swapped kernel takes 256 token rows (its dot's wide side)
        tiles = [(128, 64, 8, 3, True), (128, 128, 8, 3, True)] if swap else []
    else:  # prefill: matrix-unit bound
        tiles = [(128, 64, 4, 3, False), (128, 64, 4, 4, False), (128, 64, 8, 4, False), (128, 128, 4, 3, False),
                 (128, 128, 8, 3, False), (256, 64, 8, 3, False), (256, 64, 8, 4, False), (256, 128, 8, 3, False)]
        if swap:  # weights dequantised straight into the matrix unit's register operand
            tiles += [(64, 64, 4, 4, True), (128, 64, 4, 3, True), (128, 64, 8, 3, True), (128, 128, 8, 3, True)]
    out = []
    for bn, bk, warps, stages, swapped, *cap in tiles:
        if bm * bk + bk * bn > 256 * 256 + 128 * 256:  # operand tiles past shared memory at 3+ stages
            continue
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1 if bm <= 32 else 8,
                    "num_warps": warps, "num_stages": stages, "SPLIT_K": 1, "SWAP_AB": swapped}
                   | ({"maxnreg": cap[0]} if cap else {}))
    if bm <= 32 and group_dots:  # one dot per group, each group's scale on its result
        out += [{**c, "GROUP_DOTS": True} for c in out if not c["SWAP_AB"] and c["BLOCK_K"] > group_dots]
    if bm <= 32 and zero_sums:  # zero points on the factored dot (the fit keeps K tiles in one group)
        out += [{**c, "ZERO_SUMS": True} for c in out if not c["SWAP_AB"]]
    return out[:limit]


def distinct_tiles(tiles: list[dict], variant) -> list[dict]:
    """The candidates that stay distinct once the layer fits them to the scheme (W4A8's BLOCK_K is
    capped at its group without GROUP_DOTS, say): the first of each kind, so none is timed twice."""
    from moe_registry_kernels.triton.api import fit_config

    seen, out = set(), []
    for tile in tiles:
        fitted = json.dumps(fit_config(tile, variant, can_split=True), sort_keys=True)
        if fitted not in seen:
            seen.add(fitted)
            out.append(tile)
    return out


def scheme_tiles(bm: int, narrow: bool, variant, limit: int | None = None) -> list[dict]:
    """tile_candidates for a scheme's kernel (the swapped one and per-group dots where it takes them
    at this BLOCK_M), each tile its layer runs once."""
    from moe_registry_kernels.triton.api import group_dot_width, swappable, takes_zero_sums

    zero_sums = takes_zero_sums(variant)  # (zero-point weights take per-group dots with ZERO_SUMS)
    return distinct_tiles(tile_candidates(bm, narrow, limit, swappable(variant),
                                          group_dot_width(variant, bm, zero_sums), zero_sums), variant)


SPLITS = (1, 2, 4, 8)
# register caps worth trying (maxnreg): at 128 threads a program under 168, 128, 96, 80 or 64 registers
# a thread lets 3, 4, 5, 6 or 8 programs share an SM's 64K registers (ptxas spills past that). 168:
# for tiles a few registers past it, as AWQ's ZERO_SUMS GEMM1 at Mixtral's M = 8 (187 registers, two
# programs an SM; 168 without a spill, sm_90 SASS) beside GPTQ int4's same tile (167)
REGISTER_CAPS = (168, 128, 96, 80, 64)
WIDE_TILE_CAP = 96  # wide decode tiles (BLOCK_N 128, 4 warps) under this cap: 5 programs an SM, few spills
# a search winner must still beat today's configs by this much when both are timed side by side
CONFIRM_MARGIN = 0.02
CONFIRM_ROUNDS = 3


# ---------------------------------------------------------------------------------------------
# the layer under a config


class Layer:
    """One shape × scheme: weight copies enough to rotate out of L2, inputs per M, the reference."""

    def __init__(self, shape: bench.Shape, scheme: bench.Scheme, device: torch.device, dry: bool) -> None:
        from moe_registry_kernels.triton.api import TritonExperts

        self.wkey, self.akey = parse_quant_key(scheme.weight), parse_quant_key(scheme.activation)
        self.shape, self.scheme, self.device, self.dry = shape, scheme, device, dry
        self.dtype = torch.float16 if dry else torch.bfloat16
        base = bench.make_weights(shape, self.wkey, self.akey, self.dtype, device, seed=0)
        self.base = base
        self.kernels = [TritonExperts(base, ExpertsConfig())]
        self.weight_bytes = sum(
            t.numel() * t.element_size() for p in (base.w13, base.w2)
            for t in (p.weight, p.scale, p.zero) if t is not None)

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return bench.cell_inputs(self.shape, m, self.dtype, self.device)

    def copies_for(self, m: int) -> list:
        """Kernels over enough weight copies that the experts one call hits are out of L2 next time."""
        from moe_registry_kernels.triton.api import TritonExperts

        if self.dry:
            return self.kernels[:1]
        hit = bench.expected_experts_hit(m, self.shape.top_k, self.shape.experts) / self.shape.experts
        want = bench.weight_copies(self.weight_bytes * hit, self.weight_bytes)
        while len(self.kernels) < want:
            weights = bench.make_weights(self.shape, self.wkey, self.akey, self.dtype, self.device,
                                         seed=len(self.kernels))
            self.kernels.append(TritonExperts(weights, ExpertsConfig()))
        return self.kernels[:want]

    def reference(self, x, tw, ti) -> torch.Tensor:
        return bench.reference_output(self.base, ExpertsConfig(), x, tw, ti)

    def error(self, configs: tuple[dict | None, dict | None], x, tw, ti, ref: torch.Tensor) -> float:
        from moe_registry_kernels.triton.api import config_override

        with config_override(*configs):
            out = self.kernels[0].apply(x, tw, ti).float()
        return float((out - ref).norm() / ref.norm())

    def time(self, configs: tuple[dict | None, dict | None], m: int, x, tw, ti) -> float:
        """Seconds per layer call (CUDA graph of one call per weight copy; CPU: plain calls)."""
        from moe_registry_kernels.triton.api import config_override

        kernels = self.copies_for(m)
        step = bench._calls(kernels, x, tw, ti)
        with config_override(*configs):
            if self.device.type != "cuda":
                return bench._median_time(step, 0.0, self.device) / len(kernels)
            graph = bench.capture_graph(step)
        return bench._median_time(graph.replay, 0.02, self.device, warmup_seconds=0.02) / len(kernels)


# ---------------------------------------------------------------------------------------------
# compiling ahead, in parallel


class CandidateFailed(Exception):
    """A candidate that did not compile or run; the message is one line."""


@contextlib.contextmanager
def compiler_output_held() -> Iterator[None]:
    """While a candidate compiles and runs, what is written to file descriptors 1 and 2 goes to
    temporary files: replayed if the candidate runs, and if it fails, summed up in the one line of
    the CandidateFailed raised instead (a compiler pass that fails prints its whole IR to fd 2, and
    Triton prints a failed ptxas run with its whole PTX to fd 1: thousands of lines, which would
    bury the tuner's own progress)."""
    held_text: dict[int, str] = {}
    failure: Exception | None = None
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        held = {1: out_file, 2: err_file}
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {fd: os.dup(fd) for fd in held}
        for fd, file in held.items():
            os.dup2(file.fileno(), fd)
        try:
            yield
        except Exception as exc:  # noqa: BLE001 (whatever failed, the candidate is refused)
            failure = exc
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        for fd, file in held.items():
            file.seek(0)
            held_text[fd] = file.read().decode(errors="replace")
    if failure is None:
        sys.stdout.write(held_text[1])
        sys.stderr.write(held_text[2])
        return
    # the first diagnostic (a compiler's "error:", ptxas's "fatal"), beyond what the exception says
    errors = [line.strip() for line in (held_text[2] + held_text[1]).splitlines()
              if "error:" in line.lower() or "fatal" in line.lower()]
    said = str(failure).strip().splitlines()
    why = ": ".join(part for part in (type(failure).__name__, said[0][:160] if said else "",
                                      errors[0][:160] if errors else "") if part)
    raise CandidateFailed(why) from failure


def _compile_worker(job: tuple[str, bench.Scheme, list[tuple[dict, dict]], bool]) -> int:
    """Run a small layer call under each config pair (the kernel does not specialise on the token
    count, so this compiles what the real calls will use)."""
    shape_name, scheme, pairs, dry = job
    shape = (bench.DRY_SHAPES if dry else bench.SHAPES)[shape_name]
    device = torch.device("cpu" if dry else "cuda")
    layer = Layer(_compile_shape(shape), scheme, device, dry)
    x, tw, ti = layer.inputs(4)
    done = 0
    for pair in pairs:
        try:
            with compiler_output_held():
                layer.error(pair, x, tw, ti, torch.ones(1, device=device))
            done += 1
        except CandidateFailed:  # refused when it is timed
            pass
    return done


def _compile_shape(shape: bench.Shape) -> bench.Shape:
    """The layer a compile worker builds: as few experts as top-k allows (the GEMM kernel's compiled
    form depends on N, K, strides and top-k, not on the number of experts)."""
    return bench.Shape(shape.name, max(shape.top_k, 2), shape.top_k, shape.hidden, shape.intermediate)


# GPU memory a compile worker holds per byte of its layer's float32 weights, measured: 7.9 for MXFP4
# on Mixtral's shape (11.1 GiB; quantising on the GPU makes float32 temporaries of a projection)
WORKER_BYTES_PER_WEIGHT_BYTE = 9
WORKER_CONTEXT_BYTES = 1 << 30


def compile_workers(requested: int, shape: bench.Shape) -> int:
    """At most ``requested`` compile workers, as many as the GPU's free memory holds (15 workers
    on Mixtral's shape ran an H100 out of memory)."""
    small = _compile_shape(shape)
    weight_bytes = 4 * small.experts * 3 * small.intermediate * small.hidden
    free, _ = torch.cuda.mem_get_info()
    fits = int(0.9 * free) // (WORKER_BYTES_PER_WEIGHT_BYTE * weight_bytes + WORKER_CONTEXT_BYTES)
    return max(1, min(requested, fits))


def precompile(shape_name: str, scheme: bench.Scheme, pairs: list[tuple[dict, dict]], dry: bool,
               workers: int) -> int | None:
    """Compile ``pairs`` in parallel worker processes: how many compiled and ran (None: not
    compiled ahead, the search compiles each as it comes)."""
    if workers <= 1 or dry or len(pairs) < 4:
        return None
    workers = compile_workers(workers, bench.SHAPES[shape_name])
    chunks = [pairs[i::workers] for i in range(workers)]
    ctx = __import__("multiprocessing").get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        return sum(pool.map(_compile_worker, [(shape_name, scheme, c, dry) for c in chunks if c]))


# ---------------------------------------------------------------------------------------------
# measurements an entry's search has taken, kept across runs


class SearchCutOff(Exception):
    """The budget ran out in the middle of an entry's search; its measurements are kept."""


def pair_key(c1: dict, c2: dict) -> str:
    return json.dumps([c1, c2], sort_keys=True)


class Measurements:
    """The candidates one entry's search has timed (seconds; None: refused), written to ``path``
    after each, so a search cut off goes on where it stopped. One file per config table, one record
    per entry (its two GEMM shapes and M); a file written on another device, or unreadable, is not
    used (a warning says so). Only search times are kept: a winner is still timed side by side
    against today's configs before it replaces them (``confirm``)."""

    def __init__(self, path: Path, device: str, entry: str) -> None:
        self.path, self.device, self.entry = path, device, entry
        self.taken: dict[str, float | None] = dict(self._read(warn=True)["entries"].get(entry, {}))

    def _read(self, warn: bool = False) -> dict:
        """The file's record of every entry (read again before each write: other entries' records
        change between this entry's measurements)."""
        empty: dict = {"device": self.device, "entries": {}}
        if not self.path.is_file():
            return empty
        try:
            data = json.loads(self.path.read_text())
            usable = data["device"] == self.device and isinstance(data["entries"], dict)
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            why = f"not a record of measurements ({type(exc).__name__})"
            usable = False
        else:
            why = f"measured on {data['device']!r}, not {self.device!r}"
        if not usable:
            if warn:
                print(f"tune.py: {self.path}: {why}; starting over", file=sys.stderr)
            return empty
        return data

    def __len__(self) -> int:
        return len(self.taken)

    def known(self, c1: dict, c2: dict) -> bool:
        return pair_key(c1, c2) in self.taken

    def seconds(self, c1: dict, c2: dict) -> float:
        """The kept measurement (math.inf: refused)."""
        t = self.taken[pair_key(c1, c2)]
        return math.inf if t is None else t

    def add(self, c1: dict, c2: dict, seconds: float) -> None:
        self.taken[pair_key(c1, c2)] = None if math.isinf(seconds) else seconds
        with locked(self.path.parent):  # another tuner (--gpus) may be writing another entry's record
            data = self._read()
            data["entries"][self.entry] = self.taken
            write_atomically(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")

    def forget(self) -> None:
        """The entry is written: drop its record (and the file, once it holds none)."""
        with locked(self.path.parent):
            data = self._read()
            data["entries"].pop(self.entry, None)
            if data["entries"]:
                write_atomically(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n")
            else:
                self.path.unlink(missing_ok=True)


def partial_path(config_path: Path) -> Path:
    """Where the measurements of the entries of ``config_path`` that are not finished are kept."""
    return config_path.with_name(config_path.name + ".partial")


# ---------------------------------------------------------------------------------------------
# search


def _progress(done: int, total: int, label: str, started: float) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    elapsed = time.monotonic() - started
    eta = elapsed / done * (total - done) if done else 0.0
    line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<36} {elapsed:5.0f}s eta {eta:4.0f}s"
    end = "\r" if sys.stderr.isatty() else "\n"
    print(line, end=end, file=sys.stderr, flush=True)


def _entry_progress(done: int, total: int, label: str, started: float) -> Callable[[int], None]:
    """The progress line of one entry's search: how many candidates it has measured."""
    return lambda measured: _progress(done, total, f"{label}: {measured} measured", started)


CUT_OFF_REFUSAL = "refused before the search was cut off"


def refusals(log: list[str]) -> dict[str, int]:
    """An entry's refused candidates by why, from its search log: over the scheme's tolerance, or not built or run
    (a register cap ptxas rejects, a compiler error, out of resources), or refused by a run cut off before."""
    lines = [line.lstrip() for line in log]
    return {"over tolerance": sum(line.startswith("reject") for line in lines),
            "not built or run": sum(line.startswith("skip") and not line.endswith(CUT_OFF_REFUSAL) for line in lines),
            "in an earlier run": sum(line.startswith("skip") and line.endswith(CUT_OFF_REFUSAL) for line in lines)}


def register_variants(config: dict) -> list[dict]:
    """``config`` under each register cap it does not already have (and uncapped, if it is capped)."""
    caps = [cap for cap in (None, *REGISTER_CAPS) if cap != config.get("maxnreg")]  # None: no cap
    return [{k: v for k, v in config.items() if k != "maxnreg"} | ({"maxnreg": cap} if cap else {}) for cap in caps]


def tune_target(layer: Layer, m: int, tolerance: float, log: list[str], *, limit: int | None = None,
                splits: tuple[int, ...] = SPLITS, registers_only: bool = False, seeds_only: bool = False,
                seeds: list[tuple[dict, dict]] | None = None, taken: Measurements | None = None,
                deadline: float = math.inf,
                progress: Callable[[int], None] | None = None) -> tuple[dict, dict, float, float]:
    """Best (GEMM1 config, GEMM2 config) for one M, its time, and the time of the configs the
    kernel picks today (defaults, or an earlier tuning). The seeds (``seeds``, else
    :func:`seed_pairs`) are timed first. ``registers_only``: no seeds and no tile search, only
    register caps on today's configs; ``seeds_only``: the seeds, then register caps on the
    winner. ``taken``: measurements kept from a search cut off before (not taken again) and
    where new ones go; past ``deadline`` (time.monotonic()) a candidate not yet measured raises
    SearchCutOff. ``progress``: told the count of candidates measured."""
    from moe_registry_kernels.triton import api
    from moe_registry_kernels.triton.api import fit_config, fit_pair, variant_from_keys

    shape = layer.shape
    variant = variant_from_keys(str(layer.wkey), str(layer.akey))
    x, tw, ti = layer.inputs(m)
    ref = layer.reference(x, tw, ti)
    narrow = layer.wkey.quantized and layer.wkey.dtype.bits <= 8
    i = shape.intermediate
    # the configs the kernel picks today (an earlier tuning, or the defaults): kept unless beaten
    d1, d2 = todays_configs(shape, (str(layer.wkey), str(layer.akey)), m, api.device_name(layer.device),
                            api.num_sms(layer.device))
    base_t = layer.time((None, None), m, x, tw, ti)

    measured: list[float] = []  # this run's measurements

    def measure(c1: dict, c2: dict) -> float:
        if taken is not None and taken.known(c1, c2):
            t = taken.seconds(c1, c2)
            if math.isinf(t):
                log.append(f"  skip {c1} {c2}: {CUT_OFF_REFUSAL}")
            return t
        if time.monotonic() > deadline:
            raise SearchCutOff
        t = _measure_once(c1, c2)
        measured.append(t)
        if taken is not None:
            taken.add(c1, c2, t)
        if progress is not None:
            progress(len(taken) if taken is not None else len(measured))
        return t

    def _measure_once(c1: dict, c2: dict) -> float:
        try:
            with compiler_output_held():
                err = layer.error((c1, c2), x, tw, ti, ref)
        except CandidateFailed as exc:  # out of resources, a compiler error and the like: not a candidate
            log.append(f"  skip {c1} {c2}: {exc}")
            return math.inf
        if not err <= tolerance:
            log.append(f"  reject {c1} {c2}: relative error {err:.2e} > {tolerance:.0e}")
            return math.inf
        t = layer.time((c1, c2), m, x, tw, ti)
        log.append(f"  {t * 1e6:.1f} us {c1} {c2}")
        return t

    log.append(f"  {base_t * 1e6:.1f} us today's configs {d1} {d2}")
    best = (d1, d2, base_t)
    if seeds is None and not registers_only:
        seeds = seed_pairs(shape, (str(layer.wkey), str(layer.akey)), m, api.device_name(layer.device),
                           variant, (d1, d2))
    for c1, c2 in () if registers_only else seeds:
        t = measure(c1, c2)
        if t < best[2]:
            best = (c1, c2, t)
    # today's BLOCK_M first: where a budget cuts the search short, the region of today's winner was searched
    ordered = sorted(block_ms(m, shape), key=lambda bm: bm != d1["BLOCK_M"])
    for bm in () if registers_only or seeds_only else ordered:
        g2 = fit_config({**d2, "BLOCK_M": bm}, variant, can_split=True)
        best1, t1 = None, math.inf
        tiles = scheme_tiles(bm, narrow, variant, limit)
        for c1 in tiles:
            t = measure(c1, g2)
            if t < t1:
                best1, t1 = c1, t
        if best1 is None:
            continue
        best2, t2 = g2, t1
        for c2 in tiles:  # tiles at the default split, then splits
            cand = {**c2, "SPLIT_K": g2["SPLIT_K"]}
            t = measure(best1, cand)
            if t < t2:
                best2, t2 = cand, t
        for split in splits if bm <= 32 else ():
            if split == best2["SPLIT_K"] or i // split < 2 * best2["BLOCK_K"]:
                continue
            cand = {**best2, "SPLIT_K": split}
            t = measure(best1, cand)
            if t < t2:
                best2, t2 = cand, t
        if t2 < best[2]:
            best = (best1, best2, t2)
    halves = {**best[1], "INPUT_HALVES": True}  # the winner's GEMM2 reading its input in halves, where it can
    if not registers_only and fit_pair(best[0], halves, variant)[1].get("INPUT_HALVES"):
        t = measure(best[0], halves)
        if t < best[2]:
            best = (best[0], halves, t)
    for c1 in register_variants(best[0]):  # the winning tiles under register caps: GEMM1's, then GEMM2's
        t = measure(c1, best[1])
        if t < best[2]:
            best = (c1, best[1], t)
    for c2 in register_variants(best[1]):
        t = measure(best[0], c2)
        if t < best[2]:
            best = (best[0], c2, t)
    if best[:2] == (d1, d2):
        return d1, d2, base_t, base_t
    # the search timed each candidate once, minutes apart from today's configs: time the two again,
    # alternately, and keep today's unless the winner still beats them by CONFIRM_MARGIN
    base_t, best_t = confirm(layer, m, x, tw, ti, (None, None), best[:2])
    if best_t * (1 + CONFIRM_MARGIN) > base_t:
        log.append(f"  kept today's configs: {base_t * 1e6:.1f} us against {best_t * 1e6:.1f} us "
                   "when timed side by side")
        return d1, d2, base_t, base_t
    return best[0], best[1], best_t, base_t


def confirm(layer: Layer, m: int, x, tw, ti, first: tuple, second: tuple,
            rounds: int = CONFIRM_ROUNDS) -> tuple[float, float]:
    """Median times of two config pairs timed in alternation (``rounds`` each): both see the same
    clocks and the same state of the GPU."""
    times = alternated([lambda: layer.time(first, m, x, tw, ti), lambda: layer.time(second, m, x, tw, ti)], rounds)
    return statistics.median(times[0]), statistics.median(times[1])


def alternated(steps: list[Callable[[], float]], rounds: int) -> list[list[float]]:
    """Each step's measurements, the steps taken in turn ``rounds`` times (so every one sees the
    clocks and state of the GPU the others see): for the tuner's confirmation and A/B scripts."""
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for step, out in zip(steps, times, strict=True):
            out.append(step())
    return times


def all_pairs(shape: bench.Shape, scheme: bench.Scheme, ms: list[int]) -> list[tuple[dict, dict]]:
    """Every config pair tune_target may try (for compiling ahead)."""
    from moe_registry_kernels.triton.api import variant_from_keys

    wkey = parse_quant_key(scheme.weight)
    narrow = wkey.quantized and wkey.dtype.bits <= 8
    variant = variant_from_keys(*scheme.keys)
    pairs = []
    for bm in sorted({b for m in ms for b in block_ms(m, shape)}):
        tiles = scheme_tiles(bm, narrow, variant)
        if not tiles:
            continue
        pairs += [(c, {**tiles[0], "SPLIT_K": 1}) for c in tiles]
        pairs += [(tiles[0], {**c, "SPLIT_K": s}) for c in tiles for s in (SPLITS if bm <= 32 else (1,))]
    return pairs


def register_pairs(shape: bench.Shape, scheme: bench.Scheme, ms: list[int], device_name: str,
                   sms: int) -> list[tuple[dict, dict]]:
    """The config pairs a ``--registers-only`` run tries (for compiling ahead): today's configs
    for each M with one GEMM under each register cap."""
    pairs = []
    for m in ms:
        d1, d2 = todays_configs(shape, scheme.keys, m, device_name, sms)
        pairs += [(c1, d2) for c1 in register_variants(d1)] + [(d1, c2) for c2 in register_variants(d2)]
    return pairs


def seed_pairs(shape: bench.Shape, keys: tuple[str, str], m: int, device_name: str, variant,
               today: tuple[dict, dict]) -> list[tuple[dict, dict]]:
    """The (GEMM1, GEMM2) configs the device's other tables (kernels/configs, other key pairs) hold
    for this shape's two GEMMs at exactly ``m`` tokens, each pair and each half of it with today's
    other half, as tuned and without the seed's register caps, fitted to this scheme: distinct, and
    none today's own. A tile this scheme's kernel cannot run as tuned (the swapped kernel's) gives
    none. Schemes that take ZERO_SUMS (tile_config.takes_zero_sums) also try each on the factored dot
    (where the fit keeps it; there a tile of a fixed-zero scheme (GPTQ's) runs its own loop), and today's
    own pair on it first."""
    from moe_registry_kernels.triton.api import config_file, fit_pair, shape_key, takes_zero_sums

    own = config_file(*keys, device_name)  # in the directory the kernel reads
    h, i = shape.hidden, shape.intermediate
    gemms = (shape_key(shape.experts, shape.top_k, 2 * i, h), shape_key(shape.experts, shape.top_k, h, i))

    def fitted(c1: dict, c2: dict) -> tuple[dict, dict] | None:
        f1, f2 = fit_pair(c1, c2, variant)
        if any(c.get("SWAP_AB") and not f["SWAP_AB"] for c, f in ((c1, f1), (c2, f2))):
            return None
        return f1, f2

    seen = {json.dumps(fitted(*today), sort_keys=True)}
    out: list[tuple[dict, dict]] = []

    def keep(candidate: tuple[dict, dict] | None) -> None:
        key = json.dumps(candidate, sort_keys=True)
        if candidate is not None and key not in seen:
            seen.add(key)
            out.append(candidate)

    if takes_zero_sums(variant):
        keep(fitted({**today[0], "ZERO_SUMS": True}, {**today[1], "ZERO_SUMS": True}))
    for path in sorted(own.parent.glob(own.name.split("__")[0] + "__*.json")):
        if path.name == own.name:
            continue
        table = json.loads(path.read_text())
        pair = [table.get(g, {}).get(str(m)) for g in gemms]
        if None in pair:
            continue
        for c1, c2 in ((pair[0], pair[1]), (pair[0], today[1]), (today[0], pair[1])):
            # each also without the seed's register caps: a cap fits the kernel it was tuned on, and
            # this scheme's may need more registers (W4A8's epilogue: GPTQ int4's cap of 128 spilled)
            halves = [(c1, c2), (_uncapped(c1, pair[0]), _uncapped(c2, pair[1]))]
            if takes_zero_sums(variant):
                halves += [({**a, "ZERO_SUMS": True}, {**b, "ZERO_SUMS": True}) for a, b in halves]
            for a, b in halves:
                keep(fitted(a, b))
    return out


def tried_pairs(today: tuple[dict, dict], overlays: list[tuple[dict, dict]], variant) -> list[tuple[dict, dict]]:
    """The (GEMM1, GEMM2) configs of ``--try``: each overlay's keys laid over today's configs (a key
    given as null removed), fitted to the scheme as the layer fits them: distinct, and none today's own."""
    from moe_registry_kernels.triton.api import fit_pair

    def laid(config: dict, overlay: dict) -> dict:
        return {k: v for k, v in {**config, **overlay}.items() if v is not None}

    seen = {json.dumps(fit_pair(*today, variant), sort_keys=True)}
    out = []
    for over1, over2 in overlays:
        pair = fit_pair(laid(today[0], over1), laid(today[1], over2), variant)
        key = json.dumps(pair, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(pair)
    return out


def _overlay(text: str) -> tuple[dict, dict]:
    """A ``--try`` argument: config keys (JSON) for both GEMMs, or {"gemm1": {...}, "gemm2": {...}}."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"got {text!r}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict) or not value:
        raise argparse.ArgumentTypeError(f"got {text!r}; wanted a JSON object of config keys")
    if set(value) <= {"gemm1", "gemm2"}:
        if not all(isinstance(v, dict) for v in value.values()):
            raise argparse.ArgumentTypeError(f"got {text!r}; wanted gemm1 and gemm2 as JSON objects of config keys")
        return value.get("gemm1", {}), value.get("gemm2", {})
    return value, value


def _uncapped(config: dict, seed: dict) -> dict:
    """``config`` without its register cap where it is the seed's own."""
    return {k: v for k, v in config.items() if k != "maxnreg"} if config is seed else config


def todays_configs(shape: bench.Shape, keys: tuple[str, str], m: int, device_name: str,
                   sms: int) -> tuple[dict, dict]:
    """The (GEMM1, GEMM2) configs the kernel picks today for ``m`` tokens: tuned, or the defaults."""
    from moe_registry_kernels.triton.api import get_config

    h, i = shape.hidden, shape.intermediate
    return (get_config(m, shape.top_k, shape.experts, 2 * i, h, *keys, device_name, sms),
            get_config(m, shape.top_k, shape.experts, h, i, *keys, device_name, sms))


def tolerance_for_keys(schemes: dict[str, bench.Scheme], keys: tuple[str, str], dtype: str) -> float:
    """The tolerance a config for these keys must meet: the strictest of the scheme specs that
    bind them (a tuned config serves every one of them)."""
    return min(s.tolerance_for(dtype) for s in schemes.values() if s.keys == keys)


def runs_decode_gemv(shape: bench.Shape, scheme: bench.Scheme, m: int) -> bool:
    """Whether the layer's GEMMs at ``m`` tokens are the decode GEMV (the kernels' decode GEMV),
    which reads no tile config: its launches as tools/kernel_sass.py records them."""
    import kernel_sass

    quiet = logging.getLogger("moe_registry")  # not a word on the tile tables it looks up on the way
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        launches = kernel_sass.record_launches(scheme, shape, m)
    finally:
        quiet.setLevel(level)
    return any(fn.__name__ == "_decode_gemv_kernel" for fn, *_ in launches)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one step: a run killed mid-write leaves the old file whole."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on ``directory`` (flock on the folder itself: no lock file left behind) while a tuner
    reads and writes the tables in it: the tuners of ``--gpus`` share them."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_entry(path: Path, meta: dict, entries: dict[str, dict]) -> None:
    """Put ``entries`` ({GEMM shape key: config} for one token count, as ``{key: {m: config}}``) into the table at
    ``path`` as it is on disk now (read again under the lock: another tuner may have written other entries since
    this one read it), in one atomic write."""
    with locked(path.parent):
        table = json.loads(path.read_text()) if path.is_file() else {}
        table["meta"] = meta
        for key, by_m in entries.items():
            table.setdefault(key, {}).update(by_m)
        write_atomically(path, json.dumps(table, indent=1, sort_keys=True) + "\n")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; wanted a positive integer")
    return int(text)


def _share(text: str) -> tuple[int, int]:
    first, _, every = text.partition("/")
    if not (first.isdigit() and every.isdigit() and int(first) < int(every)):
        raise argparse.ArgumentTypeError(f"got {text!r}; wanted I/N with 0 <= I < N, e.g. 0/2")
    return int(first), int(every)


def run_shares(argv: list[str], gpus: int, dry: bool) -> int:
    """``--gpus N``: this tool again in N processes, the i-th on the i-th visible GPU with ``--share i/N``, at once
    (their output interleaves, each summary names its share); the worst exit code."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    devices = visible or [str(i) for i in range(torch.cuda.device_count())]
    if not dry and len(devices) < gpus:
        plural = "" if len(devices) == 1 else "s"
        print(f"tune.py: --gpus {gpus}, but this machine shows {len(devices)} CUDA GPU{plural}", file=sys.stderr)
        return 2
    procs = []
    for i in range(gpus):  # (a dry run needs no GPU: its tuners may outnumber them)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices[i] if i < len(devices) else "")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--gpus", "1", "--share", f"{i}/{gpus}"],
                                      env=env))
    return max(p.wait() for p in procs)


def main(argv: list[str] | None = None) -> int:
    schemes = bench.registry_schemes()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=bench.DEFAULT_SHAPES, choices=list(bench.SHAPES))
    parser.add_argument("--schemes", nargs="*", default=None, metavar="SCHEME",
                        help=f"scheme spec names (those listing {bench.KERNEL}; schemes with the same keys share "
                             "one config file: tuned once, to the strictest of their tolerances); default: one per "
                             "distinct key pair: " + ", ".join(bench.default_schemes(schemes))
                             + "; all: " + ", ".join(schemes))
    parser.add_argument("--m", nargs="*", type=int, default=None, help="token counts (default 1 8 64 512 4096)")
    parser.add_argument("--out", type=Path, default=None, help="config directory (default: the kernel's)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="skip entries that already have a config (the default)")
    again.add_argument("--redo", action="store_true", help="tune entries that already have a config")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--budget-s", type=float, default=math.inf,
                        help="stop after this many seconds, in the middle of an entry if need be (its "
                             "measurements so far are kept beside the table; run again to go on)")
    parser.add_argument("--registers-only", action="store_true",
                        help="no tile search: try register caps (maxnreg) on today's configs only")
    parser.add_argument("--seeds-only", action="store_true",
                        help="no tile search: try the configs other key pairs' tables hold for the entry, then "
                             "register caps on the winner")
    parser.add_argument("--try", dest="tries", nargs="+", type=_overlay, default=None, metavar="JSON",
                        help="no tile search: try these config keys laid over today's configs of both GEMMs "
                             '(\'{"num_stages": 3, "maxnreg": null}\': null removes a key; \'{"gemm2": {...}}\' '
                             "one GEMM), then halves and register caps on the winner")
    parser.add_argument("--verbose", action="store_true",
                        help="after each entry, every candidate's time (us), refusal and the side-by-side check")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, interpreter, 2 candidates")
    parser.add_argument("--gpus", type=_positive, default=1, metavar="N",
                        help="one tuner per GPU (the first N visible), each on every N-th entry; they fill the same "
                             "tables")
    parser.add_argument("--share", type=_share, default=(0, 1), metavar="I/N",
                        help="tune only every N-th entry, from the I-th (0-based; what --gpus gives its tuners)")
    args = parser.parse_args(argv)
    modes = [flag for flag, on in (("--registers-only", args.registers_only), ("--seeds-only", args.seeds_only),
                                    ("--try", args.tries)) if on]
    if len(modes) > 1:
        print(f"tune.py: {' and '.join(modes)} exclude each other", file=sys.stderr)
        return 2
    names = bench.default_schemes(schemes) if args.schemes is None else list(dict.fromkeys(args.schemes))
    bad_names = bench.check_names(names, list(schemes))
    if bad_names:
        print(f"tune.py: {bad_names}", file=sys.stderr)
        return 2
    # one run per key pair: the config file is the keys'
    first_of_keys: dict[tuple[str, str], str] = {}
    for n in names:
        first_of_keys.setdefault(schemes[n].keys, n)
    names = list(first_of_keys.values())

    if args.gpus > 1:
        return run_shares(sys.argv[1:] if argv is None else argv, args.gpus, args.dry_run)
    dry = args.dry_run or not torch.cuda.is_available()
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from moe_registry_kernels.triton import api

    device = torch.device("cpu" if dry else "cuda")
    out_dir = args.out or api.CONFIG_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if not dry else "dry-run"
    shapes = bench.DRY_SHAPES if dry else {k: bench.SHAPES[k] for k in args.shapes}
    ms = args.m or ([1, 8] if dry else [1, 8, 64, 512, 4096])
    dtype = "float16" if dry else "bfloat16"
    # the interpreter is slow: two tile candidates per BLOCK_M, splits 1 and 2
    search = {"limit": 2, "splits": (1, 2)} if dry else {}

    first, every = args.share
    targets = [Target(sn, sc, m) for sn in shapes for sc in names for m in ms][first::every]
    started, done = time.monotonic(), 0
    summary = []
    cut_off = False
    for (shape_name, name), group in itertools.groupby(targets, key=lambda t: (t.shape, t.scheme)):
        group = list(group)
        shape, scheme = shapes[shape_name], schemes[name]
        # named by the canonical keys: the file the kernel reads
        path = out_dir / api.config_file(scheme.weight, scheme.activation, device_name).name
        table = json.loads(path.read_text()) if path.is_file() else {}
        table["meta"] = {"device": device_name, "weight_key": scheme.weight, "activation_key": scheme.activation}
        key1 = api.shape_key(shape.experts, shape.top_k, 2 * shape.intermediate, shape.hidden)
        key2 = api.shape_key(shape.experts, shape.top_k, shape.hidden, shape.intermediate)
        todo = [t for t in group if args.redo or str(t.m) not in table.get(key1, {})
                or str(t.m) not in table.get(key2, {})]
        gemv = [t for t in todo if runs_decode_gemv(shape, scheme, t.m)]
        if gemv:  # every candidate would time the same GEMV
            print(f"\n{shape_name} {name} M={', '.join(str(t.m) for t in gemv)}: the decode GEMV runs both GEMMs "
                  f"(no tile config is read there): not tuned", file=sys.stderr)
            todo = [t for t in todo if t not in gemv]
            done += len(gemv)
        done += len(group) - len(todo)
        if not todo:
            continue
        if time.monotonic() - started > args.budget_s:
            break
        layer = None
        tolerance = tolerance_for_keys(schemes, scheme.keys, dtype)
        for target in todo:
            if time.monotonic() - started > args.budget_s:
                print(f"\nbudget of {args.budget_s:.0f}s spent: stopping; run again to resume", file=sys.stderr)
                break
            label = f"{shape_name} {name} M={target.m}"
            # what an earlier run cut off in the middle of this entry measured (not compiled or timed again)
            kept = Measurements(partial_path(path), device_name, f"{key1} {key2} M={target.m}")
            # each entry's candidates are compiled ahead on their own: a run cut off compiled none in vain
            _progress(done, len(targets), f"{label}: compiling", started)
            sms = api.num_sms(device)
            seeds = None  # read once here, for compiling ahead and for the search
            if args.registers_only:
                pairs = register_pairs(shape, scheme, [target.m], device_name, sms)
            else:
                today = todays_configs(shape, scheme.keys, target.m, device_name, sms)
                variant = api.variant_from_keys(*scheme.keys)
                if args.tries:
                    seeds = tried_pairs(today, args.tries, variant)
                else:
                    seeds = seed_pairs(shape, scheme.keys, target.m, device_name, variant, today)
                pairs = seeds + ([] if args.seeds_only or args.tries else all_pairs(shape, scheme, [target.m]))
            pairs = [pair for pair in pairs if not kept.known(*pair)]
            compile_started = time.monotonic()
            compiled = precompile(shape_name, scheme, pairs, dry, args.workers)
            if compiled is not None:
                print(f"\n{label}: {compiled} of {len(pairs)} candidates compiled ahead in "
                      f"{time.monotonic() - compile_started:.0f}s", file=sys.stderr)
            if layer is None:  # after the first compiling: the workers had the GPU's memory to themselves
                layer = Layer(shape, scheme, device, dry)
            _progress(done, len(targets), label, started)
            log: list[str] = []
            try:
                c1, c2, t, base_t = tune_target(layer, target.m, tolerance, log, registers_only=args.registers_only,
                                                seeds_only=args.seeds_only or bool(args.tries), seeds=seeds, taken=kept,
                                                deadline=started + args.budget_s,
                                                progress=_entry_progress(done, len(targets), label, started),
                                                **search)
            except SearchCutOff:
                print(f"\nbudget of {args.budget_s:.0f}s spent in the middle of {label}: its {len(kept)} "
                      f"measurements are kept in {kept.path}; run again to go on", file=sys.stderr)
                cut_off = True
                break
            # as the layer runs them (_fit_config): a table says what runs, not what a candidate asked
            c1, c2 = api.fit_pair(c1, c2, api.variant_from_keys(*scheme.keys))
            write_entry(path, table["meta"], {key1: {str(target.m): c1}, key2: {str(target.m): c2}})
            kept.forget()
            done += 1
            why = refusals(log)
            refused = sum(why.values())
            summary.append((shape_name, name, target.m, base_t * 1e6, t * 1e6, refused))
            # each entry's figures as it ends: a run cut off by a time limit keeps what it measured
            print(f"{label}: before {base_t * 1e6:.1f} us, tuned {t * 1e6:.1f} us ({base_t / t:.2f}x), "
                  f"{refused} refused" + "".join(f", {n} {reason}" for reason, n in why.items() if n), flush=True)
            if args.verbose:
                print("\n".join(log), flush=True)
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if cut_off:
            break
    _progress(done, len(targets), "done", started)
    print(file=sys.stderr)
    if every > 1:
        print(f"share {first}/{every} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}):")
    print(f"{'shape':<10}{'scheme':<26}{'M':>6}{'before us':>11}{'tuned us':>10}{'speed-up':>10}{'refused':>9}")
    for shape_name, name, m, base_us, us, refused in summary:
        print(f"{shape_name:<10}{name:<26}{m:>6}{base_us:>11.1f}{us:>10.1f}{base_us / us:>9.2f}x{refused:>9}")
    print(f"configs in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
