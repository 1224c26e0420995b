"""The module that takes the place of a transformers MoE block's routed experts: it holds one layer's
packed weights (converted once, in the chosen kernel's layout) and calls its FusedMoEKernel with
transformers' experts contract ``(hidden_states, top_k_index, top_k_weights)``.

The router stays transformers' own, so routing (top-k, scoring, correction bias, scaling) is exactly
transformers'. Its ids are distinct experts in ``[0, num_experts)`` by construction (a top-k over the experts'
scores), so the call reads nothing on the host: the kernel's id checks (range, repeats), which read ids back,
are off, and the inputs' layout is checked from shapes alone on each new input signature. Under transformers'
expert parallelism (``_is_expert_parallel``, set where transformers' dispatch calls the module:
``moe_registry.whole.transformers_ep``) the module holds this rank's experts, ``num_experts`` of them, and ids
``>= num_experts`` name another rank's expert: such a pair adds nothing (:func:`drop_foreign`, on the device).

With ``graph_tokens`` > 0, a call of at most that many tokens on a CUDA device replays a CUDA graph of this
layer's experts, captured on the first call of its token bucket (:func:`graph_bucket`: the count rounded up by at
most 1/8; the padding rows are zero, weighted 0): a call's launches and Python glue (hundreds of microseconds of
host time, more than the GPU time of a few hundred tokens) then cost one replay. Every layer's graphs read and
write views of one set of static buffers and share one memory pool (:class:`GraphArena`), so what graphs hold
does not grow with the layers or the buckets seen. A call inside another capture runs the kernel directly, so an
outer CUDA graph holds the kernel's launches itself.

Under ``torch.compile`` (transformers compiles the decode step of its static cache) the call is one opaque custom
op, ``moe_registry::experts``, that names the module by a number (as vLLM's fused-MoE layer is named to its op):
torch.compile traces none of the kernel's Python, so no kernel's code can break the graph, and the compiled step
guards one number per layer instead of the attributes that code reads (guards are checked on the host before every
step; a 24-layer step on an H200 spent 0.9 ms in them)."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from moe_registry_kernels.quant_ref import per_tensor_dynamic

from moe_registry.layer.modular import FusedMoEKernel
from moe_registry.layer.resident import reachable_tensor_bytes
from moe_registry.oracle.contract import Report

_GRAPH_POOLS: dict[torch.device, tuple[int, int]] = {}
# the static buffers of every layer's graphs, by signature (weak: the graphs' CapturedCalls hold them)
_ARENAS: weakref.WeakValueDictionary[tuple, GraphArena] = weakref.WeakValueDictionary()
# every RegistryExperts by its number, for the compiled forward's op (weak: a model let go frees its experts)
_BY_NUMBER: weakref.WeakValueDictionary[int, RegistryExperts] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def drop_foreign(top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and weights where every id ``>= num_experts`` has weight 0 and stands on an expert its row does not
    use yet, so the kernel's one-expert-once-per-row contract holds and the pair adds nothing. Computed on the
    device whether or not a row holds such an id (reading that back would stall the GPU's queue)."""
    foreign = top_k_index >= num_experts
    rows = top_k_index.shape[0]
    used = torch.zeros(rows, num_experts + 1, dtype=torch.bool, device=top_k_index.device)
    used.scatter_(1, top_k_index.clamp(max=num_experts).long(), True)
    free = ~used[:, :num_experts]
    # the j-th foreign slot of a row takes the row's j-th free expert (a row has as many free experts as it has
    # foreign slots or more: its k slots hold fewer than k local experts)
    free_rank = torch.cumsum(free.long(), 1) - 1
    slot_rank = torch.cumsum(foreign.long(), 1) - 1
    order = torch.where(free, free_rank, num_experts).argsort(1)[:, :top_k_index.shape[1]]
    substitute = order.gather(1, slot_rank.clamp(min=0))
    ids = torch.where(foreign, substitute.to(top_k_index.dtype), top_k_index)
    return ids, torch.where(foreign, torch.zeros_like(top_k_weights), top_k_weights)


def graph_pool(device: torch.device) -> tuple[int, int]:
    """One CUDA graph memory pool per device for every layer's captured experts: the graphs replay one after
    another on one stream, so one layer's scratch may reuse another's."""
    if device not in _GRAPH_POOLS:
        _GRAPH_POOLS[device] = torch.cuda.graph_pool_handle()
    return _GRAPH_POOLS[device]


