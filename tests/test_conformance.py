"""Conformance generated from the specs: every (scheme × kernel × declared option) is run against
the float64 reference on random data, with the tolerance the scheme spec writes down.

On CPU (CI) the torch reference runs in float32 and the Triton kernels run under
TRITON_INTERPRET=1 in float16 at small shapes (the interpreter cannot do bfloat16 dots); on a GPU
(`pytest -m gpu`) the Triton kernels run at realistic shapes in bfloat16 and float16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moe_registry.builder import DTYPES, experts_class
from moe_registry.conformance import REALISTIC, SMALL, Case, Sizes, cases_for
from moe_registry.experts import ExpertsConfig
from moe_registry.modular import BatchedLocalPrepareFinalize, FusedMoEKernel, LocalPrepareFinalize
from moe_registry.registry import load_registry

REGISTRY = load_registry()
HAS_TRITON = importlib.util.find_spec("triton") is not None
CPU_CASES = cases_for(REGISTRY, kernels=["torch-reference"], dtypes=["float32", "bfloat16"])
TRITON_KERNELS = [k for k in REGISTRY.kernels if REGISTRY.kernel(k).impl.startswith("moe_registry_kernels.triton")]
INTERPRETER_CASES = cases_for(REGISTRY, kernels=TRITON_KERNELS, dtypes=["float16"]) if HAS_TRITON else []
GPU_CASES = (cases_for(REGISTRY, kernels=TRITON_KERNELS, dtypes=["bfloat16", "float16"], sizes=REALISTIC)
             + cases_for(REGISTRY, kernels=["torch-reference"], dtypes=["bfloat16"],
                         sizes=Sizes(8, 2, 512, 256, (16,))))


def _routing(case: Case, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    allowed = torch.arange(case.skip_experts, case.num_experts)
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:case.top_k]]
                       for _ in range(case.tokens)]).to(torch.int32)
    weights = torch.rand(case.tokens, case.top_k, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device), weights.to(device)


def run_case(case: Case, device: torch.device) -> float:
    """Run one case; returns ‖out − ref‖ / ‖ref‖ against the float64 reference."""
    from moe_registry_kernels.quant_ref import make_random_expert_weights
    from moe_registry_kernels.reference import reference_moe

    seed = abs(hash(case.id)) % (2**31)
    weights = make_random_expert_weights(case.weight_key, case.activation_key, num_experts=case.num_experts,
                                         hidden=case.hidden, intermediate=case.intermediate,
                                         dtype=DTYPES[case.dtype], bias=case.bias, act_order=case.act_order,
                                         seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(DTYPES[case.dtype])
    ids, topk_w = _routing(case, torch.device("cpu"), gen)
    config = ExpertsConfig(activation=case.activation, apply_router_weight_on_input=case.router_weight_on_input,  # type: ignore[arg-type]
                           activation_format=case.activation_format)  # type: ignore[arg-type]
    cls = experts_class(REGISTRY.kernel(case.kernel))
    pf = (BatchedLocalPrepareFinalize(case.num_experts) if case.activation_format == "batched"
          else LocalPrepareFinalize())
    kernel = FusedMoEKernel(pf, cls(weights.to(device), config))
    out = kernel(x.to(device), topk_w.to(device), ids.to(device))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert bool(torch.isfinite(out).all()), "non-finite output"
    ref = reference_moe(x, topk_w, ids, weights, config, torch.float64)
    assert float(ref.norm()) > 0
    return float((out.cpu().double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.id for c in CPU_CASES])
def test_reference_kernel_conforms(case: Case) -> None:
    err = run_case(case, torch.device("cpu"))
    assert err <= case.tolerance, f"{case.id}: relative error {err:.3e} > {case.tolerance:.1e}"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", INTERPRETER_CASES, ids=[c.id for c in INTERPRETER_CASES])
def test_triton_kernel_conforms_in_interpreter(case: Case) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter run is for machines without a GPU; use -m gpu")
    err = run_case(case, torch.device("cpu"))
    assert err <= case.tolerance, f"{case.id}: relative error {err:.3e} > {case.tolerance:.1e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
def test_kernel_conforms_on_gpu(case: Case) -> None:
    err = run_case(case, torch.device("cuda"))
    print(f"CONFORMANCE {case.scheme} {case.kernel} {case.dtype} {err:.3e}")
    assert err <= case.tolerance, f"{case.id}: relative error {err:.3e} > {case.tolerance:.1e}"


def test_every_scheme_has_cases() -> None:
    schemes = {c.scheme for c in CPU_CASES}
    assert schemes == set(REGISTRY.schemes)
    assert len(SMALL.tokens) >= 1 and len(CPU_CASES) > 3 * len(REGISTRY.schemes)


# ---------------------------------------------------------------------------------------------
# tuned configs: every config shipped in kernels/configs runs the conformance cases of its keys


def _tuned_config_cases(cases: list[Case]) -> list[tuple[str, Case, dict, dict]]:
    """(id, case, GEMM1 config, GEMM2 config) for each distinct tuned pair of each shipped file,
    run on the standard-format cases whose keys the file is for."""
    import json
    from pathlib import Path

    from moe_registry.keys import parse_quant_key

    config_dir = Path(__file__).resolve().parents[1] / "kernels" / "configs"
    out = []
    for path in sorted(config_dir.glob("*.json")):
        table = json.loads(path.read_text())
        meta = table.pop("meta")
        wkey, akey = parse_quant_key(meta["weight_key"]), parse_quant_key(meta["activation_key"])
        mine = [c for c in cases if c.weight_key == wkey and c.activation_key == akey
                and c.kernel == "triton-fused-moe" and not c.act_order]
        assert mine, f"{path.name}: no spec claims keys {wkey} / {akey} for triton-fused-moe"
        pairs = set()
        for key1, by_tokens in table.items():  # GEMM1 (N = 2I, K = H) is the key whose GEMM2 (H, I) is there
            e_top, rest = key1.split("_N")
            n1, k1 = rest.split("_K")
            key2 = f"{e_top}_N{k1}_K{int(n1) // 2}"
            if key2 not in table:
                continue
            for tokens, config1 in by_tokens.items():
                pairs.add((json.dumps(config1, sort_keys=True), json.dumps(table[key2][tokens], sort_keys=True)))
        assert pairs, f"{path.name}: no GEMM1/GEMM2 pair of tables"
        for n, (c1, c2) in enumerate(sorted(pairs)):
            case = mine[n % len(mine)]
            out.append((f"{path.stem}-{n}", case, json.loads(c1), json.loads(c2)))
    return out


TUNED_CPU = _tuned_config_cases(INTERPRETER_CASES) if HAS_TRITON else []


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("tuned", TUNED_CPU, ids=[t[0] for t in TUNED_CPU])
def test_tuned_configs_conform_in_interpreter(tuned) -> None:
    from moe_registry_kernels.triton_moe import config_override

    if torch.cuda.is_available():
        pytest.skip("the interpreter run is for machines without a GPU; use -m gpu")
    _, case, config1, config2 = tuned
    with config_override(config1, config2):
        err = run_case(case, torch.device("cpu"))
    assert err <= case.tolerance, f"{case.id} with {config1} / {config2}: relative error {err:.3e}"


TUNED_GPU = _tuned_config_cases([c for c in GPU_CASES if c.dtype == "bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("tuned", TUNED_GPU, ids=[t[0] for t in TUNED_GPU])
def test_tuned_configs_conform_on_gpu(tuned) -> None:
    from moe_registry_kernels.triton_moe import config_override

    _, case, config1, config2 = tuned
    with config_override(config1, config2):
        err = run_case(case, torch.device("cuda"))
    print(f"CONFORMANCE-TUNED {case.scheme} {case.kernel} {case.dtype} {err:.3e}")
    assert err <= case.tolerance, f"{case.id} with {config1} / {config2}: relative error {err:.3e}"
