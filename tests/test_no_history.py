"""No history in the repository: tracked files carry no work-period references, run names, dated
measurement records or rule numbers of a document outside it. History lives in git (the tag
``bench-history`` keeps the superseded benchmark records); a comment says why the code is as it is.

Producer-written data under tests/fixtures/ and the benchmark records under docs/bench/ (each table's
record names its date, as docs/performance.md shows it) are data, not prose, and are left out.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ("tests/fixtures/", "docs/bench/")
# the one page whose tables state the date that made them
DATED = ("docs/performance.md",)

WORDS = {
    "a numbered work period": re.compile(r"\bsessions?[ -]?#?\d+", re.I),
    "a work period": re.compile(r"\bwork[ -]periods?\b", re.I),
    "a run name": re.compile(r"\bissue\d+-s\d+|(?<![\w$])s\d{2}(?=[-_](?:h100|h200)\b)|-s\d{2}(?=[-_.]\w)|"
                             r"(?<![\w$])s\d{2}'s\b", re.I),
    "a design rule by number": re.compile(r"\bDESIGN(?:\.md)? rule \d", re.I),
    "a file outside the repository": re.compile(r"/work/shared|\.\./shared/"),
}
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if not p.startswith(DATA) and p != "tests/test_no_history.py"]


def text_of(path: str) -> str | None:
    try:
        data = (ROOT / path).read_bytes()
    except (FileNotFoundError, IsADirectoryError):  # deleted in the work tree, not yet in the index
        return None
    return None if b"\0" in data else data.decode("utf-8", "replace")


def findings(path: str, text: str) -> list[str]:
    found = [f"{path}: the file's name holds {what}" for what, pattern in WORDS.items() if pattern.search(path)]
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in WORDS.items():
            if m := pattern.search(line):
                found.append(f"{path}:{number}: {what} ({m.group(0)!r})")
        if path not in DATED and (m := DATE.search(line)):
            found.append(f"{path}:{number}: a date ({m.group(0)!r})")
    return found


def test_no_tracked_file_carries_history():
    found = []
    for path in tracked():
        text = text_of(path)
        if text is not None:
            found += findings(path, text)
    assert found == [], "history in tracked files:\n" + "\n".join(found)


@pytest.mark.parametrize(("line", "what"), [
    ("# measured in session " "38 on the H100",  # split: this file holds no history itself
     "a numbered work period"),
    ("see docs/bench/tune-s" "31-h100.txt", "a run name"),
    ("the issue19-s" "39 table", "a run name"),
    ("(s40's tuned cells)", "a run name"),
    ("as the work period before found", "a work period"),
    ("a Reason (DESIGN rule 4)", "a design rule by number"),
    ("see /work/shared/DESIGN.md", "a file outside the repository"),
    ("measured 2026-11-27 on an H100", "a date"),
])
def test_each_kind_of_history_is_found(line, what):
    assert [f.split(": ", 1)[1].split(" (")[0] for f in findings("x.py", line)] == [what]


@pytest.mark.parametrize("line", [
    "s13 = s2 = None  # a variable named like a run is not one",
    "stride_sn, stride_se",
    'asm("dp4a.s32.s32 $0, $1, $2, $3;")',
    "pytest's session fixtures are generated once per session",
    "fp8-w8a8-dynamic and gptq-w8a16",
])
def test_code_that_only_looks_like_history_passes(line):
    assert findings("x.py", line) == []
