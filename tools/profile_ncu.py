"""Hardware counters of the layer's kernels at benchmark cells (Nsight Compute): why a cell sits
where it does against the roofline -- memory-bound, issue-bound, or waiting.

tools/bench.py says how far a cell is from its roofline; this says why. For each shape x scheme
x M it runs one layer call under ``ncu`` (this script again, as the profiled child: the layer
built and warmed up as bench.py builds it, then one call between cudaProfilerStart and Stop,
plain launches, no CUDA graph) and reads back, per kernel:

- time, and DRAM throughput as % of its peak (a 4-bit decode GEMM near its roofline is near 100);
- the megabytes DRAM moved and L2's hit rate (the same tile beside a peer's: do both read their
  weights once?);
- issue slots busy (% of the schedulers' cycles that issued an instruction: near 100 is
  instruction-bound) and the tensor pipes' busy % (matrix-unit bound);
- achieved occupancy, registers a thread, and the three largest stall reasons (warp cycles
  stalled per issued instruction, by reason: long_scoreboard is waiting on global memory, wait
  and math_pipe_throttle on fixed-latency math, barrier on __syncthreads, ...).

    python tools/profile_ncu.py --shapes qwen3 --schemes gptq-w4a16 --m 8 64 --out DIR
    bash tools/gpu_run.sh profile --resume --shapes mixtral --schemes fp8-block128 --m 4096
    python tools/profile_ncu.py --show DIR/profile.jsonl --gemms   # the table again, no GPU
    bash tools/gpu_run.sh profile --bench /tmp/benchout --below 85 --shapes qwen3 --schemes mxfp4 --m 8 64
    bash tools/gpu_run.sh profile --peer marlin --shapes mixtral --schemes awq-w4a16 --m 8   # carry .peer and .whl

``--peer triton|marlin``: each cell's GEMMs beside the peer's own two (vLLM's Triton fused_moe_kernel or its CUDA
Marlin MoE, run by the side-by-side harness in .peer/ as tools/gpu_run.sh peer runs it), profiled the same way:
one launch each, the clocks left alone, so both sides' kernels are read at the clock the GPU runs them at, not
at the clock a long timed burst left it at (``triton gemm1``, ``marlin gemm2``, ... in the kernel column).

``--bench DIR --below PCT``: of the cells asked for, only those a tools/bench.py run in DIR
measured under PCT % of their roofline (the cells that miss a target).

Writes profile.jsonl to --out as it goes (one line per kernel per cell; a new file unless
``--resume``) and prints a table; ``--resume`` skips the cells already in it (a call cut off by
a time limit goes on). Needs a GPU whose counters ncu can read (Firecracker machines here; not
gVisor), with the clocks left as they are (``--clock-control none``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

# the sections read (each one's metrics come back as columns of ncu's raw page; sections, not
# metric names, so a metric an ncu version names differently is missing from the table, not an
# error that loses the run)
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "SchedulerStats", "WarpStateStats", "ComputeWorkloadAnalysis",
            "MemoryWorkloadAnalysis")
NCU_CANDIDATES = ("ncu", "/opt/nvidia/nsight-compute/2025.3.1/ncu")
PROGRESS = "profile.jsonl"
CHILD_FLAG = "--child"
# the side-by-side harness's scripts (in .peer/ at the repository root, git-ignored: tools/prepare_peer.sh) and the
# kernels of theirs to profile: each script's --ncu-case runs one warm layer (two launches), then GEMM1 and GEMM2
PEER_CASES = {"triton": ("vllm_peer_bench.py", "regex:fused_moe_kernel"),
              "marlin": ("marlin_peer_bench.py", "regex:Marlin")}
PEER_DIR = Path(__file__).resolve().parent.parent / ".peer"
WARMUP_CALLS = 3  # compiles the kernels and fills the allocator before the profiled call


@dataclass(frozen=True)
class KernelProfile:
    """One kernel launch of one cell, as the counters saw it (None: the metric was not there)."""
    shape: str
    scheme: str
    m: int
    kernel: str  # gemm1, gemm2, or the glue kernel's own name
    us: float | None
    dram_pct: float | None
    issue_pct: float | None
    tensor_pct: float | None
    occupancy_pct: float | None
    registers: int | None
    stalls: dict  # reason -> warp cycles stalled per issued instruction, largest first
    # L2's hit rate over its sectors, and the megabytes DRAM moved (read and written: its throughput times the
    # kernel's time; profiles written before these were read have None): two kernels of one tile whose DRAM bytes
    # differ read their weights differently
    l2_hit_pct: float | None = None
    dram_mb: float | None = None

    def top_stalls(self, count: int = 3) -> str:
        return " ".join(f"{reason} {value:.1f}" for reason, value in list(self.stalls.items())[:count])


# column patterns -> field; the first column matching each pattern is taken
COLUMNS = {
    "us": r"^gpu__time_duration\.sum$",
    "dram_pct": r"^(gpu__dram_throughput|dram__throughput)\.avg\.pct_of_peak_sustained_elapsed$",
    "issue_pct": r"^(sm__inst_issued|smsp__issue_active)\.avg\.pct_of_peak_sustained_active$",
    "occupancy_pct": r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$",
    "registers": r"^launch__registers_per_thread$",
    "l2_hit_pct": r"^lts__t_sector_hit_rate\.pct$",
    "dram_bytes_per_s": r"^dram__bytes\.sum\.per_second$",
}
TENSOR_PIPES = r"^sm__pipe_tensor\w*_cycles_active\.avg\.pct_of_peak_sustained_active$"
STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
# time units ncu may print a duration in, as microseconds
TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6}
# rate units ncu may print a throughput in, as bytes a second
RATE_UNITS = {"byte/second": 1.0, "Kbyte/second": 1e3, "Mbyte/second": 1e6, "Gbyte/second": 1e9, "Tbyte/second": 1e12}


def _number(text: str) -> float | None:
    """A raw-page value ('1,234.5', 'n/a', '') as a float, or None."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` output -> one dict per profiled kernel: its name, each metric's
    value (float or None) and the units row. Lines before the header (==PROF== notes) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    units = next(reader, [])
    kernels = []
    for row in reader:
        if len(row) != len(header):
            continue
        record = dict(zip(header, row, strict=True))
        metrics = {name: _number(value) for name, value in record.items()}
        name = record.get("Kernel Name") or record.get("Function Name") or record.get("Demangled Name") or ""
        kernels.append({"name": name, "metrics": metrics,
                        "units": dict(zip(header, units, strict=False))})
    return kernels


