"""The package layout shows the flow: each stage imports only the stages below it, and no module
imports another that imports it back (docs/design.md, "Stages"; each sub-package's docstring says what it
may import)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import moe_registry

PACKAGE = Path(moe_registry.__file__).parent
# stage -> rank; a module may import its own stage and any stage of a lower rank
STAGES = {"core": 0, "spec": 1, "situation": 2, "oracle": 3, "checkpoint": 4, "formats": 5, "layer": 6, "whole": 7,
          "cli": 8, "testing": 8}
KERNEL_IMPORTS = {"moe_registry.core", "moe_registry.formats", "moe_registry.layer"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (imports for type hints only)."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, *, types_too: bool = False) -> set[str]:
    """Every moe_registry module ``path`` imports at run time, at the top or inside a function (``types_too``:
    and under ``if TYPE_CHECKING:``, for type hints only)."""
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in (ast.walk(tree) if types_too else _runtime_nodes(tree)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    modules = _modules()
    return {name for name in found if name in modules and name.startswith("moe_registry.")}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_every_module_lives_in_a_stage() -> None:
    loose = [m for m in _modules() if m.count(".") == 1 and _stage(m) is None and m != "moe_registry.__main__"]
    assert loose == []


@pytest.mark.parametrize("module", sorted(m for m in _modules() if _stage(m)))
def test_stage_imports_only_lower_stages(module: str) -> None:
    own = STAGES[_stage(module)]  # type: ignore[index]
    upward = sorted(i for i in _imports(_modules()[module], types_too=True) if _stage(i) and STAGES[_stage(i)] > own)  # type: ignore[index]
    assert upward == [], f"{module} (stage {_stage(module)}) imports a higher stage: {upward}"


def test_no_import_cycles() -> None:
    """Not even for type hints: a module that must name another's types while that one imports it is two
    concepts in the wrong rooms."""
    graph = {m: _imports(p, types_too=True) - {m} for m, p in _modules().items()}
    # a package's __init__ is not a dependency of its modules' cycle analysis unless it imports them
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_kernels_import_only_the_layer_contract() -> None:
    """The compute (kernels/) sees QuantKeys, the weight layout and the Experts interface only."""
    kernels = Path(moe_registry.__file__).parent.parent / "kernels"
    assert kernels.is_dir(), "the tests run from the source tree (pip install -e .)"
    seen = set()
    for path in kernels.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_registry."):
                seen.add(".".join(node.module.split(".")[:2]))
    assert seen <= KERNEL_IMPORTS, seen - KERNEL_IMPORTS


def test_no_private_name_crosses_a_stage() -> None:
    """A stage uses another's public names only: a private one (``_name``) is that stage's to change."""
    crossing = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_registry."):
                if _stage(node.module) == _stage(module):
                    continue
                crossing += [f"{module} imports {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []
