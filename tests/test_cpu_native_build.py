"""The first-use build of a compiled CPU extension (``moe_registry_kernels.cpu_build``), with real processes: a
build killed while its compiler runs, a lock left by a dead process, two first runs at once, a live holder
waited on up to a bound, and a built library loaded without the lock.

The extension here is a tiny C++ file whose header is, while a test needs the compiler to be mid-build, a FIFO:
the compiler blocks reading it until the test writes the header, so "the compiler is running" is a state the
test holds, not a race it hopes to win (a writer can open a FIFO without blocking only once a reader has it)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from moe_registry_kernels import cpu_build
from moe_registry_kernels.cpu_build import Flags

NAME = "moe_registry_build_probe"
HEADER = "#define PROBE_ANSWER 42\n"
SOURCE = '#include "probe_answer.h"\nextern "C" int probe_answer() { return PROBE_ANSWER; }\n'
# one process that loads the extension (building it if needed) and says what it got, as JSON on stdout
CHILD = """
import ctypes, json, sys
from pathlib import Path
from moe_registry_kernels.cpu_build import ExtensionError, Flags, load_extension
source, cache, wait = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]) if sys.argv[3] != "env" else None
try:
    got = load_extension("@NAME@", [source], [Flags(("-O0",))], cache, what="the probe extension", wait_s=wait)
except ExtensionError as err:
    print(json.dumps({"error": str(err)}))
    sys.exit(2)
print(json.dumps({"built": got.built, "answer": ctypes.CDLL(str(got.path)).probe_answer(), "path": str(got.path)}))
""".replace("@NAME@", NAME)
DEADLINE_S = 120.0  # for a child to reach a state (a torch import and a compiler start on a busy machine)


@pytest.fixture
def probe(tmp_path: Path) -> tuple[Path, Path]:
    """(source, cache): the probe's source with its header as a regular file, and an empty cache dir."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe.cpp").write_text(SOURCE)
    (src / "probe_answer.h").write_text(HEADER)
    return src / "probe.cpp", tmp_path / "cache"


def _start(source: Path, cache: Path, wait: str = "60", env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child process in its own process group (so the test can end the compiler it leaves behind)."""
    return subprocess.Popen([sys.executable, "-c", CHILD, str(source), str(cache), wait], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=DEADLINE_S)
    lines = out.strip().splitlines()
    assert len(lines) == 1, f"stdout is not one result line (exit {proc.returncode}): {out!r}; stderr: {err[-2000:]}"
    return json.loads(lines[0]), err


def _run(source: Path, cache: Path, wait: str = "60") -> tuple[dict, str]:
    return _finish(_start(source, cache, wait))


class _BlockingHeader:
    """The probe's header as a FIFO: a compiler that opens it blocks until ``release`` writes the header."""

    def __init__(self, source: Path) -> None:
        self.path = source.parent / "probe_answer.h"
        self.fd: int | None = None

    def wait_for_reader(self) -> None:
        """Return once a compiler has the FIFO open (its write end is then held: the compiler stays blocked)."""
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                return
            except OSError as err:
                assert err.errno == errno.ENXIO, err  # no reader yet
            time.sleep(0.05)
        raise AssertionError("no compiler opened the probe's header")

    def release(self) -> None:
        """Let the blocked compiler go on: write the header and close the FIFO's write end."""
        assert self.fd is not None
        os.write(self.fd, HEADER.encode())
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def regular(self) -> None:
        """The header as a regular file again (a compiler blocked on the FIFO keeps it)."""
        self.path.unlink()
        self.path.write_text(HEADER)


@contextlib.contextmanager
def _compiler_blocked(source: Path) -> Iterator[_BlockingHeader]:
    header = _BlockingHeader(source)
    header.path.unlink()
    os.mkfifo(header.path)
    try:
        yield header
    finally:
        header.close()
        if not header.path.is_file():
            header.regular()


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=DEADLINE_S)


def _stem(source: Path) -> str:
    return f"{NAME}-{cpu_build._digest(NAME, [source], [Flags(('-O0',))])}"


def _wait_for_text(proc: subprocess.Popen, text: str) -> str:
    """Read the child's stderr until a line holds ``text``; returns what was read."""
    seen = ""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        line = proc.stderr.readline()
        seen += line
        if text in line:
            return seen
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"{text!r} never appeared on stderr: {seen[-2000:]}")