def _pick(metrics: dict, pattern: str) -> tuple[str, float] | None:
    for name, value in metrics.items():
        if re.search(pattern, name) and value is not None:
            return name, value
    return None


def kernel_profile(kernel: dict, shape: str, scheme: str, m: int, label: str) -> KernelProfile:
    """The table's fields from one kernel's raw metrics."""
    metrics, units = kernel["metrics"], kernel["units"]
    fields: dict = {}
    for field, pattern in COLUMNS.items():
        picked = _pick(metrics, pattern)
        fields[field] = None if picked is None else picked[1]
        if field == "us" and picked is not None:
            fields[field] = picked[1] * TIME_UNITS.get(units.get(picked[0], "nsecond"), 1e-3)
        if field == "dram_bytes_per_s" and picked is not None:
            fields[field] = picked[1] * RATE_UNITS.get(units.get(picked[0], "byte/second"), 1.0)
    tensor = [value for name, value in metrics.items() if re.search(TENSOR_PIPES, name) and value is not None]
    stalls = {STALL.match(name).group(1): value for name, value in metrics.items()
              if STALL.match(name) and value is not None and not name.endswith("_not_issued_per_issue_active.ratio")}
    stalls = dict(sorted(((reason, value) for reason, value in stalls.items() if reason != "selected"),
                         key=lambda item: -item[1]))
    registers = fields.pop("registers")
    rate = fields.pop("dram_bytes_per_s")
    fields["dram_mb"] = None if rate is None or fields["us"] is None else rate * fields["us"] * 1e-12
    return KernelProfile(shape, scheme, m, label, **fields, tensor_pct=max(tensor) if tensor else None,
                         registers=None if registers is None else int(registers), stalls=stalls)


def label_kernels(kernels: list[dict]) -> list[str]:
    """gemm1, gemm2 for the layer's GEMM launches in order; glue kernels keep their names."""
    labels, gemms = [], 0
    for kernel in kernels:
        if any(name in kernel["name"] for name in bench.gemm_kernels("cuda")):
            gemms += 1
            labels.append(f"gemm{gemms}")
        else:
            labels.append(kernel["name"].split("(")[0][:40])
    return labels


def find_ncu() -> str | None:
    for candidate in NCU_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def ncu_command(ncu: str, shape: str, scheme: str, m: int) -> list[str]:
    """ncu over this script's child for one cell: only the call between cudaProfilerStart/Stop."""
    sections = [arg for section in SECTIONS for arg in ("--section", section)]
    return [ncu, "--csv", "--page", "raw", "--print-units", "base", "--clock-control", "none",
            "--profile-from-start", "off", *sections,
            sys.executable, str(Path(__file__).resolve()), CHILD_FLAG, shape, scheme, str(m)]


def peer_scheme(scheme: str) -> str:
    """The peer's scheme of the same weights as ours (peer_record.SCHEME_PAIRS), or a one-line ValueError."""
    from peer_record import SCHEME_PAIRS

    if scheme not in SCHEME_PAIRS:
        raise ValueError(f"no peer scheme of the same weights as {scheme} (wanted one of {', '.join(SCHEME_PAIRS)})")
    return SCHEME_PAIRS[scheme]


