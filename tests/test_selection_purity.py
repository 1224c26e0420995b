"""Pure selection: the machine is probed once, when the situation is built;
predicates read that value; the report records how the kernel was chosen as data."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from moe_registry.core.checks import Reason
from moe_registry.oracle.select import select
from moe_registry.oracle.verdicts import SelectedBy
from moe_registry.situation import describe as situation_module
from moe_registry.situation.describe import Flags, situation_for
from moe_registry.situation.runtime import Environment, Platform
from moe_registry.spec.loader import load_registry

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "configs" / "qwen-moe" / "qwen3-30b-a3b-fp8"


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def _no_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("selection probed the machine")

    monkeypatch.setattr(importlib.util, "find_spec", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)


def test_auto_probes_once_and_selection_only_reads_it(registry, monkeypatch):
    calls = []
    monkeypatch.setattr(situation_module, "probe_platform",
                        lambda: calls.append("platform") or Platform("cuda", (9, 0), "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(situation_module, "probe_environment",
                        lambda packages: calls.append(tuple(sorted(packages))) or Environment(frozenset({"torch"})))
    situation = situation_for(CONFIG, registry, Flags(platform="auto"))
    assert calls == ["platform", ("torch", "triton")]  # the packages the kernel specs name, asked once
    _no_probing(monkeypatch)
    report = select(registry, situation)
    triton = report.verdict("triton-fused-moe")
    assert triton is not None and not triton.eligible
    assert [c.reason for c in triton.failures] == [Reason.PACKAGE_MISSING]
    assert report.chosen == "torch-reference"


def test_an_environment_with_the_packages_lets_the_kernel_run(registry, monkeypatch):
    situation = situation_for(CONFIG, registry, Flags(platform="cuda:9.0"))
    installed = Environment(frozenset({"torch", "triton"}))
    here = replace(situation, runtime=replace(situation.runtime, environment=installed))
    _no_probing(monkeypatch)
    assert select(registry, here).chosen == "triton-fused-moe"
    # a named platform is not this machine: requirements are reported, not checked
    check = next(c for c in select(registry, situation).verdict("triton-fused-moe").checks
                 if c.field == "requires_packages")
    assert check.passed and "not checked" in check.message


@pytest.mark.parametrize(("pin", "prefer", "platform", "selected_by", "chosen"), [
    (None, None, "cuda:9.0", SelectedBy.PREFERENCE, "triton-fused-moe"),
    ("torch-reference", None, "cuda:9.0", SelectedBy.PIN, "torch-reference"),
    (None, "torch-reference", "cuda:9.0", SelectedBy.PREFER, "torch-reference"),
    (None, "triton-fused-moe", "rocm:9.4", SelectedBy.FALLBACK, "torch-reference"),
])
def test_the_report_records_how_the_kernel_was_chosen(registry, pin, prefer, platform, selected_by, chosen):
    report = select(registry, situation_for(CONFIG, registry, Flags(platform=platform)), pin=pin, prefer=prefer)
    assert (report.selected_by, report.chosen, report.requested) == (selected_by, chosen, pin or prefer)
    data = json.loads(report.to_json())
    assert (data["selected_by"], data["chosen_kernel"], data["requested"]) == (selected_by.value, chosen, pin or prefer)


def test_a_failed_pin_is_recorded_with_no_kernel(registry):
    report = select(registry, situation_for(CONFIG, registry, Flags(platform="cpu")), pin="triton-fused-moe",
                    raise_on_failure=False)
    assert (report.selected_by, report.chosen, report.requested) == (SelectedBy.PIN, None, "triton-fused-moe")
