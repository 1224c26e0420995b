"""Names nobody defined: the one-line error every stage gives for them, with the closest known
name (\"did you mean\"), so a typo in a flag, a spec or a runtime file reads the same everywhere."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known word, or nothing."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_text(kind: str, name: str, known: Iterable[str]) -> str:
    """``unknown <kind> 'x' (did you mean 'y'?); known: a, b``."""
    names = sorted(known)
    return f"unknown {kind} {name!r}{did_you_mean(name, names)}; known: {', '.join(names) or 'none'}"
