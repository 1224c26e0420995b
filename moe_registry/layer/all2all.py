"""Expert parallelism over torch.distributed: a PrepareFinalize that moves tokens between
the ranks of a process group (NCCL on GPUs, gloo on CPUs), each rank holding a share of the experts.

``AllGatherReduceScatter`` is vLLM's ``allgather_reducescatter`` backend: every rank gathers every
rank's tokens and routing (one all-gather of one byte row per token holding its ids, router weights and
hidden state: at decode a collective's latency, not its bytes, is the cost), runs its own experts on the (token, expert)
pairs routed to them (the others' pairs carry the foreign id -1, which the experts kernels skip), and a
reduce-scatter sums the partial outputs back onto the ranks the tokens came from (NCCL and gloo both
have both collectives). Shapes are fixed by ``max_tokens`` (each
rank's tokens padded to it), so the forward never reads a count on the host and a CUDA graph can
hold it where the backend allows. It sends world × max_tokens rows where an all-to-all would send
each pair once; it is the simple, synchronisation-free first backend.

``AllGatherReduceScatterBatched`` hands the same pairs to experts of the batched format, grouped per local expert.
The kernel specs that claim it say so (``parallel.all2all``) and the oracle chooses it (and the format:
``oracle.predicates.delivered_format``); ``build`` reads only a
rank's own experts (``checkpoint.read.read_layer(experts=...)``) and ``moe-registry run`` under torchrun runs
it. ``counters`` (:class:`DispatchCounters`) say what each forward handed to the collectives.

Why not ``all_to_all_single``: it takes per-rank split sizes as host integers, so a forward would have to
copy the routed counts to the host (a device sync) before sending; this backend's sizes are fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, TypeVar

import torch
import torch.distributed as dist

from moe_registry.core.errors import MoERegistryError
from moe_registry.layer.experts import ActivationFormat
from moe_registry.layer.modular import (
    BatchedDispatch,
    DispatchRecord,
    PreparedInput,
    PrepareFinalize,
    combine_batched,
    group_by_expert,
)

FOREIGN_EXPERT = -1
"""The expert id of a pair another rank computes: the experts kernels add nothing for it."""

# torch 2.13 renamed the tensor forms of the two collectives (the old names warn); older torch has only those
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


T = TypeVar("T")


class ExpertParallelError(MoERegistryError, RuntimeError):
    """A collective failed: a rank died, or the group's timeout passed while waiting for one."""


