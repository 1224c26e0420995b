"""``run``'s checks that need no torch: flags, files, and the config with the situation the flags make, so the
command line refuses them before importing torch (a second or more) and building the layer (which may compile its
kernel). Value ranges are checked earlier still, by the parser's types (``cli.main._count``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from moe_registry.checkpoint.tensor_index import layer_names, open_checkpoint
from moe_registry.core import guards
from moe_registry.core.errors import CheckpointError, ConfigError
from moe_registry.situation.config import ModelConfig, read_model_config
from moe_registry.situation.describe import Flags, check_kernel_names, situation_for_model
from moe_registry.situation.values import Situation
from moe_registry.spec.loader import Registry, load_registry

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def started_by_torchrun() -> bool:
    """Whether torchrun started this process (it sets every one of TORCHRUN_VARS)."""
    return all(os.environ.get(v) for v in TORCHRUN_VARS)


def check_run_flags(args: argparse.Namespace) -> None:
    """Refuse, before loading anything, the flags one process cannot honour and bad files."""
    check_one_process_flags(args)
    check_common_flags(args)


def check_one_process_flags(args: argparse.Namespace) -> None:
    """Outside torchrun, run is one process: no expert or data parallelism, no all2all."""
    for flag, value in (("--ep", args.ep), ("--dp", args.dp)):
        if value is not None and value > 1:
            how = ("that each call moe_registry.build(..., ep={v}, all2all='allgather_reducescatter')"
                   if flag == "--ep" else "that each run their own tokens").format(v=value)
            raise ConfigError(f"{flag} {value}: run is one process and joins no process group; start {value} ranks "
                              f"(e.g. `torchrun --nproc-per-node {value} ...`) {how} "
                              f"(use `moe-registry explain {flag} {value}` to see the kernel choice)")
    if args.all2all not in (None, "none"):
        raise ConfigError(f"--all2all {args.all2all}: an all2all dispatches between expert-parallel ranks; "
                          "run is one process (ep=1), so only 'none' applies")


def check_common_flags(args: argparse.Namespace) -> None:
    """Files every run must have right, one process or many: the model, the output path (so a long run is not
    lost at its end) and the inputs file (a regular file: a FIFO would block the read)."""
    if not Path(args.target).exists():
        raise ConfigError(f"{args.target}: no such file or directory")
    if args.save_output:
        guards.check_output_path(Path(args.save_output), "--save-output")
    if args.inputs:
        guards.check_file(Path(args.inputs), "--inputs file")


def layer_situation(args: argparse.Namespace) -> tuple[Registry, ModelConfig, Situation]:
    """The registry, the model's config and the situation of one process's run (the layer, the runtime the flags
    ask for), each checked: what ``build`` reads first, here without torch."""
    registry = load_registry(args.spec_dir)
    check_kernel_names(registry, kernel=args.kernel, prefer=args.prefer)
    model = read_model_config(Path(args.target), registry)
    flags = Flags(platform=args.platform, dtype=args.dtype, layer=args.layer, tp=args.tp, ep=args.ep,
                  max_tokens=args.max_tokens)
    return registry, model, situation_for_model(model, registry, flags)


def check_before_torch(args: argparse.Namespace) -> None:
    """Everything one process's run can refuse without torch: flags, files, the config and the situation, and the
    ``--inputs`` file's names and hidden_states shape (from its header)."""
    check_run_flags(args)
    registry, model, situation = layer_situation(args)
    header = None
    if args.inputs:
        header = inputs_header(Path(args.inputs))
        if header is not None:
            check_inputs_header(Path(args.inputs), header, model.shape.hidden)
    if not args.inputs or (header is not None and "topk_ids" not in header):
        check_router(args, registry, model, situation)


def check_router(args: argparse.Namespace, registry: Registry, model: ModelConfig, situation: Situation) -> None:
    """The layer's router is in the checkpoint (from the safetensors headers), for a run that routes the tokens
    itself: without it the run could only fail after building the layer (which may compile its kernel)."""
    assert situation.layer is not None
    target = Path(args.target)
    index = open_checkpoint(target if target.is_dir() else target.parent)
    router = layer_names(registry.families[model.family].spec, situation.layer, index).router
    if router not in index.tensors:
        shape = model.shape
        raise CheckpointError(f"{router}: missing; run routes the tokens with the layer's router. Give the routing "
                              f"instead: --inputs FILE, a safetensors file with hidden_states [tokens, "
                              f"{shape.hidden}], topk_ids and topk_weights [tokens, {shape.top_k}] (in Python: "
                              "layer.kernel(hidden_states, topk_weights, topk_ids))")


def inputs_header(path: Path) -> dict[str, list[int]] | None:
    """The shapes of an ``--inputs`` file's tensors, from its safetensors header (8 bytes of length, then JSON)
    without torch; None when the header does not read (safetensors then says why, when the file is read)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= guards.MAX_JSON_BYTES:
                return None
            header = json.loads(f.read(size))
        return {n: [int(d) for d in v["shape"]] for n, v in header.items() if n != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def check_inputs_header(path: Path, shapes: Mapping[str, Sequence[int]], hidden: int) -> None:
    """An ``--inputs`` file's tensor names and hidden_states shape (``shapes``: name -> shape, as its header says):
    hidden_states [tokens, ``hidden``], optionally both topk_ids and topk_weights, nothing else."""
    names = set(shapes)
    if "hidden_states" not in names:
        raise ConfigError(f"{path}: no tensor named hidden_states (found {', '.join(sorted(names)) or 'none'})")
    guards.check_run_input_names(path, names)
    shape = list(shapes["hidden_states"])
    if len(shape) != 2 or shape[1] != hidden:
        raise ConfigError(f"{path}: hidden_states shape {shape}; expected [tokens, {hidden}]")
    if ("topk_ids" in names) != ("topk_weights" in names):
        raise ConfigError(f"{path}: give both topk_ids and topk_weights, or neither")
