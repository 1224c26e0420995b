"""tools/pytest_progress.py, the log of finished tests that GPU runs cut off by a device call's
time limit keep (tools/gpu_run.sh tests): run on small test files in a pytest subprocess, with and
without pytest-xdist workers, killed, resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pytest_progress import main, read_log, summary

TOOLS = Path(__file__).resolve().parent.parent / "tools"

TESTS = '''
import pytest

@pytest.mark.parametrize("n", range(4))
def test_passes(n, record_property):
    record_property("scheme", f"s{n % 2}")
    record_property("kernel", "k")
    record_property("dtype", "bfloat16")
    record_property("rel_err", 1e-3 * (n + 1))

def test_fails():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("setup")

def test_setup_error(broken):
    pass

def test_skipped():
    pytest.skip("no")
'''


# pytest as tools/gpu_run.sh runs it, the plugin importable from tools/
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-p", "pytest_progress"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TOOLS), os.environ.get("PYTHONPATH", "")])}


def _pytest(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PYTEST, *args], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=timeout)


def _outcomes(log: Path) -> dict[str, str]:
    return {t.nodeid: t.outcome for t in read_log(log)}


# a module skipped whole at collection: pytest counts it among the skipped, and so does the log
GONE = 'import pytest\npytest.importorskip("no_such_module_xyz")\n\ndef test_never():\n    pass\n'

WANT = {**{f"test_some.py::test_passes[{n}]": "passed" for n in range(4)}, "test_some.py::test_fails": "failed",
        "test_some.py::test_setup_error": "error", "test_some.py::test_skipped": "skipped",
        "test_gone.py": "skipped"}


def _write_tests(tmp_path: Path) -> None:
    (tmp_path / "test_some.py").write_text(TESTS)
    (tmp_path / "test_gone.py").write_text(GONE)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_each_finished_test_is_logged_once_with_its_properties(tmp_path, workers):
    _write_tests(tmp_path)
    log = tmp_path / "out" / "gpu_tests.jsonl"
    result = _pytest(tmp_path, "--progress-log", str(log), *workers)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 4 passed, 2 skipped, 1 error" in result.stdout  # pytest's count, the log's below
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(r["nodeid"] for r in lines) == sorted(WANT)  # once each: the workers write nothing
    assert _outcomes(log) == WANT
    props = {t.nodeid: t.properties for t in read_log(log)}
    assert props["test_some.py::test_passes[2]"] == {"scheme": "s0", "kernel": "k", "dtype": "bfloat16",
                                                     "rel_err": 3e-3}
    assert props["test_some.py::test_fails"] == {}


def test_a_resumed_run_runs_only_what_did_not_pass_and_appends(tmp_path):
    _write_tests(tmp_path)
    log = tmp_path / "gpu_tests.jsonl"
    _pytest(tmp_path, "--progress-log", str(log))
    first = log.read_text()
    result = _pytest(tmp_path, "--progress-log", str(log), "--progress-resume", "-n", "2")
    assert f"pytest_progress: 4 tests that {log} holds as passed were not run again" in result.stdout, result.stdout
    assert log.read_text().startswith(first)
    rerun = [json.loads(line)["nodeid"] for line in log.read_text()[len(first):].splitlines()]
    assert sorted(rerun) == sorted(n for n, o in WANT.items() if o != "passed")
    assert _outcomes(log) == WANT
    # a fresh run (no --progress-resume) starts the log again
    _pytest(tmp_path, "--progress-log", str(log), "test_some.py", "-k", "fails")
    assert list(_outcomes(log)) == ["test_some.py::test_fails"]


def test_a_run_interrupted_by_its_time_limit_keeps_what_finished_and_resume_runs_the_rest(tmp_path):
    """As tools/gpu_run.sh runs it: pytest with xdist workers under ``timeout``, here at its worst, the
    kill it sends the whole process group when the interrupt did not end the run in time (under
    load, xdist's workers may finish their tests first: CI)."""
    (tmp_path / "test_slow.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.parametrize('n', range(8))\n"
        "def test_slow(n):\n"
        "    time.sleep(0.05 if n < 2 else 60)\n")
    log = tmp_path / "gpu_tests.jsonl"
    proc = subprocess.Popen([*PYTEST, "--progress-log", str(log), "-n", "2"], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_outcomes(log) if log.is_file() else {}) < 2:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert _outcomes(log) == {"test_slow.py::test_slow[0]": "passed", "test_slow.py::test_slow[1]": "passed"}
    (tmp_path / "test_slow.py").write_text(  # the rest, fast this time
        "import pytest\n@pytest.mark.parametrize('n', range(8))\ndef test_slow(n):\n    pass\n")
    result = _pytest(tmp_path, "--progress-log", str(log), "--progress-resume")
    assert result.returncode == 0 and "6 passed, 2 deselected" in result.stdout, result.stdout
    assert set(_outcomes(log).values()) == {"passed"} and len(_outcomes(log)) == 8


def test_resume_refuses_a_missing_or_broken_log_by_message(tmp_path):
    _write_tests(tmp_path)
    log = tmp_path / "gpu_tests.jsonl"
    result = _pytest(tmp_path, "--progress-log", str(log), "--progress-resume")
    assert f"--progress-resume: {log} does not exist (copy the earlier run's log there)" in result.stderr
    log.write_text('{"nodeid": "a", "outcome": "passed", "seconds": 1}\nnot json\n{"nodeid": "b"')
    result = _pytest(tmp_path, "--progress-log", str(log), "--progress-resume")
    assert f"--progress-resume: {log}:2: not a JSON line" in result.stderr
    log.write_text('{"nodeid": "a", "outcome": "passed"}\n')
    result = _pytest(tmp_path, "--progress-log", str(log), "--progress-resume")
    assert f"--progress-resume: {log}: record 1: not a test record (KeyError('seconds'))" in result.stderr
    result = _pytest(tmp_path, "--progress-resume")
    assert "--progress-resume needs --progress-log" in result.stderr


def test_a_log_cut_off_mid_line_reads_up_to_the_cut(tmp_path):
    log = tmp_path / "gpu_tests.jsonl"
    log.write_text('{"nodeid": "a", "outcome": "failed", "seconds": 1}\n'
                   '{"nodeid": "a", "outcome": "passed", "seconds": 2}\n{"nodeid": "b", "outc')
    assert [(t.nodeid, t.outcome, t.seconds) for t in read_log(log)] == [("a", "passed", 2.0)]


def test_summary_counts_outcomes_lists_failures_and_tabulates_the_worst_case_error(tmp_path, capsys):
    _write_tests(tmp_path)
    log = tmp_path / "gpu_tests.jsonl"
    _pytest(tmp_path, "--progress-log", str(log))
    assert main([str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "4 passed, 1 failed, 1 error, 2 skipped"
    assert lines[1:3] == ["FAILED  test_some.py::test_fails: assert False",
                          "ERROR   test_some.py::test_setup_error: RuntimeError: setup"]
    assert lines[3:5] == ["SKIPPED    1  could not import 'no_such_module_xyz': No module named 'no_such_module_xyz'",
                          "SKIPPED    1  no"]
    assert lines[5].split() == ["scheme", "kernel", "cases", "worst", "rel", "err"]
    assert [line.split() for line in lines[6:]] == [["s0", "k", "2", "3.00e-03"], ["s1", "k", "2", "4.00e-03"]]
    assert summary([]) == "no tests finished"
    assert main([str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_module_that_fails_to_import_is_logged_as_an_error_with_its_cause(tmp_path, workers):
    """No test then runs: the log says why rather than holding nothing."""
    (tmp_path / "test_broken.py").write_text("import no_such_module_xyz\n\ndef test_never():\n    pass\n")
    log = tmp_path / "gpu_tests.jsonl"
    result = _pytest(tmp_path, "--progress-log", str(log), *workers)
    assert result.returncode in (1, 2), result.stdout + result.stderr  # interrupted (2); xdist: errors (1)
    assert [(t.nodeid, t.outcome, t.reason) for t in read_log(log)] == [
        ("test_broken.py", "error", "ModuleNotFoundError: No module named 'no_such_module_xyz'")]