def collective(what: str, rank: int, world: int, call: Callable[[], T]) -> T:
    """Run one collective; a failure (a dead peer, the group's timeout) becomes one line naming it."""
    try:
        return call()
    except (RuntimeError, dist.DistError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExpertParallelError(f"expert parallelism: rank {rank} of {world}: {what} failed (a rank died or "
                                  f"did not answer within the process group's timeout): {first[:200]}") from None


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank owns which expert: contiguous (rank r holds experts [r·n, (r+1)·n)) or round-robin
    (expert e lives on rank e mod world)."""

    num_experts: int
    world_size: int
    rank: int
    round_robin: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of world size {self.world_size}: wanted 0 <= rank < world size")
        if self.num_experts % self.world_size:
            raise ValueError(f"{self.num_experts} experts do not split evenly over {self.world_size} ranks; "
                             f"wanted a world size that divides {self.num_experts}")

    @property
    def local_count(self) -> int:
        return self.num_experts // self.world_size

    def owner(self, expert: int) -> int:
        return expert % self.world_size if self.round_robin else expert // self.local_count

    def local_experts(self) -> torch.Tensor:
        """The global ids this rank holds, in its local order (int64)."""
        if self.round_robin:
            return torch.arange(self.rank, self.num_experts, self.world_size, dtype=torch.int64)
        return torch.arange(self.rank * self.local_count, (self.rank + 1) * self.local_count, dtype=torch.int64)

    def local_ids(self) -> torch.Tensor:
        """Global id -> local id on this rank, FOREIGN_EXPERT for another rank's expert (int64 [E])."""
        table = torch.full((self.num_experts,), FOREIGN_EXPERT, dtype=torch.int64)
        table[self.local_experts()] = torch.arange(self.local_count, dtype=torch.int64)
        return table


@dataclass(frozen=True)
class DispatchCounters:
    """What one dispatcher handed to its collectives, summed over its forwards (``calls``): the bytes of this
    rank's all-gather input (its padded byte rows: ids, router weights, hidden) and of its reduce-scatter input. Counted
    from tensor sizes known on the host, so counting costs no collective and no device sync (a CUDA graph
    replay does not run the Python that counts)."""

    world_size: int
    calls: int = 0
    gathered_bytes: int = 0
    scattered_bytes: int = 0

    @property
    def sent_bytes(self) -> int:
        """Bytes that leave this rank: each peer needs its all-gather inputs ((world - 1) x) and its share of
        every other rank's reduce-scatter slice ((world - 1) / world of its input), as a ring or a direct
        exchange sends them."""
        w = self.world_size
        return (w - 1) * self.gathered_bytes + (w - 1) * self.scattered_bytes // w


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class RowField:
    """One input's place in a token's byte row: its dtype, its width in elements and its byte offset."""

    dtype: torch.dtype
    width: int
    offset: int

    def of(self, rows: torch.Tensor) -> torch.Tensor:
        """This field of byte rows [R, row_bytes], as a [R, width] view in its dtype."""
        return rows[:, self.offset:self.offset + self.width * self.dtype.itemsize].view(self.dtype)


@dataclass(frozen=True)
class RowLayout:
    """How a token's expert ids (int32), router weights (float32) and hidden state share one byte row, so one
    all-gather moves all three. The dtypes are fixed (ids of either integer type are copied in as int32), so
    every rank's row is the same size whatever it was handed. Fields go widest element first, and the row is
    padded to the widest element, so every field starts aligned to its own element size (what
    ``Tensor.view(dtype)`` needs)."""

    ids: RowField
    weights: RowField
    hidden: RowField
    row_bytes: int

    @staticmethod
    def of(hidden_size: int, top_k: int, dtype: torch.dtype) -> RowLayout:
        parts = {"ids": (torch.int32, top_k), "weights": (torch.float32, top_k), "hidden": (dtype, hidden_size)}
        size = {name: d.itemsize for name, (d, _) in parts.items()}
        offset, fields = 0, {}
        for name in sorted(parts, key=lambda n: -size[n]):
            fields[name] = RowField(parts[name][0], parts[name][1], offset)
            offset += parts[name][1] * size[name]
        widest = max(size.values())
        return RowLayout(**fields, row_bytes=-(-offset // widest) * widest)


@dataclass(frozen=True)
class GatheredTokens(DispatchRecord):
    """What finalize needs: how many of this rank's rows were real (the rest was padding)."""

    num_tokens: int


class AllGatherReduceScatter(PrepareFinalize):
    """Standard format across ranks: gather every rank's tokens, run the local experts on the pairs
    routed to them, reduce-scatter the sums back (see the module docstring)."""

    activation_format: ClassVar[ActivationFormat] = "standard"

    def __init__(self, placement: ExpertPlacement, max_tokens: int,
                 group: dist.ProcessGroup | None = None, agreement: str = "") -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not dist.is_initialized():
            raise ValueError("expert parallelism needs a torch.distributed process group: start the ranks with "
                             "torchrun (or call torch.distributed.init_process_group) first")
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if (world, rank) != (placement.world_size, placement.rank):
            raise ValueError(f"placement is for rank {placement.rank} of {placement.world_size}, but this process "
                             f"is rank {rank} of {world}")
        self.placement = placement
        self.max_tokens = max_tokens
        self.group = group
        self._agree(f"{agreement}|experts={placement.num_experts}|round_robin={placement.round_robin}|"
                    f"max_tokens={max_tokens}")
        self._local_ids = {torch.device("cpu"): placement.local_ids()}  # per device: no copy in the forward
        self.counters = DispatchCounters(placement.world_size)

    def num_global_experts(self, local_experts: int) -> int:
        if local_experts != self.placement.local_count:
            raise ValueError(f"this rank's experts hold {local_experts} experts but the placement gives it "
                             f"{self.placement.local_count}")
        return self.placement.num_experts

    def _agree(self, what: str) -> None:
        """Every rank must build the same layer (config, scheme, kernel, placement, max_tokens): a digest of
        ``what`` is gathered once, here, so a rank that differs fails every rank with one line instead of
        mismatched collectives later."""
        import hashlib

        digest = torch.frombuffer(bytearray(hashlib.sha256(what.encode()).digest()), dtype=torch.uint8).clone()
        if dist.get_backend(self.group) == "nccl":  # an NCCL-only group moves CUDA tensors alone
            digest = digest.to(torch.device("cuda", torch.cuda.current_device()))
        digests = self._gather(digest).view(self.placement.world_size, -1).cpu()
        differ = [r for r in range(self.placement.world_size) if not torch.equal(digests[r], digests[0])]
        if differ:
            raise ExpertParallelError(f"expert parallelism: ranks {', '.join(map(str, differ))} build another layer "
                                      f"than rank 0 (config, scheme, kernel, placement or max_tokens differ); "
                                      f"wanted every rank to run the same layer")

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty(self.placement.world_size * t.shape[0], *t.shape[1:])
        collective("all_gather", self.placement.rank, self.placement.world_size,
                    lambda: ALL_GATHER(out, t.contiguous(), group=self.group))
        return out

    def prepare(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                apply_router_weight_on_input: bool = False) -> PreparedInput:
        rows, weights, local, m = self._gather_tokens(hidden, topk_weights, topk_ids)
        return PreparedInput(rows, weights, local, "standard", dispatch=GatheredTokens(m))

    def finalize(self, expert_output: torch.Tensor, prepared: PreparedInput) -> torch.Tensor:
        d = prepared.dispatch
        if not isinstance(d, GatheredTokens):
            raise ValueError("finalize got a PreparedInput that AllGatherReduceScatter.prepare did not make")
        return self._reduce_scatter(expert_output, d.num_tokens)

    def _gather_tokens(self, hidden: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Every rank's padded rows [world x max_tokens, H], router weights and expert ids in this rank's local
        numbering (FOREIGN_EXPERT for other ranks' experts and for padding), and how many rows were this rank's."""
        m = topk_ids.shape[0]
        if m > self.max_tokens:
            raise ValueError(f"{m} tokens on rank {self.placement.rank}, more than max_tokens = {self.max_tokens}")
        layout = RowLayout.of(hidden.shape[1], topk_ids.shape[1], hidden.dtype)
        rows = torch.empty(self.max_tokens, layout.row_bytes, dtype=torch.uint8, device=hidden.device)
        for field, t in ((layout.ids, topk_ids), (layout.weights, topk_weights), (layout.hidden, hidden)):
            field.of(rows[:m]).copy_(t)
        rows[m:].zero_()  # padding: zero rows and weights, every expert foreign
        layout.ids.of(rows[m:]).fill_(FOREIGN_EXPERT)
        gathered = self._gather(rows)
        c = self.counters
        self.counters = replace(c, calls=c.calls + 1, gathered_bytes=c.gathered_bytes + _nbytes(rows))
        all_ids = layout.ids.of(gathered)
        table = self._local_ids.get(all_ids.device)
        if table is None:  # the first call on this device (outside any CUDA graph it is captured in later)
            table = self._local_ids[all_ids.device] = self._local_ids[torch.device("cpu")].to(all_ids.device)
        local = torch.where(all_ids >= 0, table[all_ids.clamp(min=0).long()], FOREIGN_EXPERT).to(all_ids.dtype)
        return layout.hidden.of(gathered).contiguous(), layout.weights.of(gathered).contiguous(), local, m

    def _reduce_scatter(self, sums: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's partial sums [world x max_tokens, H] added up; this rank's first ``num_tokens`` rows."""
        mine = sums.new_empty(self.max_tokens, sums.shape[1])
        collective("reduce_scatter", self.placement.rank, self.placement.world_size,
                    lambda: REDUCE_SCATTER(mine, sums.contiguous(), group=self.group))
        self.counters = replace(self.counters, scattered_bytes=self.counters.scattered_bytes + _nbytes(sums))
        return mine[:num_tokens]


@dataclass(frozen=True)
class GatheredBatch(DispatchRecord):
    """What the batched finalize needs: this rank's real rows and where every gathered pair went."""

    num_tokens: int
    batch: BatchedDispatch


class AllGatherReduceScatterBatched(AllGatherReduceScatter):
    """The same exchange for experts that take the batched format: the gathered pairs routed to this rank's
    experts are grouped into [local experts, world x max_tokens, H] (room for every gathered token, so no count
    is read on the host), and each expert's rows are summed back per token, with the router weights, before the
    reduce-scatter."""

    activation_format: ClassVar[ActivationFormat] = "batched"

    def prepare(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                apply_router_weight_on_input: bool = False) -> PreparedInput:
        if apply_router_weight_on_input and topk_ids.shape[1] != 1:
            raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got top_k = {topk_ids.shape[1]}")
        rows, weights, local, m = self._gather_tokens(hidden, topk_weights, topk_ids)
        slab, counts, batch = group_by_expert(rows, weights, local, self.placement.local_count,
                                              self.placement.world_size * self.max_tokens,
                                              apply_router_weight_on_input)
        return PreparedInput(slab, weights, local, "batched", counts.to(torch.int32), GatheredBatch(m, batch))

    def finalize(self, expert_output: torch.Tensor, prepared: PreparedInput) -> torch.Tensor:
        d = prepared.dispatch
        if not isinstance(d, GatheredBatch):
            raise ValueError("finalize got a PreparedInput that AllGatherReduceScatterBatched.prepare did not make")
        return self._reduce_scatter(combine_batched(expert_output, d.batch).to(expert_output.dtype), d.num_tokens)


DEFAULT_BACKEND = "allgather_reducescatter"
"""The backend ``run`` under torchrun and ``load_layer(ep=N)`` use when none is named (the only one here)."""

DISPATCHERS: dict[tuple[str, ActivationFormat], type[AllGatherReduceScatter]] = {
    ("allgather_reducescatter", "standard"): AllGatherReduceScatter,
    ("allgather_reducescatter", "batched"): AllGatherReduceScatterBatched,
}
"""The PrepareFinalize of each (all2all backend, activation format) a kernel spec may claim besides none (the
formats each backend delivers: core.vocab.ALL2ALL_DELIVERS)."""

BACKENDS = frozenset(backend for backend, _ in DISPATCHERS)
"""The all2all backends implemented here."""
