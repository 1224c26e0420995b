"""A C++ torch extension compiled on first use, shared safely by every process that wants it.

torch's own ``cpp_extension.load`` guards a build directory with a lock file that only a finished build
removes: a build killed mid-way (Ctrl-C, ``timeout``, the OOM killer) leaves it behind and every later process
waits on it forever, and a process that finds the library built still takes that lock to load it. Here:

- the library's file name carries a digest of its sources, flags, torch and Python (``<name>-<digest>.so``): an
  existing one is loaded at once, without any lock;
- otherwise one process builds, holding an ``flock`` on ``<name>-<digest>.lock``; the kernel drops that lock when
  its holder dies however it dies, so a lock left by a dead process is free, and the next builder says it found
  one (the holder writes its pid into the file and empties it when done);
- the build runs in a fresh temporary directory beside the library (torch's lock in it is private) and the
  library is renamed into place (``os.replace``, atomic): a killed build leaves no half-made library, only a
  temporary directory that the next builder removes;
- the others wait, saying who holds the lock, and load the library as soon as the holder has renamed it into
  place; after ``MOE_REGISTRY_BUILD_WAIT`` seconds (default 600) they give up with one line naming the lock, the
  holder and what to do.

What is built, why and about how long (the last build's time on this machine), and a line every
``PROGRESS_S`` seconds while the compiler runs, go to stderr, never stdout (``--json`` output stays clean).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

__all__ = ["BuildError", "ExtensionError", "Flags", "Loaded", "LockTimeout", "load_extension", "WAIT_ENV"]

WAIT_ENV = "MOE_REGISTRY_BUILD_WAIT"
DEFAULT_WAIT_S = 600.0
PROGRESS_S = 10.0  # seconds between progress lines, while building or waiting
POLL_S = 0.2


class ExtensionError(RuntimeError):
    """The extension could not be loaded; the message is one line (a bad wait bound, or a subclass)."""


class BuildError(ExtensionError):
    """Every flag set failed to build; the message is the compiler's first line."""


class LockTimeout(ExtensionError):
    """Another process held the build lock for longer than the wait bound."""


@dataclass(frozen=True)
class Flags:
    """One way to build: compiler and linker flags (tried in order, the first that builds is kept)."""

    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Loaded:
    """The library now loaded in this process, and whether this process compiled it."""

    path: Path
    built: bool


def load_extension(name: str, sources: Sequence[Path], variants: Sequence[Flags], cache: Path, *, what: str,
                   why: str = "", wait_s: float | None = None, log: TextIO | None = None) -> Loaded:
    """Load the extension ``name`` built from ``sources`` (``torch.ops.load_library``), compiling it first when
    ``cache`` has no library for these sources, flags, torch and Python. ``what`` names it in messages (e.g.
    "the torch-cpu-native kernel"), ``why`` says why it is built now. Raises :class:`BuildError` when no flag set
    builds and :class:`LockTimeout` when another process holds the build past ``wait_s`` seconds (default:
    ``$MOE_REGISTRY_BUILD_WAIT``, else 600); both are :class:`ExtensionError`, whose message is one line."""
    out = log if log is not None else sys.stderr
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{_digest(name, sources, variants)}"
    library = cache / f"{stem}.so"
    if library.is_file():  # built before: no lock to take
        return _load(library, built=False)
    bound = _wait_bound() if wait_s is None else wait_s
    lock = cache / f"{stem}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not _acquire(fd, lock, what, bound, out, library.is_file):
            return _load(library, built=False)  # renamed into place by the holder while this one waited
        earlier = _holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            if library.is_file():  # built by the process this one waited for
                return _load(library, built=False)
            if earlier.isdigit():
                print(f"moe-registry: a build of {what} by process {earlier} did not finish (that process is "
                      "gone); building it again", file=out, flush=True)
            for leftover in cache.glob(f"{stem}.build-*"):  # only the lock holder builds: dead builds' leftovers
                shutil.rmtree(leftover, ignore_errors=True)
            _compile(name, sources, variants, library, cache / f"{name}.seconds", what, why, out)
            return Loaded(library, True)
        finally:
            os.ftruncate(fd, 0)  # an empty lock file: its last holder finished
    finally:
        os.close(fd)  # releases the lock


def _load(library: Path, built: bool) -> Loaded:
    torch.ops.load_library(str(library))
    return Loaded(library, built)


