"""Every code block of README.md runs: python blocks are executed, bash blocks run line by line with the
package's commands on PATH, a text block that starts with ``$ command`` is that command's real output, and
the main job is the block .ci/readme_main_job.sh runs verbatim in CI. A block that cannot run here says
so in an HTML comment on the line before it (``<!-- readme-test: skip (why) -->``), and few do.

The blocks run in a scratch directory laid out as the checkout is after the main job: ``examples/``
(the committed configs) with ``examples/checkpoints/`` made by tools/make_examples.py, and ``tests/`` (the
committed fixtures).
"""

from __future__ import annotations

import fnmatch
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip \((?P<why>[^)]+)\) -->")
MAIN_JOB = "<!-- main-job"
MAX_SKIPPED = 3


@dataclass(frozen=True)
class Block:
    line: int  # the opening fence's line number
    lang: str
    text: str
    marker: str  # the HTML comment on the line before the fence, or ""

    @property
    def id(self) -> str:
        return f"README.md:{self.line}:{self.lang}"


def blocks(text: str) -> list[Block]:
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[i - 1].strip() if i > 0 else ""
        out.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1:end]), before if before.startswith("<!--") else ""))
        i = end + 1
    return out


BLOCKS = blocks(README.read_text())


def kind(block: Block) -> str:
    if block.marker.startswith(MAIN_JOB):
        return "main-job"
    if SKIP.fullmatch(block.marker):
        return "skip"
    if block.lang == "python":
        return "python"
    if block.lang == "bash":
        return "bash"
    if block.lang == "text" and block.text.startswith("$ "):
        return "output"
    return "untested"


def of_kind(name: str) -> list[Block]:
    return [b for b in BLOCKS if kind(b) == name]


def test_every_block_is_run_and_few_are_skipped():
    assert [b.id for b in BLOCKS if kind(b) == "untested"] == []
    assert len(of_kind("skip")) <= MAX_SKIPPED
    assert of_kind("python") and of_kind("bash") and of_kind("output") and len(of_kind("main-job")) == 1


def test_the_main_job_is_the_command_ci_runs_verbatim():
    """.ci/run runs .ci/readme_main_job.sh, which takes the one command between the main-job markers."""
    assert "bash .ci/readme_main_job.sh" in (ROOT / ".ci" / "run").read_text()
    script = (ROOT / ".ci" / "readme_main_job.sh").read_text()
    assert "/^<!-- main-job/" in script and r"/^<!-- \/main-job -->/" in script
    text = README.read_text()
    between = text.split("\n" + MAIN_JOB, 1)[1].split("\n<!-- /main-job -->", 1)[0]
    commands = [ln for ln in between.splitlines()[1:]
                if ln.strip() and not ln.startswith("```") and not ln.lstrip().startswith("#")]
    block = of_kind("main-job")[0]
    assert len(commands) == 1 and commands[0] in block.text.splitlines()


def test_the_readme_writes_no_count_by_hand():
    """Counts of what the registry knows change with the specs: the README names the command that lists them."""
    counted = re.findall(r"\b\d+ (?:MoE )?(?:model types|families|schemes|kernels)\b", README.read_text())
    assert counted == []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch dir laid out as the checkout after the main job: the committed examples, and the
    example checkpoints the blocks name, made by tools/make_examples.py."""
    sys.path.insert(0, str(ROOT / "tools"))
    from make_examples import make_example

    work = tmp_path_factory.mktemp("readme")
    examples = work / "examples"
    (examples / "checkpoints").mkdir(parents=True)
    for entry in (ROOT / "examples").iterdir():
        if entry.name != "checkpoints":
            (examples / entry.name).symlink_to(entry)
    (work / "tests").symlink_to(ROOT / "tests")  # the committed fixtures the whole-model blocks load
    for name in sorted(set(re.findall(r"examples/checkpoints/([\w.-]+)", README.read_text()))):
        make_example(name, examples / "checkpoints")
    return work


def shell_env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("block", of_kind("python"), ids=lambda b: b.id)
def test_python_block_runs(block: Block, workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.chdir(workdir)
    script = workdir / f"block_{block.line}.py"
    script.write_text(block.text + "\n")
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    # a comment after print(...) shows the output: it must be what the block prints
    for shown in re.findall(r"^print\(.*\)\s+# (.+)$", block.text, re.M):
        assert shown in printed


@pytest.mark.parametrize("block", of_kind("bash"), ids=lambda b: b.id)
def test_bash_block_runs(block: Block, workdir: Path):
    for command in [ln for ln in block.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=workdir, env=shell_env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{command}: exit {result.returncode}\n{result.stderr}"
        assert result.stdout.strip(), f"{command}: printed nothing"


@pytest.mark.parametrize("block", of_kind("output"), ids=lambda b: b.id)
def test_shown_output_is_the_commands_output(block: Block, workdir: Path):
    first, *shown = block.text.splitlines()
    result = subprocess.run(shlex.split(first[2:]), cwd=workdir, env=shell_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n").splitlines() == shown


def test_every_tool_is_in_the_reference():
    """docs/cli.md's tools table names every script in tools/ (by name or pattern): a tool nobody lists is
    one nobody maintains."""
    table = (ROOT / "docs" / "cli.md").read_text().split("\n## Tools\n", 1)[1]
    listed = set(re.findall(r"`([\w*.-]+\.(?:py|sh))`", table))
    tracked = subprocess.run(["git", "ls-files", "tools"], cwd=ROOT, capture_output=True, text=True, check=True)
    tools = [Path(p).name for p in tracked.stdout.split()]
    assert tools and [t for t in tools if not any(fnmatch.fnmatch(t, pattern) for pattern in listed)] == []
