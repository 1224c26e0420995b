"""Safe YAML reading that keeps line numbers.

Specs are data (docs/design.md, "Specs are data"): only plain YAML is accepted — no python tags, no anchors/aliases
(they buy nothing in a spec and are how alias bombs are built), no files over a size limit. Every
mapping comes back as a :class:`LineDict`, which remembers the line of each key so errors can say
``file:line``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from moe_registry.core.errors import SpecError
from moe_registry.core.guards import check_file, short_repr

MAX_SPEC_BYTES = 256 * 1024
MAX_DEPTH = 32


class LineDict(dict):
    """A dict that remembers the 1-based line of itself and of each of its keys."""

    line: int = 0
    key_lines: dict[str, int]


_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq")}
# libyaml's composer when present (ten times faster than the pure-Python one), else the Python one.
_COMPOSE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _walk(node: yaml.Node, path: str, depth: int, seen: set[int], scalars: SafeConstructor) -> Any:
    line = node.start_mark.line + 1
    if id(node) in seen:
        raise SpecError(path, line, "YAML aliases (*name) are not allowed in specs")
    seen.add(id(node))
    if depth > MAX_DEPTH:
        raise SpecError(path, line, f"nesting deeper than {MAX_DEPTH} levels")
    if node.tag not in _PLAIN_TAGS:
        raise SpecError(path, line, f"YAML tag {node.tag!r} is not allowed (specs are plain data)")
    if isinstance(node, yaml.MappingNode):
        out = LineDict()
        out.line, out.key_lines = line, {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError(path, key_line, "YAML merge keys (<<) are not allowed")
            key = _walk(key_node, path, depth + 1, seen, scalars)
            if not isinstance(key, str | int | float | bool):
                raise SpecError(path, key_line, f"mapping key must be a scalar, got {key!r}")
            key = key if isinstance(key, str) else str(key)
            if key in out:
                raise SpecError(path, key_line, f"duplicate key {key!r}")
            out[key] = _walk(value_node, path, depth + 1, seen, scalars)
            out.key_lines[key] = key_line
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(n, path, depth + 1, seen, scalars) for n in node.value]
    try:
        return scalars.construct_object(node, deep=True)
    except (ValueError, OverflowError) as err:  # e.g. an integer of more than 4300 digits
        raise SpecError(path, line, f"YAML value {short_repr(node.value)} cannot be read: "
                        f"{' '.join(str(err).split())[:120]}") from None


_OPEN = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
         yaml.FlowSequenceStartToken)
_CLOSE = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)


def check_depth(text: str, path: str, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than ``max_depth`` from the token stream, before the composer (which
    recurses, and in libyaml crashes the process on a 50k-deep ``[[[...``) sees the text. Tokens
    are scanned one by one without building anything."""
    if text.count("[") + text.count("{") + text.count("\n") <= max_depth:
        return
    depth = 0
    try:
        for token in yaml.scan(text, Loader=_COMPOSE_LOADER):
            if isinstance(token, _OPEN):
                depth += 1
                if depth > max_depth:
                    raise SpecError(path, token.start_mark.line + 1, f"nesting deeper than {max_depth} levels")
            elif isinstance(token, _CLOSE):
                depth -= 1
    except yaml.MarkedYAMLError as err:
        line = err.problem_mark.line + 1 if err.problem_mark else None
        if "nesting depth" in str(err.problem):  # the scanner of PyYAML 6.0.4 has a limit of its own, above ours
            raise SpecError(path, line, f"nesting deeper than {max_depth} levels") from None
        raise SpecError(path, line, f"YAML: {err.problem}") from None
    except yaml.YAMLError as err:
        raise SpecError(path, None, f"YAML: {' '.join(str(err).split())[:200]}") from None


def load_yaml_text(text: str, path: str) -> Any:
    """Parse one YAML document into plain data with line info; SpecError on anything unsafe.

    Aliases are refused as soon as a node is reached twice, before anything is expanded, so an
    alias bomb costs nothing."""
    if len(text.encode("utf-8", "replace")) > MAX_SPEC_BYTES:
        raise SpecError(path, None, f"file is larger than {MAX_SPEC_BYTES // 1024} KiB")
    check_depth(text, path)
    try:
        node = yaml.compose(text, Loader=_COMPOSE_LOADER)
        if node is None:
            raise SpecError(path, None, "file is empty")
        return _walk(node, path, 0, set(), SafeConstructor())
    except SpecError as err:
        if err.message.startswith("YAML aliases"):  # name the alias's line, not its anchor's
            raise SpecError(path, _first_alias_line(text) or err.line, err.message) from None
        raise
    except yaml.MarkedYAMLError as err:
        line = err.problem_mark.line + 1 if err.problem_mark else None
        raise SpecError(path, line, f"YAML: {err.problem}") from None
    except yaml.YAMLError as err:
        raise SpecError(path, None, f"YAML: {err}") from None
    except RecursionError:
        raise SpecError(path, None, "YAML nests too deeply") from None


def _first_alias_line(text: str) -> int | None:
    """The line of the first ``*alias`` (the walk refuses the first one it reaches, in document
    order); only read on the error path, from parser events, which expand nothing."""
    for event in yaml.parse(text, Loader=_COMPOSE_LOADER):
        if isinstance(event, yaml.AliasEvent):
            return event.start_mark.line + 1
    return None


def load_yaml_file(path: Path) -> Any:
    """Read and parse a spec file: a regular file (a FIFO would block the read, a symlink loop
    would raise) of at most MAX_SPEC_BYTES, checked before it is opened."""

    def error(message: str) -> SpecError:
        return SpecError(str(path), None, message.removeprefix(f"{path}: "))

    size = check_file(path, "spec file", error)
    if size > MAX_SPEC_BYTES:
        raise SpecError(str(path), None, f"file is {size} bytes; specs may be at most {MAX_SPEC_BYTES}")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_SPEC_BYTES + 1).decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(str(path), None, "file is not UTF-8 text") from None
    except OSError as err:
        raise SpecError(str(path), None, f"cannot read: {err.strerror}") from None
    return load_yaml_text(text, str(path))


def line_of(data: Any, *keys: str | int) -> int | None:
    """The line of ``data[keys[0]][keys[1]]…``, as deep as line info goes."""
    line = getattr(data, "line", None)
    node = data
    for key in keys:
        if isinstance(node, LineDict) and isinstance(key, str) and key in node:
            line = node.key_lines.get(key, line)
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            node = node[key]
            line = getattr(node, "line", line)
        else:
            break
    return line