def graph_bucket(tokens: int, limit: int) -> int:
    """The token count whose captured graph a call of ``tokens`` (at most ``limit``) replays: up to 8 the count
    itself, above it the count rounded up to a multiple of 2^(floor(log2(tokens)) - 3). A call then computes at
    most 1/8 more rows than it has, and a layer keeps at most 8 graphs per doubling of the count, where one graph
    per count would capture again for every new prompt length."""
    if tokens <= 8:
        return tokens
    step = 1 << (tokens.bit_length() - 4)
    return min(-(-tokens // step) * step, limit)


@dataclass(eq=False)
class GraphArena:
    """The static input, ids, router weights and output that every layer's graphs of one signature read and
    write, as views of their first rows. The graphs replay one after another on one stream, each call copying its
    input in and its output out around its replay, so one set serves every layer and bucket. Rows past a call's
    own hold valid distinct ids (set here, or left by a larger call), which its padding weights by 0."""

    hidden: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor

    @classmethod
    def of(cls, rows: int, hidden: torch.Tensor, ids: torch.Tensor, num_experts: int) -> GraphArena:
        key = (hidden.device, rows, hidden.shape[1], hidden.dtype, ids.shape[1], ids.dtype, num_experts)
        arena = _ARENAS.get(key)
        if arena is None:
            k = ids.shape[1]
            pad_ids = torch.arange(rows * k, device=hidden.device).reshape(rows, k) % num_experts
            arena = cls(torch.zeros(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device),
                        pad_ids.to(ids.dtype), torch.zeros(rows, k, dtype=torch.float32, device=hidden.device),
                        torch.empty(rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device))
            _ARENAS[key] = arena
        return arena


@dataclass(frozen=True)
class CapturedCall:
    """One captured experts call: the graph and the arena whose first rows (its bucket's) it reads and writes."""

    graph: torch.cuda.CUDAGraph
    arena: GraphArena


class RegistryExperts(torch.nn.Module):
    """One MoE layer's routed experts on the registry's kernel (``report`` says which scheme and kernel);
    ``graph_tokens``: calls of at most this many tokens on CUDA replay a captured graph (0: never); ``top_k``: the
    experts each token is routed to (the contract's calls carry it in their ids; a call that does not reads it
    here)."""

    def __init__(self, kernel: FusedMoEKernel, report: Report, layer: int, graph_tokens: int = 0, *,
                 top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        kernel.validate = False  # the router's ids are right by construction: forward checks the layout only
        self.kernel = kernel
        self.report = report
        self.layer = layer
        self.num_experts = kernel.num_experts
        self.hidden_dim = kernel.experts.weights.hidden_size
        self.graph_tokens = graph_tokens
        self._is_expert_parallel = False
        self.expert_parallel = ""  # under expert parallelism: whose experts these are, and what hands them ids
        self._checked: set[tuple] = set()
        self._graphs: dict[tuple, CapturedCall] = {}
        # a per-tensor dynamic activation scale takes its amax over every row, padding's too: such a layer's
        # graphs are captured per exact count
        self._pads = not per_tensor_dynamic(kernel.experts.weights.activation_key)
        self.number = next(_NUMBERS)
        _BY_NUMBER[self.number] = self

    def __setstate__(self, state: dict) -> None:
        """A copy (copy.deepcopy, pickle) takes a number of its own, so the compiled op calls the copy's kernel."""
        super().__setstate__(state)
        self.number = next(_NUMBERS)
        _BY_NUMBER[self.number] = self

    @property
    def resident_bytes(self) -> int:
        """Bytes of every tensor storage the kernel holds (its packed weights, scales and any copies)."""
        return reachable_tensor_bytes(self.kernel)

    @property
    def captured(self) -> tuple[int, ...]:
        """The token buckets (:func:`graph_bucket`) of this layer's captured CUDA graphs."""
        return tuple(sorted(key[0] for key in self._graphs))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        ids = top_k_index.reshape(hidden.shape[0], -1)
        weights = top_k_weights.reshape(hidden.shape[0], -1).float()
        if torch.compiler.is_compiling():  # one opaque op (module docstring); the compiled step's graph holds it
            out = torch.ops.moe_registry.experts(hidden, ids, weights, self.number)
            return out.to(hidden_states.dtype).reshape(shape)
        key = self._checked_key(hidden, ids, weights)
        out = self._replay(key, hidden, ids, weights) if self._replays(hidden) else self._call(hidden, ids, weights)
        return out.to(hidden_states.dtype).reshape(shape)

    def _checked_key(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """The call's input signature, its layout checked the first time it is seen."""
        key = (hidden.shape[0], ids.shape[1], hidden.dtype, ids.dtype, hidden.device)
        if key not in self._checked:
            self.kernel.check_layout(hidden, weights, ids)
            self._checked.add(key)
        return key

    def _call(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self._is_expert_parallel:
            ids, weights = drop_foreign(ids, weights, self.num_experts)
        return self.kernel(hidden, weights, ids)

    def _replays(self, hidden: torch.Tensor) -> bool:
        """Whether this call replays a captured graph: few enough tokens on CUDA, not inside another capture
        (whose graph holds the kernel's launches), not recording autograd."""
        return (0 < hidden.shape[0] <= self.graph_tokens and hidden.is_cuda and not torch.is_grad_enabled()
                and not torch.cuda.is_current_stream_capturing())

    def _replay(self, key: tuple, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        rows = graph_bucket(tokens, self.graph_tokens) if self._pads else tokens
        key = (rows, *key[1:])
        call = self._graphs.get(key)
        if call is None:
            call = self._graphs[key] = self._capture(rows, hidden, ids, weights)
        arena = call.arena
        arena.hidden[:tokens].copy_(hidden)
        arena.ids[:tokens].copy_(ids)
        arena.weights[:tokens].copy_(weights)
        if tokens < rows:  # padding: zero rows, weighted 0 (their ids are valid, as the arena keeps them)
            arena.hidden[tokens:rows].zero_()
            arena.weights[tokens:rows].zero_()
        call.graph.replay()
        return arena.out[:tokens].clone()  # the arena's output is overwritten by the next replay

    def _capture(self, rows: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> CapturedCall:
        arena = GraphArena.of(self.graph_tokens, hidden, ids, self.num_experts)
        static = arena.hidden[:rows], arena.ids[:rows], arena.weights[:rows]
        # the warm-up call below computes: on the call's own rows and zero padding, as every replay does
        static[0].zero_()
        static[2].zero_()
        static[0][:hidden.shape[0]].copy_(hidden)
        static[1][:ids.shape[0]].copy_(ids)
        static[2][:weights.shape[0]].copy_(weights)
        side = torch.cuda.Stream(hidden.device)
        side.wait_stream(torch.cuda.current_stream(hidden.device))
        with torch.cuda.stream(side):  # a first call outside the capture: Triton compiles, the allocator warms
            self._call(*static)
        torch.cuda.current_stream(hidden.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graph_pool(hidden.device)):
            arena.out[:rows].copy_(self._call(*static))
        return CapturedCall(graph, arena)

    def extra_repr(self) -> str:
        scheme = self.report.scheme.scheme if self.report.scheme else "?"
        return (f"layer={self.layer}, experts={self.num_experts}, scheme={scheme}, kernel={self.report.chosen}"
                + (f", cuda graphs up to {self.graph_tokens} tokens" if self.graph_tokens else "")
                + (f", expert parallel: {self.expert_parallel}" if self.expert_parallel else ""))


@torch.library.custom_op("moe_registry::experts", mutates_args=())
def experts(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, number: int) -> torch.Tensor:
    """RegistryExperts ``number``'s kernel on hidden [T, H], ids [T, k] and float32 weights [T, k]: [T, H]
    in the kernel's output dtype, the layout checked on each new input signature, no captured graph of its own."""
    module = _BY_NUMBER.get(number)
    if module is None:
        raise RuntimeError(f"moe_registry::experts: no experts module {number} (the model it belonged to is gone)")
    module._checked_key(hidden, ids, weights)
    return module._call(hidden, ids, weights).to(hidden.dtype)


@experts.register_fake
def _(hidden, ids, weights, number):  # type: ignore[no-untyped-def]
    return torch.empty_like(hidden)