def _digest(name: str, sources: Sequence[Path], variants: Sequence[Flags]) -> str:
    """What the library depends on: the sources' bytes, the flag sets, torch, Python and the machine."""
    h = hashlib.sha256(f"{name}\n{torch.__version__}\n{sys.version}\n{sys.platform}\n{platform.machine()}\n"
                       f"{os.environ.get('CXX', '')}\n{[(v.cflags, v.ldflags) for v in variants]}\n".encode())
    for source in sources:
        h.update(f"{Path(source).name}\n".encode() + Path(source).read_bytes())
    return h.hexdigest()[:16]


def _wait_bound() -> float:
    text = os.environ.get(WAIT_ENV, "")
    try:
        value = float(text) if text else DEFAULT_WAIT_S
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise ExtensionError(f"{WAIT_ENV}={text!r}: wanted a number of seconds >= 0")
    return value


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock on the open file ``fd`` without waiting; False when another process holds it."""
    try:
        if sys.platform == "win32":
            import msvcrt

            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        else:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _holder(fd: int) -> str:
    """The pid the lock file names ('' when it names none)."""
    try:
        return os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""


def _acquire(fd: int, path: Path, what: str, bound: float, out: TextIO, ready: Callable[[], bool]) -> bool:
    """Take the build lock (True), or see ``ready()`` turn true while another process holds it (False). A live
    holder is waited for with a progress line every PROGRESS_S seconds, at most ``bound`` seconds."""
    start = time.monotonic()
    said = -PROGRESS_S
    while not _try_lock(fd):
        if ready():
            return False
        waited = time.monotonic() - start
        pid = _holder(fd)
        who = f"process {pid}" if pid else "another process"
        if waited >= bound:
            stop = f"if it is stuck, stop it (kill {pid}) and run again" if pid else "if it is stuck, stop it"
            raise LockTimeout(f"{who} has held the build lock {path} for more than {bound:g} s, building {what}; wait "
                              f"for it to finish, {stop}, or wait longer with {WAIT_ENV}=<seconds>")
        if waited - said >= PROGRESS_S:
            said = waited
            print(f"moe-registry: waiting for {who} building {what} (lock {path}; {waited:.0f} s so far, "
                  f"at most {bound:g} s)", file=out, flush=True)
        time.sleep(POLL_S)
    return True


def _compile(name: str, sources: Sequence[Path], variants: Sequence[Flags], library: Path, timing: Path,
             what: str, why: str, out: TextIO) -> None:
    """Build into a temporary directory beside ``library`` (each flag set in turn) and rename the library into
    place; torch loads it into this process as it builds it. Announces the build and its progress on ``out``."""
    from torch.utils import cpp_extension

    try:
        last = f"about {float(timing.read_text()):.0f} s, as the last build here took"
    except (OSError, ValueError):
        last = "usually 20 s to 2 min, depending on the CPU"
    print(f"moe-registry: compiling {what} ({', '.join(Path(s).name for s in sources)}){why}; first use with this "
          f"source, torch and Python; {last}; kept as {library} for later runs", file=out, flush=True)
    start = time.monotonic()
    done = threading.Event()
    ticker = threading.Thread(target=_tick, args=(done, start, what, out), daemon=True)
    ticker.start()
    errors: list[str] = []
    try:
        for flags in variants:
            tmp = Path(tempfile.mkdtemp(prefix=f"{library.stem}.build-", dir=library.parent))
            try:
                try:
                    built = cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                               extra_cflags=list(flags.cflags), extra_ldflags=list(flags.ldflags),
                                               build_directory=str(tmp), verbose=False, is_python_module=False)
                except (RuntimeError, OSError) as err:  # no compiler, a failed build: its first line, not a log
                    errors.append((str(err).strip().splitlines() or [type(err).__name__])[0][:200])
                    continue
                os.replace(str(built), library)
                break
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise BuildError(errors[0] if errors else "no flag set to build with")
    finally:
        done.set()
        ticker.join()
    seconds = time.monotonic() - start
    with contextlib.suppress(OSError):  # only the next estimate would be lost
        timing.write_text(f"{seconds:.1f}\n")
    print(f"moe-registry: compiled {what} in {seconds:.0f} s", file=out, flush=True)


def _tick(done: threading.Event, start: float, what: str, out: TextIO) -> None:
    """A line every PROGRESS_S seconds while the compiler runs (it prints nothing until it ends)."""
    while not done.wait(PROGRESS_S):
        print(f"moe-registry: still compiling {what}, {time.monotonic() - start:.0f} s so far", file=out, flush=True)
