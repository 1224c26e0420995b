"""The package's install requirements fit every machine: triton (no wheel for macOS or Windows, hundreds
of MB on a CPU box) is no hard dependency; the `triton` extra and the dev extra (the interpreter tests)
bring it only where triton publishes wheels. Read from pyproject.toml, markers evaluated per machine."""

from __future__ import annotations

from pathlib import Path

import tomllib
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
MACHINES = {  # PEP 508 environments: (platform_system, platform_machine, sys_platform)
    "linux x86_64": ("Linux", "x86_64", "linux"),
    "linux aarch64": ("Linux", "aarch64", "linux"),
    "macOS arm64": ("Darwin", "arm64", "darwin"),
    "Windows": ("Windows", "AMD64", "win32"),
}


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def _wanted(requirements: list[str], machine: str, extra: str = "") -> set[str]:
    system, arch, plat = MACHINES[machine]
    env = {"platform_system": system, "platform_machine": arch, "sys_platform": plat, "extra": extra}
    return {r.name for r in map(Requirement, requirements) if r.marker is None or r.marker.evaluate(env)}


def test_triton_is_not_a_hard_dependency():
    deps = _project()["dependencies"]
    for machine in MACHINES:
        assert "triton" not in _wanted(deps, machine), machine
        assert {"torch", "pydantic", "pyyaml", "safetensors", "numpy", "ninja"} <= _wanted(deps, machine)


def test_triton_extra_and_dev_bring_it_only_where_wheels_exist():
    extras = _project()["optional-dependencies"]
    for extra in ("triton", "dev"):
        got = {m: "triton" in _wanted(extras[extra], m, extra) for m in MACHINES}
        assert got == {"linux x86_64": True, "linux aarch64": True, "macOS arm64": False, "Windows": False}, extra
    assert {"pytest", "ruff"} <= _wanted(extras["dev"], "macOS arm64", "dev")


def test_without_triton_each_triton_kernel_says_why_in_one_line():
    """A machine without triton (macOS, Windows, a CPU box with torch's CPU wheel): the oracle reads the kernel
    specs' requires_packages and rejects each Triton kernel with one reason; another kernel runs the layer."""
    from dataclasses import replace

    from moe_registry.oracle.select import select
    from moe_registry.situation.describe import Flags, situation_for
    from moe_registry.situation.runtime import Environment
    from moe_registry.spec.loader import load_registry

    registry = load_registry()
    config = PYPROJECT.parent / "examples/configs/mixtral/mixtral-8x7b-instruct-v0.1-awq"
    situation = situation_for(config, registry, Flags(platform="cuda:9.0"))
    here = Environment(installed=frozenset({"torch"}), commands=frozenset({"c++", "ninja"}))
    report = select(registry, replace(situation, runtime=replace(situation.runtime, environment=here)))
    for kernel in ("triton-fused-moe", "triton-batched-moe"):
        verdict = report.verdict(kernel)
        assert verdict is not None and not verdict.eligible
        assert "package triton is not installed" in [c.message for c in verdict.failures]
    assert report.chosen == "torch-reference"