def peer_command(ncu: str, peer: str, shape: str, scheme: str, m: int) -> list[str]:
    """ncu over the peer harness's one case of the cell (the same weights and M as our scheme): its GEMM1 and
    GEMM2 after the warm layer's two launches; a ValueError where the peer runs no scheme of the same weights."""
    case = f"{bench.SHAPES[shape].name.lower()},{peer_scheme(scheme)},{m}"
    script, kernels = PEER_CASES[peer]
    sections = [arg for section in SECTIONS for arg in ("--section", section)]
    return [ncu, "--csv", "--page", "raw", "--print-units", "base", "--clock-control", "none",
            "--launch-skip", "2", "--launch-count", "2", "-k", kernels, *sections, sys.executable,
            str(PEER_DIR / script), "--ncu-case", case]


def side(profile: KernelProfile) -> str:
    """Whose kernel a profile is: the peer's ("triton gemm1" -> "triton"), else "ours"."""
    return profile.kernel.split(" ")[0] if profile.kernel.split(" ")[0] in PEER_CASES else "ours"


def run_cell(shape_name: str, scheme_name: str, m: int, calls: int = WARMUP_CALLS) -> int:
    """The child: build the layer as bench.py does, warm it up, then one call for the profiler.
    Returns the number of layer calls made (CPU: no profiler range, a check that it runs)."""
    from moe_registry_kernels.triton.api import plain_launches

    dry = not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    shape = bench.DRY_SHAPES["tiny"] if dry else bench.SHAPES[shape_name]
    scheme = bench.registry_schemes()[scheme_name]
    wkey, akey = bench.parse_quant_key(scheme.weight), bench.parse_quant_key(scheme.activation)
    dtype = torch.float16 if dry else torch.bfloat16
    weights = bench.make_weights(shape, wkey, akey, dtype, device, seed=0)
    layer = bench.benchmarked_experts(dry)(weights, bench.ExpertsConfig())
    x, tw, ti = bench.cell_inputs(shape, m, dtype, device)
    with plain_launches():
        for _ in range(calls):
            layer.apply(x, tw, ti)
        if not dry:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
        layer.apply(x, tw, ti)
        if not dry:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
    return calls + 1


