"""Safe YAML reading that keeps line numbers.

Specs are data (DESIGN rule 2): only plain YAML is accepted — no python tags, no anchors/aliases
(they buy nothing in a spec and are how alias bombs are built), no files over a size limit. Every
mapping comes back as a :class:`LineDict`, which remembers the line of each key so errors can say
``file:line``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from moe_registry.errors import SpecError

MAX_SPEC_BYTES = 256 * 1024
MAX_DEPTH = 32


class LineDict(dict):
    """A dict that remembers the 1-based line of itself and of each of its keys."""

    line: int = 0
    key_lines: dict[str, int]


def _construct(node: yaml.Node, path: str, depth: int, loader: yaml.SafeLoader) -> Any:
    if depth > MAX_DEPTH:
        raise SpecError(path, node.start_mark.line + 1, f"nesting deeper than {MAX_DEPTH} levels")
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = LineDict()
        out.line, out.key_lines = line, {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError(path, key_node.start_mark.line + 1, "YAML merge keys (<<) are not allowed")
            key = _construct(key_node, path, depth + 1, loader)
            if not isinstance(key, str | int | float | bool):
                raise SpecError(path, key_node.start_mark.line + 1, f"mapping key must be a scalar, got {key!r}")
            key = str(key) if not isinstance(key, str) else key
            if key in out:
                raise SpecError(path, key_node.start_mark.line + 1, f"duplicate key {key!r}")
            out[key] = _construct(value_node, path, depth + 1, loader)
            out.key_lines[key] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(n, path, depth + 1, loader) for n in node.value]
    return loader.construct_object(node, deep=True)


_PLAIN_TAGS = {"!", "?"} | {f"tag:yaml.org,2002:{t}" for t in
                               ("str", "int", "float", "bool", "null", "map", "seq")}


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and non-standard tags at compose time."""

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise SpecError(self.name, event.start_mark.line + 1,
                            "YAML aliases (*name) are not allowed in specs")
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise SpecError(self.name, event.start_mark.line + 1,
                            f"YAML anchors (&{anchor}) are not allowed in specs")
        tag = getattr(event, "tag", None)
        if tag is not None and tag not in _PLAIN_TAGS:
            raise SpecError(self.name, event.start_mark.line + 1,
                            f"YAML tag {tag!r} is not allowed (specs are plain data)")
        return super().compose_node(parent, index)


def load_yaml_text(text: str, path: str) -> Any:
    """Parse one YAML document into plain data with line info; SpecError on anything unsafe."""
    if len(text.encode("utf-8", "replace")) > MAX_SPEC_BYTES:
        raise SpecError(path, None, f"file is larger than {MAX_SPEC_BYTES // 1024} KiB")
    loader = _Loader(text)
    loader.name = path
    try:
        node = loader.get_single_node()
        if node is None:
            raise SpecError(path, None, "file is empty")
        return _construct(node, path, 0, loader)
    except SpecError:
        raise
    except yaml.MarkedYAMLError as err:
        line = err.problem_mark.line + 1 if err.problem_mark else None
        raise SpecError(path, line, f"YAML: {err.problem}") from None
    except yaml.YAMLError as err:
        raise SpecError(path, None, f"YAML: {err}") from None
    finally:
        loader.dispose()


def load_yaml_file(path: Path) -> Any:
    """Read and parse a spec file, refusing oversized files before reading them whole."""
    try:
        size = path.stat().st_size
    except OSError as err:
        raise SpecError(str(path), None, f"cannot read: {err.strerror}") from None
    if size > MAX_SPEC_BYTES:
        raise SpecError(str(path), None, f"file is {size} bytes; specs may be at most {MAX_SPEC_BYTES}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(str(path), None, "file is not UTF-8 text") from None
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
