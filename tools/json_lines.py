"""JSON-lines logs that long GPU runs write a line at a time (tools/bench.py's bench.jsonl,
tools/pytest_progress.py's gpu_tests.jsonl): a call's time limit may kill the run mid-write."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_lines(path: Path) -> list[dict]:
    """The records of a JSON-lines file, the last line ignored where a kill cut it off; any other
    line that is not a JSON object: ValueError naming the file and line."""
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # cut off mid-write
                break
            raise ValueError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, wanted an object")
        records.append(record)
    return records
