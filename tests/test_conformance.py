"""Conformance generated from the specs: every (scheme × kernel × declared option) is run against
the float64 reference on random data, with the tolerance the scheme spec writes down.

On CPU (CI) the torch reference runs in float32 and the Triton kernels run under
TRITON_INTERPRET=1 in float16 at small shapes (the interpreter cannot do bfloat16 dots); on a GPU
(`pytest -m gpu`) the Triton kernels run at realistic shapes in bfloat16 and float16.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from moe_registry.core.keys import QuantKey
from moe_registry.formats.weights import ExpertWeights
from moe_registry.layer.build import DTYPES, experts_class, linear_class
from moe_registry.layer.experts import ExpertsConfig
from moe_registry.layer.modular import BatchedLocalPrepareFinalize, FusedMoEKernel, LocalPrepareFinalize
from moe_registry.spec.loader import load_registry
from moe_registry.spec.view import KernelSpec
from moe_registry.testing.conformance import REALISTIC, SMALL, Case, Sizes, cases_for

REGISTRY = load_registry()
HAS_TRITON = importlib.util.find_spec("triton") is not None
CPU_KERNELS = [k for k in REGISTRY.kernels if any(p.device == "cpu" for p in REGISTRY.kernel(k).platforms)]
CPU_CASES = cases_for(REGISTRY, kernels=CPU_KERNELS, dtypes=["float32", "bfloat16"])
TRITON_KERNELS = [k for k in REGISTRY.kernels if REGISTRY.kernel(k).impl.startswith("moe_registry_kernels.triton")]
INTERPRETER_CASES = cases_for(REGISTRY, kernels=TRITON_KERNELS, dtypes=["float16"]) if HAS_TRITON else []
GPU_CASES = (cases_for(REGISTRY, kernels=TRITON_KERNELS, dtypes=["bfloat16", "float16"], sizes=REALISTIC)
             + cases_for(REGISTRY, kernels=["torch-reference"], dtypes=["bfloat16"],
                         sizes=Sizes(8, 2, 512, 256, (16,))))


def _key_class(key: QuantKey) -> tuple:
    """What of a key decides which code runs, not which values it sees: bits, float or integer,
    scale shape kind (tensor, channel, group, block), dynamic or static, zero point."""
    if not key.quantized or key.scale is None:
        return ("unquantized",)
    kind = str(key.scale.group).split("(")[0]
    return (key.dtype.bits, key.dtype.is_float, kind, key.scale.dynamic, key.zero_point)


def _code_paths(case: Case) -> tuple[tuple, tuple]:
    """The kernel code a case runs, as two signatures. The weight path: kernel, both keys in full
    (group sizes included: a group that is a whole number of K tiles takes Triton's factored dot),
    act-order, activation format and dtype. The option path: what the case varies (activation,
    bias, router weight on input, one token, top-k = E, experts without tokens, smallest sizes) on
    the class of keys it meets (_key_class): the epilogue and routing code those touch."""
    edge = ("one token" if case.tokens == 1 else "top_k=E" if case.top_k == case.num_experts
            else "idle experts" if case.skip_experts
            else "smallest" if min(case.hidden, case.intermediate) < 128 else "")
    common = (case.kernel, case.act_order, case.activation_format, case.dtype, case.linear)
    weight = (*common, str(case.weight_key), str(case.activation_key))
    option = (*common, _key_class(case.weight_key), _key_class(case.activation_key), case.activation, case.bias,
              case.router_weight_on_input, edge)
    return weight, option


def _ci_or_slow(cases: list[Case]) -> list:
    """The cases as parameters, those that add no code path marked slow (the rule of the `slow`
    marker in pyproject.toml): CI runs the first case of each (scheme, kernel) pair and every case
    with a weight path or an option path (_code_paths) no earlier case ran; the rest (the same keys
    under another scheme's name, an option already run on the same class of keys) runs in
    tools/run_slow_tests.sh."""
    seen: set = set()
    out = []
    for case in cases:
        weight, option = _code_paths(case)
        mine = {(case.scheme, case.kernel), ("w", weight), ("o", option)}
        out.append(pytest.param(case, id=case.id, marks=() if not mine <= seen else pytest.mark.slow))
        seen |= mine
    return out


def _routing(case: Case, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    allowed = torch.arange(case.skip_experts, case.num_experts)
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:case.top_k]]
                       for _ in range(case.tokens)]).to(torch.int32)
    weights = torch.rand(case.tokens, case.top_k, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device), weights.to(device)


@dataclass(frozen=True)
class WeightsOf:
    """What a case's random weights are made from: the cases sharing it share the weights (their
    tokens and routing are their own)."""

    weight_key: QuantKey
    activation_key: QuantKey
    num_experts: int
    hidden: int
    intermediate: int
    dtype: str
    bias: bool
    act_order: bool

    @classmethod
    def of(cls, case: Case) -> WeightsOf:
        return cls(case.weight_key, case.activation_key, case.num_experts, case.hidden, case.intermediate,
                   case.dtype, case.bias, case.act_order)

    @property
    def name(self) -> str:
        return (f"{self.weight_key}|{self.activation_key}|E{self.num_experts}H{self.hidden}I{self.intermediate}"
                f"|{self.dtype}|bias={self.bias}|act_order={self.act_order}")


def _stable_seed(text: str) -> int:
    """A seed that is the same in every process (str hashes are salted per process), so a failing
    case's data can be made again."""
    return zlib.crc32(text.encode())


@functools.lru_cache(maxsize=2)
def _random_weights(of: WeightsOf) -> ExpertWeights:
    """Random weights, made once for a run of cases sharing them: at the GPU cases' sizes, making
    them on a CPU thread took most of a case's time (FP4: 6 s). The GPU tests run in order of
    their weights (_by_weights)."""
    from moe_registry_kernels.quant_ref import make_random_expert_weights

    return make_random_expert_weights(of.weight_key, of.activation_key, num_experts=of.num_experts,
                                      hidden=of.hidden, intermediate=of.intermediate, dtype=DTYPES[of.dtype],
                                      bias=of.bias, act_order=of.act_order, seed=_stable_seed(of.name))


def run_case(case: Case, device: torch.device) -> float:
    """Run one case; returns ‖out − ref‖ / ‖ref‖ against the float64 reference."""
    from moe_registry_kernels.reference import reference_moe

    made = _random_weights(WeightsOf.of(case))  # on the CPU; the case gets its own copy, the cache stays as made
    gen = torch.Generator().manual_seed(_stable_seed(case.id))
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(DTYPES[case.dtype])
    if case.linear:
        return _run_linear_case(case, made, x, device)
    ids, topk_w = _routing(case, torch.device("cpu"), gen)
    config = ExpertsConfig(activation=case.activation, apply_router_weight_on_input=case.router_weight_on_input,  # type: ignore[arg-type]
                           activation_format=case.activation_format)  # type: ignore[arg-type]
    cls = experts_class(REGISTRY.kernel(case.kernel))
    pf = (BatchedLocalPrepareFinalize(case.num_experts) if case.activation_format == "batched"
          else LocalPrepareFinalize())
    inputs = x.to(device), topk_w.to(device), ids.to(device)
    on_device = copy.deepcopy(made) if device.type == "cpu" else made.to(device)  # .to copies only across devices
    # the float64 reference on the same device (on a GPU the CPU's float64 GEMMs at realistic sizes, one per
    # pytest worker, were most of a case's time), before the kernel runs: a kernel that wrote into its
    # inputs or weights could not change it
    ref = reference_moe(*inputs, on_device, config, torch.float64)
    assert float(ref.norm()) > 0
    kernel = FusedMoEKernel(pf, cls(on_device, config))
    out = kernel(*inputs)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert bool(torch.isfinite(out).all()), "non-finite output"
    return float((out.double() - ref).norm() / ref.norm())


def _run_linear_case(case: Case, made: ExpertWeights, x: torch.Tensor, device: torch.device) -> float:
    """The kernel's one-projection form on the one expert's gate/up projection [2I, H]: rows x [M, H] against
    the float64 reference (the activation quantised as its key says, times the dequantised weight)."""
    from moe_registry_kernels.reference import reference_linear

    cls = linear_class(REGISTRY.kernel(case.kernel))
    assert cls is not None, f"kernel {case.kernel} has no linear_impl"
    proj = copy.deepcopy(made.w13) if device.type == "cpu" else made.w13.to(device)
    ref = reference_linear(x.to(device), proj, made.weight_key, made.activation_key)
    assert float(ref.norm()) > 0
    out = cls(proj, made.weight_key, made.activation_key).apply(x.to(device))
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert bool(torch.isfinite(out).all()), "non-finite output"
    return float((out.double() - ref).norm() / ref.norm())


def _record_case(record_property: Callable[[str, object], None], case: Case, err: float) -> None:
    """The case's keys and error as the test's user properties: tools/pytest_progress.py logs them
    as each test ends and tabulates the worst error per (scheme, kernel)."""
    for name, value in (("scheme", case.scheme), ("kernel", case.kernel), ("dtype", case.dtype), ("rel_err", err)):
        record_property(name, value)


@pytest.mark.parametrize("case", _ci_or_slow(CPU_CASES))
def test_reference_kernel_conforms(case: Case, record_property) -> None:
    err = run_case(case, torch.device("cpu"))
    _record_case(record_property, case, err)
    assert err <= case.tolerance, f"{case.id}: relative error {err:.3e} > {case.tolerance:.1e}"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("case", _ci_or_slow(INTERPRETER_CASES))
def test_triton_kernel_conforms_in_interpreter(case: Case, record_property) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter run is for machines without a GPU; use -m gpu")
    err = run_case(case, torch.device("cpu"))
    _record_case(record_property, case, err)
    assert err <= case.tolerance, f"{case.id}: relative error {err:.3e} > {case.tolerance:.1e}"


def _by_weights(cases: list[Case]) -> list[Case]:
    """The cases in order of their WeightsOf: pytest-xdist hands each worker runs of consecutive
    tests, so the cases sharing weights mostly run on one worker in turn and make them once
    (a simulation of xdist's scheduling over the GPU tests: 204 weight sets made, against 717 in
    collection order and 1300 with no cache). xdist's --dist loadgroup would group them exactly,
    but under pytest 9 it groups nothing (it renames items through a field pytest 9 no longer reads)."""
    return sorted(cases, key=lambda c: WeightsOf.of(c).name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _by_weights(GPU_CASES), ids=lambda c: c.id)
def test_kernel_conforms_on_gpu(case: Case, record_property) -> None:
    err = run_case(case, torch.device("cuda"))
    _record_case(record_property, case, err)
    assert err <= case.tolerance, f"{case.id}: relative error {err:.3e} > {case.tolerance:.1e}"


def test_every_scheme_has_cases() -> None:
    schemes = {c.scheme for c in CPU_CASES}
    assert schemes == set(REGISTRY.schemes)
    assert len(SMALL.tokens) >= 1 and len(CPU_CASES) > 3 * len(REGISTRY.schemes)


def test_cases_sharing_weights_make_them_once_and_get_their_own_copy(monkeypatch) -> None:
    """Two cases of one WeightsOf (other tokens, other kernel) make the weights once; what a run
    does to the weights it was handed (here: zeroed after the reference) reaches neither the cache
    nor the other case, and a case run again gives the same error (its data from stable seeds)."""
    import moe_registry_kernels.quant_ref as quant_ref
    import moe_registry_kernels.reference as reference

    first = next(c for c in CPU_CASES if c.kernel == "torch-reference" and c.weight_key.quantized)
    second = next(c for c in CPU_CASES if c.id != first.id and c.kernel != first.kernel
                  and c.tokens != first.tokens and WeightsOf.of(c) == WeightsOf.of(first))
    _random_weights.cache_clear()
    made = []
    real_make, real_reference = quant_ref.make_random_expert_weights, reference.reference_moe
    monkeypatch.setattr(quant_ref, "make_random_expert_weights", lambda *a, **k: made.append(1) or real_make(*a, **k))
    err = run_case(first, torch.device("cpu"))
    cached = _random_weights(WeightsOf.of(first))
    kept = cached.w13.weight.clone()

    def reference_then_zero(hidden, topk_weights, topk_ids, weights, *args, **kwargs):
        out = real_reference(hidden, topk_weights, topk_ids, weights, *args, **kwargs)
        weights.w13.weight.zero_()
        return out

    monkeypatch.setattr(reference, "reference_moe", reference_then_zero)
    run_case(second, torch.device("cpu"))
    monkeypatch.setattr(reference, "reference_moe", real_reference)
    assert made == [1]
    assert torch.equal(cached.w13.weight, kept) and kept.any()
    assert run_case(first, torch.device("cpu")) == err
    _random_weights.cache_clear()


@pytest.mark.parametrize("cases", [CPU_CASES, INTERPRETER_CASES], ids=["cpu", "interpreter"])
def test_ci_runs_every_pair_and_code_path(cases: list[Case]) -> None:
    """What the `slow` marker leaves to tools/run_slow_tests.sh loses no coverage: the cases CI
    runs hold every (scheme, kernel) pair and every weight and option path of all the cases."""
    ci = [p.values[0] for p in _ci_or_slow(cases) if not p.marks]
    assert {(c.scheme, c.kernel) for c in ci} == {(c.scheme, c.kernel) for c in cases}
    for which in (0, 1):
        assert {_code_paths(c)[which] for c in ci} == {_code_paths(c)[which] for c in cases}


# ---------------------------------------------------------------------------------------------
# tuned configs: every config shipped in kernels/configs runs the conformance cases of its keys


def _tuned_config_cases(cases: list[Case]) -> list[tuple[str, Case, dict, dict]]:
    """(id, case, GEMM1 config, GEMM2 config) for each distinct tuned pair of each shipped file,
    run on the standard-format cases whose keys the file is for."""
    import json
    from pathlib import Path

    from moe_registry.core.keys import parse_quant_key

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


def _tuned_ci_or_slow(tuned: list[tuple[str, Case, dict, dict]]) -> list:
    """Per shipped file, CI runs the first pair of tile configs for each kernel code path they
    choose: swapped operands or not (each GEMM), split-K or not (GEMM2), BLOCK_M <= 32 and K tiles
    that divide the weight group (what the factored dot needs), one dot per weight group or not
    (GROUP_DOTS); the other pairs (the same code with other block sizes) are slow. Every pair runs
    on a GPU (test_tuned_configs_conform_on_gpu)."""
    def path(config: dict, group: int) -> tuple:
        return (bool(config.get("SWAP_AB")), config.get("SPLIT_K", 1) > 1, config["BLOCK_M"] <= 32,
                group > 0 and group % config["BLOCK_K"] == 0, bool(config.get("GROUP_DOTS")))

    seen: set = set()
    out = []
    for t in tuned:
        name, case, config1, config2 = t
        group = case.weight_key.scale.group.cols if case.weight_key.quantized else 0
        key = (name.rsplit("-", 1)[0], path(config1, group), path(config2, group))
        out.append(pytest.param(t, id=name, marks=() if key not in seen else pytest.mark.slow))
        seen.add(key)
    return out


def test_ci_runs_a_tuned_pair_of_every_shipped_file() -> None:
    every = {t[0].rsplit("-", 1)[0] for t in TUNED_CPU}
    assert {p.id.rsplit("-", 1)[0] for p in _tuned_ci_or_slow(TUNED_CPU) if not p.marks} == every


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("tuned", _tuned_ci_or_slow(TUNED_CPU))
def test_tuned_configs_conform_in_interpreter(tuned) -> None:
    from moe_registry_kernels.triton.tile_config import config_override

    if torch.cuda.is_available():
        pytest.skip("the interpreter run is for machines without a GPU; use -m gpu")
    _, case, config1, config2 = tuned
    with config_override(config1, config2):
        err = run_case(case, torch.device("cpu"))
    assert err <= case.tolerance, f"{case.id} with {config1} / {config2}: relative error {err:.3e}"


TUNED_GPU = _tuned_config_cases([c for c in GPU_CASES if c.dtype == "bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("tuned", sorted(TUNED_GPU, key=lambda t: WeightsOf.of(t[1]).name), ids=lambda t: t[0])
def test_tuned_configs_conform_on_gpu(tuned, record_property) -> None:
    from moe_registry_kernels.triton.tile_config import config_override

    _, case, config1, config2 = tuned
    with config_override(config1, config2):
        err = run_case(case, torch.device("cuda"))
    _record_case(record_property, case, err)
    assert err <= case.tolerance, f"{case.id} with {config1} / {config2}: relative error {err:.3e}"


def test_a_kernels_classes_are_imported_and_checked_against_their_interfaces() -> None:
    """``impl`` names an Experts class and ``linear_impl`` a Linear one; a class of the other interface, or one
    that does not import, is one line naming the kernel, the field and the class."""
    from moe_registry.core.errors import ConfigError

    dot8 = REGISTRY.kernel("torch-cpu-dot8")

    def with_fields(**changed: object) -> KernelSpec:
        return type(dot8)(**{**{name: getattr(dot8, name) for name in dot8.FIELDS}, **changed})

    assert experts_class(dot8).__name__ == "Dot8Experts" and linear_class(dot8).__name__ == "Dot8Linear"  # type: ignore[union-attr]
    assert linear_class(REGISTRY.kernel("torch-reference")) is None
    swapped = with_fields(impl=dot8.linear_impl, linear_impl=dot8.impl)
    with pytest.raises(ConfigError, match=r"^kernel torch-cpu-dot8: impl moe_registry_kernels\.cpu_dot8:Dot8Linear "
                                          r"is not an Experts class$"):
        experts_class(swapped)
    with pytest.raises(ConfigError, match=r"^kernel torch-cpu-dot8: linear_impl moe_registry_kernels\.cpu_dot8:"
                                          r"Dot8Experts is not a Linear class$"):
        linear_class(swapped)
    missing = with_fields(linear_impl="moe_registry_kernels.cpu_dot8:NoSuchLinear")
    with pytest.raises(ConfigError, match=r"^kernel torch-cpu-dot8: linear_impl moe_registry_kernels\.cpu_dot8:"
                                          r"NoSuchLinear cannot be imported: "):
        linear_class(missing)
