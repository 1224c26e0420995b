"""transformers' own expert parallelism carrying the registry's experts, where the installed transformers has it
(its ``EPImplementation`` classes, reached through the ``ep_dispatch_experts`` parallel style; detected by
feature, see :func:`transformers_dispatch`).

transformers' dispatch calls an experts module's own ``forward(hidden_states, top_k_index, top_k_weights)`` with
the ids local to this rank, reads the module's ``num_experts`` (this rank's count) when it is installed, and hands
an id of ``num_experts`` for a pair another rank computes (``all_reduce``), which ``_is_expert_parallel`` makes
add nothing (:func:`moe_registry.whole.experts_module.drop_foreign`). Its experts are placed contiguously: rank r
of ep holds experts [r·n, (r+1)·n). :class:`RegistryExperts` keeps that contract, so:

- a model transformers loads with ``experts_implementation="moe_registry"`` and ``distributed_config`` runs its
  local experts' shard on the registry's kernel (``moe_registry.whole.interface``);
- ``load_model(..., ep=N, ep_implementation=NAME)`` installs transformers' dispatch ``NAME`` on each MoE layer's
  experts, each rank holding its own experts' packed weights. Its ranks run their own tokens, so only a dispatch
  that moves tokens between ranks fits (``all_to_all``, or ``auto``, which picks it there); ``moe_registry`` is
  the project's own dispatcher (``allgather_reducescatter``) instead."""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from moe_registry.core.errors import ConfigError

REGISTRY = "moe_registry"
"""``ep_implementation`` naming the project's own dispatcher (``allgather_reducescatter``)."""
DEFAULT = "all_to_all"
"""The ``ep_implementation`` ``load_model`` takes where transformers' dispatch is installed: its ranks run their
own tokens, and ``all_to_all`` moves only the routed (token, expert) pairs, where ``moe_registry``'s all-gather
pads every rank's tokens to ``max_tokens`` (docs/design.md, "Whole model ↔ transformers' expert parallelism")."""
STYLE = "ep_dispatch_experts"


def transformers_dispatch() -> ModuleType | None:
    """transformers' expert-parallel module when it has the dispatch this path drives (the ``EPImplementation``
    registry and ``apply_expert_parallelism`` with the ``ep_dispatch_experts`` style), else None."""
    try:
        from transformers.distributed import expert_parallel
    except ImportError:
        return None
    needed = ("EPImplementation", "EPImplementationInterface", "EpDispatchExpertsParallel", "apply_expert_parallelism")
    return expert_parallel if all(hasattr(expert_parallel, n) for n in needed) else None


def _names(module: ModuleType) -> list[str]:
    """The dispatches ``load_model``'s ranks can run on their own tokens (not those needing one shared batch)."""
    registered = module.EPImplementationInterface()
    return [n for n in registered if not getattr(registered[n], "needs_shared_batch", False)]


def resolve(name: str | None, ep: int, experts_call: str) -> str:
    """The ``ep_implementation`` that runs under ``ep`` ranks: ``name``, checked, or the default (:data:`DEFAULT`
    where transformers' dispatch is installed and the family's experts take the experts contract, else
    :data:`REGISTRY`). Without expert parallelism (ep 1): empty."""
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"ep_implementation={name!r}: wanted a name, e.g. {REGISTRY!r} or {DEFAULT!r}")
    if ep == 1:
        return ""
    module = transformers_dispatch()
    if name is None:
        return DEFAULT if module is not None and experts_call == "contract" else REGISTRY
    if name == REGISTRY:
        return name
    if module is None:
        import transformers

        raise ConfigError(f"ep_implementation={name!r}: transformers {transformers.__version__} has no expert-parallel "
                          f"dispatch (transformers.distributed.expert_parallel.EPImplementation); wanted "
                          f"ep_implementation={REGISTRY!r}")
    usable = _names(module)
    if name not in usable:
        registered = module.EPImplementationInterface()
        why = (f"transformers' {registered[name].__name__} needs every rank to hold the same batch, and "
               "load_model's ranks run their own tokens" if name in registered else "not a registered dispatch")
        raise ConfigError(f"ep_implementation={name!r}: {why}; wanted one of "
                          f"{', '.join(repr(n) for n in [REGISTRY, *usable])}")
    if experts_call != "contract":
        raise ConfigError(f"ep_implementation={name!r}: this family's experts are called with {experts_call}; "
                          f"transformers' dispatch calls (hidden_states, top_k_index, top_k_weights): wanted "
                          f"ep_implementation={REGISTRY!r}")
    return name


def install(model: torch.nn.Module, experts: Mapping[int, str], ep: int, name: str, device: torch.device) -> None:
    """Put transformers' dispatch ``name`` in front of each experts module (paths ``experts``, each holding this
    rank's experts: ``num_experts`` local), over a mesh of ``ep`` expert ranks whose tensor-parallel groups are
    single ranks (each rank runs its own tokens). Every rank calls it (the mesh's groups are collectives)."""
    module = transformers_dispatch()
    assert module is not None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (ep, 1), mesh_dim_names=("ep", "tp"))
    rank = mesh["ep"].get_local_rank()
    for path in experts.values():
        owner: Any = model.get_submodule(path)
        owner._is_expert_parallel = True  # ids >= num_experts (another rank's) add nothing
        n = owner.num_experts
        owner.expert_parallel = (f"rank {rank} of {ep}, experts {rank * n}-{(rank + 1) * n - 1} of {n * ep}, ids "
                                 f"from transformers' {STYLE} (ep_implementation {name!r})")
    module.apply_expert_parallelism(model, mesh["ep"], mesh["tp"], dict.fromkeys(experts.values(), STYLE),
                                    ep_implementation=name)


def describe(name: str) -> str:
    """The dispatch ``name`` in words, for the load report."""
    if name == REGISTRY:
        return ("every rank's tokens are gathered, and their sums reduced back (ep_implementation 'moe_registry': "
                "the allgather_reducescatter dispatcher)")
    module = transformers_dispatch()
    cls = module.EPImplementationInterface()[name].__name__ if module is not None else "?"
    return f"transformers' expert parallelism moves the tokens ({STYLE}, ep_implementation {name!r}: {cls})"
