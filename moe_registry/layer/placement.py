"""Where a layer's experts live under expert parallelism: the experts this rank holds (the situation's
placement over the process group, or, with no all2all, over the ranks of a caller that moves the tokens itself)
and the PrepareFinalize that moves its tokens to them (the situation's all2all backend, for the kernel's
activation format). ``torch.distributed`` and the dispatchers are imported only when an all2all is asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_registry.core.errors import ConfigError
from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.modular import LocalPrepareFinalize, PrepareFinalize
from moe_registry.oracle.contract import Report
from moe_registry.situation.runtime import RuntimeConfig

if TYPE_CHECKING:
    from moe_registry.layer.all2all import ExpertPlacement


def placement_for(runtime: RuntimeConfig, rank: int | None = None) -> ExpertPlacement | None:
    """The experts this rank holds under an all2all (the situation's placement over the process group, which must
    already exist with ep ranks), or, with no all2all and ``rank`` given, the experts of ``rank`` of ep (a caller
    outside the layer moves the tokens and hands it local ids, as transformers' expert parallelism does); None
    otherwise (every expert is local)."""
    p = runtime.parallel
    if p.all2all == "none" and (rank is None or p.ep == 1):
        return None
    import torch.distributed as dist

    from moe_registry.layer.all2all import ExpertPlacement

    if p.all2all != "none":
        if rank is not None:
            raise ConfigError(f"ep_rank={rank} with all2all {p.all2all}: the dispatcher's rank is the process "
                              "group's; wanted ep_rank only without an all2all")
        if not dist.is_initialized():
            raise ConfigError(f"ep={p.ep}, all2all {p.all2all}: no torch.distributed process group; start the {p.ep} "
                              f"ranks with torchrun --nproc-per-node {p.ep} (or call "
                              "torch.distributed.init_process_group in each) first")
        if dist.get_world_size() != p.ep:
            raise ConfigError(f"ep={p.ep}, but the process group has {dist.get_world_size()} ranks; wanted {p.ep}")
        rank = dist.get_rank()
    assert runtime.shape is not None and rank is not None
    try:
        return ExpertPlacement(runtime.shape.num_experts, p.ep, rank, round_robin=p.expert_placement == "round_robin")
    except ValueError as err:
        raise ConfigError(f"--ep: {err}") from None


def dispatch_for(report: Report, weights: ExpertWeights, fmt: str,
              read: tuple[int, ...] | None = None) -> tuple[PrepareFinalize, ExpertWeights]:
    """The PrepareFinalize the situation's all2all backend names (for the kernel's activation format ``fmt``)
    and the experts this rank holds: all of
    them with no dispatch, its share of them under an all2all: ``weights`` as they are when they were read
    for exactly that share (``read``: the global ids), else the share taken out of every expert's."""
    runtime = report.situation.runtime
    placement = placement_for(runtime)
    if placement is None:
        return LocalPrepareFinalize(), weights
    from moe_registry.layer.all2all import DISPATCHERS

    owned = placement.local_experts()
    if read is not None and read != tuple(owned.tolist()):
        raise ConfigError(f"the tensors were read for experts {list(read)}, but rank {placement.rank} of "
                          f"{placement.world_size} holds experts {owned.tolist()}")
    p, scheme = runtime.parallel, report.scheme
    agreement = (f"{runtime.shape}|{runtime.dtype}|{p}|{scheme.scheme if scheme else ''}|"
                 f"{dict(scheme.bindings) if scheme else ''}|{report.chosen}")
    return (DISPATCHERS[(p.all2all, fmt)](placement, runtime.max_tokens, agreement=agreement),  # type: ignore[index]
            weights if read is not None else weights.subset(owned))