def profile_cell(ncu: str, shape: str, scheme: str, m: int, peer: str | None = None) -> list[KernelProfile]:
    """One cell under ncu, ours or (``peer``) the peer's two GEMMs: the kernels' profiles, or a one-line error
    (RuntimeError)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = ncu_command(ncu, shape, scheme, m) if peer is None else peer_command(ncu, peer, shape, scheme, m)
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    kernels = parse_raw_csv(done.stdout)
    whose = "" if peer is None else f"the {peer} peer's "
    if not kernels:
        tail = " | ".join(line for line in (done.stderr + done.stdout).splitlines()[-4:] if line.strip())
        raise RuntimeError(f"ncu profiled no kernel of {whose}{shape} {scheme} M={m} (exit {done.returncode}): "
                           f"{tail}")
    labels = label_kernels(kernels) if peer is None else [f"{peer} gemm{i + 1}" for i in range(len(kernels))]
    name = bench.SHAPES[shape].name
    return [kernel_profile(k, name, scheme, m, label) for k, label in zip(kernels, labels, strict=True)]


def load_profiles(path: Path) -> list[KernelProfile]:
    """A profile.jsonl written by this tool, back as profiles; a line that is not one is a
    one-line ValueError naming the file and line."""
    profiles = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            profiles.append(KernelProfile(**json.loads(line)))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{path}:{number}: not a kernel profile of this tool ({error})") from None
    return profiles


def print_table(profiles: list[KernelProfile]) -> None:
    print(f"{'shape':<18}{'scheme':<28}{'M':>5}  {'kernel':<12}{'us':>8}{'dram%':>7}{'dramMB':>8}{'L2hit%':>7}"
          f"{'issue%':>7}{'tensor%':>8}{'occ%':>6}{'regs':>5}  top stalls (cycles per issued instruction)")

    def show(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for p in profiles:
        print(f"{p.shape:<18}{p.scheme:<28}{p.m:>5}  {p.kernel[:12]:<12}{show(p.us, 1):>8}{show(p.dram_pct):>7}"
              f"{show(p.dram_mb, 1):>8}{show(p.l2_hit_pct):>7}{show(p.issue_pct):>7}{show(p.tensor_pct):>8}"
              f"{show(p.occupancy_pct):>6}{show(p.registers):>5}  {p.top_stalls()}")


def cells_below(asked: list[tuple[str, str, int]], rows: list[dict], below: float) -> list[tuple[str, str, int]]:
    """Of the (shape key, scheme, M) cells asked for, those whose bench row reads under ``below`` %
    of its roofline; a cell the run did not measure is kept (nothing says it meets the target)."""
    measured = {bench.cell(row): row["pct_roofline"] for row in rows}
    return [(shape, scheme, m) for shape, scheme, m in asked
            if measured.get((bench.SHAPES[shape].name, scheme, m), -1.0) < below]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD_FLAG]:
        run_cell(argv[1], argv[2], int(argv[3]))
        return 0
    schemes = bench.registry_schemes()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["qwen3"], choices=list(bench.SHAPES))
    parser.add_argument("--schemes", nargs="+", default=["gptq-w4a16"], metavar="SCHEME",
                        help="scheme spec names listing " + bench.KERNEL)
    parser.add_argument("--m", nargs="+", type=int, default=[8])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--resume", action="store_true", help="skip the cells already in --out's " + PROGRESS)
    parser.add_argument("--show", nargs="+", type=Path, metavar="JSONL",
                        help="print the table of profile files this tool wrote, and profile nothing")
    parser.add_argument("--gemms", action="store_true", help="with --show: the GEMM kernels only (both sides')")
    parser.add_argument("--bench", type=Path, metavar="DIR", help="a tools/bench.py --out directory, for --below")
    parser.add_argument("--below", type=float, metavar="PCT",
                        help="only the cells --bench measured under PCT %% of their roofline")
    parser.add_argument("--peer", choices=list(PEER_CASES),
                        help="also the peer's two GEMMs of each cell (the side-by-side harness in .peer/)")
    args = parser.parse_args(argv)
    if (args.bench is None) != (args.below is None):
        parser.error("--bench and --below go together")
    if args.show:
        try:
            shown = [p for path in args.show for p in load_profiles(path)]
        except (OSError, ValueError) as error:
            print(f"profile_ncu.py: {error}", file=sys.stderr)
            return 2
        print_table([p for p in shown if not args.gemms or p.kernel.split(" ")[-1].startswith("gemm")])
        return 0
    bad = bench.check_names(args.schemes, list(schemes))
    if bad:
        print(f"profile_ncu.py: {bad}", file=sys.stderr)
        return 2
    if args.peer is not None:
        script = PEER_DIR / PEER_CASES[args.peer][0]
        if not script.is_file():
            print(f"profile_ncu.py: --peer {args.peer}: no {script} (make .peer/ with tools/prepare_peer.sh and "
                  "carry it)", file=sys.stderr)
            return 2
        try:
            for scheme in args.schemes:
                peer_scheme(scheme)
        except ValueError as error:
            print(f"profile_ncu.py: --peer {args.peer}: {error}", file=sys.stderr)
            return 2
    cells = [(shape, scheme, m) for shape in args.shapes for scheme in args.schemes for m in args.m]
    if args.bench is not None:
        try:
            _, rows = bench.read_progress(args.bench)
        except ValueError as e:
            print(f"profile_ncu.py: --bench: {e}", file=sys.stderr)
            return 2
        if not rows:
            print(f"profile_ncu.py: --bench {args.bench}: no {bench.PROGRESS} or {bench.RESULT} with rows there",
                  file=sys.stderr)
            return 2
        asked, cells = len(cells), cells_below(cells, rows, args.below)
        print(f"{len(cells)} of {asked} cells under {args.below:g}% of roofline in {args.bench}", flush=True)
    ncu = find_ncu()
    if ncu is None or not torch.cuda.is_available():
        print("profile_ncu.py: needs a CUDA GPU and Nsight Compute (ncu) on the PATH", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    progress, profiles, failed = args.out / PROGRESS, [], 0
    try:
        earlier = load_profiles(progress) if args.resume and progress.exists() else []
    except ValueError as error:
        print(f"profile_ncu.py: {error}", file=sys.stderr)
        return 2
    done = {(p.shape, p.scheme, p.m, side(p)) for p in earlier}
    if not args.resume:  # a run starts its own file; only --resume adds to an earlier one
        progress.write_text("")
    for shape, scheme, m in cells:
        for peer in (None, args.peer) if args.peer else (None,):
            whose = f"{peer} peer's " if peer else ""
            if (bench.SHAPES[shape].name, scheme, m, peer or "ours") in done:
                print(f"{whose}{shape} {scheme} M={m}: in {progress} already", flush=True)
                continue
            try:
                cell = profile_cell(ncu, shape, scheme, m, peer)
            except RuntimeError as error:
                print(f"profile_ncu.py: {error}", file=sys.stderr)
                failed += 1
                continue
            with progress.open("a") as f:
                for p in cell:
                    f.write(json.dumps(asdict(p)) + "\n")
            profiles += cell
            print(f"{whose}{shape} {scheme} M={m}: {len(cell)} kernels profiled", flush=True)
    print_table(profiles)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