def test_a_build_killed_while_the_compiler_runs_leaves_nothing_half_made(probe) -> None:
    """SIGKILL the building process while its compiler runs (as the OOM killer or `timeout -s KILL` would; the
    compiler lives on): no library is left and the dead process's lock is free at once (a wait bound of 0 s
    fails on any wait), so the next run builds, says that the earlier build did not finish, removes the dead
    build's directory and loads; a later run loads the library even while another process holds the lock."""
    source, cache = probe
    stem = _stem(source)
    with _compiler_blocked(source) as header:
        victim = _start(source, cache)
        try:
            header.wait_for_reader()
            os.kill(victim.pid, signal.SIGKILL)  # only the Python process: its compiler is still running
            victim.wait(timeout=DEADLINE_S)
            assert not list(cache.glob("*.so")), "a killed build left a library"
            assert len(list(cache.glob(f"{stem}.build-*"))) == 1  # the dead build's temporary directory
            assert (cache / f"{stem}.lock").read_text() == str(victim.pid)
            header.regular()  # for the next build (the orphaned compiler stays blocked on the FIFO)
            got, err = _run(source, cache, wait="0")
        finally:
            _kill_group(victim)
    assert got["answer"] == 42 and got["built"] is True
    assert f"a build of the probe extension by process {victim.pid} did not finish (that process is gone); " \
           "building it again" in err
    assert (cache / f"{stem}.so").is_file() and not list(cache.glob("*.build-*"))
    assert (cache / f"{stem}.lock").read_text() == ""  # released by a finished build
    import fcntl

    with open(cache / f"{stem}.lock", "w") as held:  # this test process holds the lock: a built library needs none
        fcntl.flock(held, fcntl.LOCK_EX)
        again, err = _run(source, cache, wait="0")
    assert again == {**got, "built": False} and err == ""


def test_the_built_kernel_loads_past_a_stale_lock() -> None:
    """The torch-cpu-native kernel built once, then a lock left behind (its own, naming a process that is gone,
    and torch's file baton where torch would look): the next process loads the kernel at once (a wait bound of
    0 s), compiling nothing and printing nothing."""
    from moe_registry_kernels import cpu_native

    cpu_native.native_ops()  # built once (in CI the session's cache already holds it)
    cache = cpu_native.cache_root() / "extensions"
    locks = list(cache.glob("moe_registry_cpu_moe_*.lock"))
    assert len(locks) == 1
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    locks[0].write_text(str(dead.pid))
    baton = cpu_native.cache_root() / "torch_extensions" / locks[0].name.split("-")[0] / "lock"
    baton.parent.mkdir(parents=True, exist_ok=True)
    baton.touch()
    done = subprocess.run([sys.executable, "-c", "from moe_registry_kernels.cpu_native import native_ops; "
                           "print(native_ops().isa())"], capture_output=True, text=True, timeout=DEADLINE_S,
                          env={**os.environ, cpu_build.WAIT_ENV: "0"})
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.strip() in ("avx2", "scalar")


def test_two_first_runs_at_once_build_once(probe) -> None:
    """Two processes start on an empty cache together: one builds (held mid-compile until the other is seen
    waiting for it), the other waits, saying for whom, and loads the library the first renamed into place."""
    source, cache = probe
    with _compiler_blocked(source) as header:
        runs = [_start(source, cache), _start(source, cache)]
        try:
            header.wait_for_reader()
            lock = cache / f"{_stem(source)}.lock"
            builder = next(p for p in runs if lock.read_text() == str(p.pid))
            waiter = next(p for p in runs if p is not builder)
            said = _wait_for_text(waiter, f"waiting for process {builder.pid} building the probe extension")
            header.release()
            results = {p.pid: _finish(p) for p in runs}
        finally:
            for p in runs:
                _kill_group(p)
    assert {pid: r["built"] for pid, (r, _) in results.items()} == {builder.pid: True, waiter.pid: False}
    assert [r["answer"] for r, _ in results.values()] == [42, 42]
    assert f"(lock {lock};" in said
    assert "compiling" not in said + results[waiter.pid][1]


def test_a_live_holder_is_waited_on_up_to_the_bound_then_one_line(probe) -> None:
    """A build that outlasts the wait bound (``MOE_REGISTRY_BUILD_WAIT``): the waiter prints progress naming the
    holder, then exits with one line naming the lock, the holder and what to do; the holder finishes untouched."""
    source, cache = probe
    with _compiler_blocked(source) as header:
        holder = _start(source, cache)
        try:
            header.wait_for_reader()
            waiter = _start(source, cache, wait="env", env={cpu_build.WAIT_ENV: "1.5"})
            got, err = _finish(waiter)
            header.release()
            built, _ = _finish(holder)
        finally:
            _kill_group(holder)
    lock = cache / f"{_stem(source)}.lock"
    assert waiter.returncode == 2
    assert got["error"] == (f"process {holder.pid} has held the build lock {lock} for more than 1.5 s, building the "
                            f"probe extension; wait for it to finish, if it is stuck, stop it (kill {holder.pid}) "
                            f"and run again, or wait longer with {cpu_build.WAIT_ENV}=<seconds>")
    assert f"moe-registry: waiting for process {holder.pid} building the probe extension (lock {lock}; 0 s so far, " \
           "at most 1.5 s)" in err
    assert built["built"] is True and built["answer"] == 42


def test_a_bad_wait_bound_is_one_line(probe, monkeypatch) -> None:
    source, cache = probe
    monkeypatch.setenv(cpu_build.WAIT_ENV, "soon")
    with pytest.raises(cpu_build.ExtensionError, match=r"^MOE_REGISTRY_BUILD_WAIT='soon': wanted a number of "
                                                       r"seconds >= 0$"):
        cpu_build.load_extension(NAME, [source], [Flags(("-O0",))], cache, what="the probe extension")
