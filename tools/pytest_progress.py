"""A pytest plugin for the GPU test runs that a device call's time limit cuts off (tools/gpu_run.sh
tests): each finished test goes to a JSON-lines log as it ends, with what it recorded (a conformance
case's relative error) and why it did not pass, so a killed run keeps what it ran (a module skipped
or failing whole at collection is one record, so the log accounts for every test pytest counts);
``--progress-resume`` deselects the tests the log holds as passed, so the next call runs only the
rest. Run as a script, it summarises a log.

    PYTHONPATH=tools python -m pytest -p pytest_progress --progress-log OUT/gpu_tests.jsonl [--progress-resume] ...
    python tools/pytest_progress.py OUT/gpu_tests.jsonl      # outcomes, failures, conformance errors
"""

from __future__ import annotations

import collections
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from json_lines import read_json_lines

# the user properties a conformance case records (tests/test_conformance.py), read by the summary
CASE_PROPERTIES = ("scheme", "kernel", "dtype", "rel_err")


@dataclass(frozen=True)
class Finished:
    """One test as the log holds it."""

    nodeid: str  # a test's, or a module's that was skipped or failed whole at collection
    outcome: str  # passed, failed, skipped, or error (setup, teardown or collection failed)
    seconds: float
    properties: dict
    reason: str = ""  # why it was skipped or did not pass, one line


def read_log(path: Path) -> list[Finished]:
    """The tests a log holds, the last record of a test winning (a resumed run appends)."""
    latest: dict[str, Finished] = {}
    for number, record in enumerate(read_json_lines(path), 1):
        try:
            finished = Finished(record["nodeid"], record["outcome"], float(record["seconds"]),
                                dict(record.get("properties", {})), str(record.get("reason", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: record {number}: not a test record ({e!r})") from None
        latest[finished.nodeid] = finished
    return list(latest.values())


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pytest_progress", "a log of finished tests, kept when the run is killed")
    group.addoption("--progress-log", type=Path, default=None, help="JSON-lines log, a line per finished test")
    group.addoption("--progress-resume", action="store_true",
                    help="append to --progress-log and deselect the tests it holds as passed")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--progress-log")
    resume = config.getoption("--progress-resume")
    if path is None:
        if resume:
            raise pytest.UsageError("--progress-resume needs --progress-log")
        return
    if resume and not path.is_file():
        raise pytest.UsageError(f"--progress-resume: {path} does not exist (copy the earlier run's log there)")
    passed: set[str] = set()
    if resume:
        try:
            passed = {t.nodeid for t in read_log(path) if t.outcome == "passed"}
        except ValueError as e:
            raise pytest.UsageError(f"--progress-resume: {e}") from None
    # under pytest-xdist each worker collects (and deselects); only the controller, which gets
    # every worker's reports, writes the log
    writer = None if hasattr(config, "workerinput") else _LogWriter(path, append=resume)
    config.pluginmanager.register(_Progress(passed, writer), "pytest_progress_run")


class _LogWriter:
    def __init__(self, path: Path, *, append: bool) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not append:
            path.write_text("")
        self.path = path

    def write(self, finished: Finished) -> None:
        with self.path.open("a") as f:  # a line at a time: a kill loses at most the line being written
            f.write(json.dumps({"nodeid": finished.nodeid, "outcome": finished.outcome,
                                "seconds": round(finished.seconds, 3), "properties": finished.properties,
                                "reason": finished.reason}) + "\n")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """One line on why a test or module was skipped or did not pass: the skip's message, else the
    first ``E`` line of the failure (its last line where there is none)."""
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):  # (path, line, "Skipped: message")
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    lines = [line.strip() for line in report.longreprtext.splitlines() if line.strip()]
    errors = [line.removeprefix("E").strip() for line in lines if line.startswith("E ")]
    if errors:
        return errors[0]
    return lines[-1] if lines else ""


class _Progress:
    def __init__(self, passed: set[str], writer: _LogWriter | None) -> None:
        self.passed, self.writer = passed, writer

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        done = [item for item in items if item.nodeid in self.passed]
        if done:
            config.hook.pytest_deselected(items=done)
            items[:] = [item for item in items if item.nodeid not in self.passed]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.writer is None:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "error" if report.when == "setup" and report.failed else report.outcome
        elif report.when == "teardown" and report.failed:
            outcome = "error"
        else:
            return
        self.writer.write(Finished(report.nodeid, outcome, report.duration, dict(report.user_properties),
                                   _reason(report)))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # a module skipped whole (importorskip) or failing to import runs none of its tests: logged
        # as one record, so the log accounts for pytest's own count (xdist's controller hears each once)
        if self.writer is not None and not report.passed:
            self.writer.write(Finished(report.nodeid, "skipped" if report.skipped else "error", 0.0, {},
                                       _reason(report)))

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        # under xdist the workers deselect, and the controller's summary line would not say so
        if self.writer is not None and self.passed:
            terminalreporter.write_line(f"pytest_progress: {len(self.passed)} tests that {self.writer.path} "
                                        "holds as passed were not run again")


def summary(tests: list[Finished]) -> str:
    """Outcome counts, the tests that did not pass (with why), the skips counted by reason, and per
    (scheme, kernel) the conformance cases run and their worst relative error."""
    counts = collections.Counter(t.outcome for t in tests)
    lines = [", ".join(f"{counts[o]} {o}" for o in ("passed", "failed", "error", "skipped") if counts[o])
             or "no tests finished"]
    lines += [f"{t.outcome.upper():<7} {t.nodeid}" + (f": {t.reason}" if t.reason else "")
              for t in tests if t.outcome in ("failed", "error")]
    skips = collections.Counter(t.reason or "(no reason given)" for t in tests if t.outcome == "skipped")
    lines += [f"SKIPPED {n:>4}  {reason}" for reason, n in sorted(skips.items())]
    cases = [t for t in tests if t.outcome != "skipped" and all(p in t.properties for p in CASE_PROPERTIES)]
    if cases:
        worst: dict[tuple[str, str], float] = collections.defaultdict(float)
        run = collections.Counter()
        for t in cases:
            key = t.properties["scheme"], t.properties["kernel"]
            run[key] += 1
            worst[key] = max(worst[key], float(t.properties["rel_err"]))
        lines.append(f"{'scheme':<40}{'kernel':<22}{'cases':>6}{'worst rel err':>15}")
        lines += [f"{s:<40}{k:<22}{run[s, k]:>6}{worst[s, k]:>15.2e}" for s, k in sorted(run)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python tools/pytest_progress.py LOG.jsonl", file=sys.stderr)
        return 2
    try:
        print(summary(read_log(Path(args[0]))))
    except (OSError, ValueError) as e:
        print(f"pytest_progress.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
