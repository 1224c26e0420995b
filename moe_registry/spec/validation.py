"""Validating spec files into a Registry: pydantic models, key templates, shape expressions and every
reference between specs, with every problem collected (file:line, field, what was seen and wanted), so
``validate`` lists them all, one per line. Imported only when the spec cache misses or for ``validate``:
pydantic and YAML stay out of a cached ``explain``."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from moe_registry.core import guards
from moe_registry.core.errors import ConfigError, SpecError
from moe_registry.core.keys import KeyError_, key_matches, parse_quant_key
from moe_registry.core.names import unknown_text
from moe_registry.spec import view
from moe_registry.spec.expr import parse_expr
from moe_registry.spec.models import SPEC_KINDS, FormatSpec, KernelSpec, KeyPattern, KeySetSpec, SchemeSpec, Strict
from moe_registry.spec.record import from_json, to_json
from moe_registry.spec.registry import Loaded, Registry, binding_samples, builtin_spec_dir, fill_template, spec_files
from moe_registry.spec.yamlio import line_of, load_yaml_file


def _unwrap(tp: Any) -> list[Any]:
    """The members of a Union/Optional (or the type itself)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [m for a in args for m in _unwrap(a)]
    return [tp]


def _known_fields(model: type[BaseModel], loc: list[Any]) -> list[str]:
    """The field names, as written in YAML, of the spec model found at ``loc`` inside ``model``."""
    current: list[Any] = [model]
    for part in loc:
        following: list[Any] = []
        for tp in (m for t in current for m in _unwrap(t)):
            origin, args = typing.get_origin(tp), typing.get_args(tp)
            if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str):
                following += [f.annotation for n, f in tp.model_fields.items() if part in (n, f.alias)]
            elif origin is list and isinstance(part, int) and args:
                following.append(args[0])
            elif origin is dict and isinstance(part, str) and len(args) == 2:
                following.append(args[1])
        current = following or current  # a union member's tag in loc: stay where we are
    return sorted({f.alias or n for t in current for m in _unwrap(t)
                   if isinstance(m, type) and issubclass(m, BaseModel) for n, f in m.model_fields.items()})


def _pydantic_problems(err: ValidationError, path: str, data: Any, model: type[BaseModel]) -> list[SpecError]:
    out = []
    for e in err.errors():
        loc = [p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        # DetectSpec is written flat in YAML; drop its synthetic 'fields' level (only that one: a
        # family spec has a real 'fields' key).
        lookup = [p for i, p in enumerate(loc) if p != "[key]"  # (pydantic's marker for a bad dict key)
                  and not (p == "fields" and i and loc[i - 1] == "detect")]
        dotted = ".".join(str(p) for p in lookup) or "(top)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            known = _known_fields(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6) if loc else []
            msg = "unknown field" + (f" (did you mean {close[0]!r}?)" if close else "")
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and e["type"] not in ("value_error",):
            msg = f"{msg}, got {e['input']!r}"[:300]
        msg = msg.removeprefix("Value error, ")
        out.append(SpecError(path, line_of(data, *lookup), msg, field=dotted))
    return out


def parse_spec(data: Any, path: str) -> Strict:
    """Validate one parsed YAML document into its spec model."""
    if not isinstance(data, dict):
        raise SpecError(path, line_of(data), "a spec must be a mapping")
    kinds = [k for k in SPEC_KINDS if k in data]
    if len(kinds) != 1:
        raise SpecError(path, getattr(data, "line", 1),
                        f"a spec needs exactly one of the top-level keys: {', '.join(SPEC_KINDS)}")
    model = SPEC_KINDS[kinds[0]]
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = _pydantic_problems(err, path, data, model)
        raise (problems[0] if len(problems) == 1 else SpecErrors(problems)) from None


class SpecErrors(SpecError):
    """Several problems in one file; ``str`` lists them one per line."""

    def __init__(self, problems: list[SpecError]) -> None:
        self.problems = problems
        first = problems[0]
        super().__init__(first.path, first.line, first.message, first.field)
        self.args = ("\n".join(str(p) for p in problems),)


def _check_scheme(loaded: Loaded[SchemeSpec], data: Any, kernels: Mapping[str, Any],
                  formats: Mapping[str, Any]) -> list[SpecError]:
    scheme, path = loaded.spec, loaded.path
    problems: list[SpecError] = []
    if scheme.checkpoint.format not in formats:
        problems.append(SpecError(path, line_of(data, "checkpoint", "format"),
                                  unknown_text("checkpoint format", scheme.checkpoint.format, formats),
                                  field="checkpoint.format"))
    for sample in binding_samples(scheme):
        for fld in ("weight", "activation", "emulation.activation"):
            text = scheme.emulation.activation if fld == "emulation.activation" and scheme.emulation else (
                None if fld == "emulation.activation" else getattr(scheme, fld))
            if text is None:
                continue
            try:
                key = parse_quant_key(fill_template(text, sample))
            except KeyError_ as err:
                problems.append(SpecError(path, line_of(data, *fld.split(".")), str(err), field=fld))
                continue
            fmt = formats.get(scheme.checkpoint.format)
            if fld == "weight" and fmt is not None and not key_matches(key, fmt.spec.holds):
                problems.append(SpecError(path, line_of(data, "weight"), (
                    f"weight key {key!s} is not one checkpoint format {scheme.checkpoint.format!r} holds "
                    f"({', '.join(fmt.spec.holds)}; its spec's holds)"), field="weight"))
        for fname, value in scheme.features.items():
            if isinstance(value, str):
                try:
                    resolved = fill_template(value, sample)
                except KeyError_ as err:
                    problems.append(SpecError(path, line_of(data, "features", fname), str(err),
                                              field=f"features.{fname}"))
                    continue
                if resolved not in ("true", "false"):
                    problems.append(SpecError(path, line_of(data, "features", fname),
                                              f"must be true, false or a boolean $binding, got {value!r}",
                                              field=f"features.{fname}"))
    bound = set(scheme.bind)
    for tname, tensor in scheme.checkpoint.tensors.items():
        for i, dim in enumerate(tensor.shape):
            expr = parse_expr(dim)
            unknown = sorted(expr.names - {"in", "out"}) + ["$" + b for b in sorted(expr.bindings - bound)]
            if unknown:
                problems.append(SpecError(
                    path, line_of(data, "checkpoint", "tensors", tname),
                    f"shape[{i}] {dim!r} uses {', '.join(unknown)}; known: "
                    + ", ".join(["in", "out"] + ["$" + b for b in sorted(bound)]),
                    field=f"checkpoint.tensors.{tname}.shape"))
    for i, kname in enumerate(scheme.kernels):
        if kname not in kernels:
            problems.append(SpecError(path, line_of(data, "kernels", i),
                                      f"unknown kernel {kname!r}; known: {', '.join(sorted(kernels))}",
                                      field="kernels"))
    if len(set(scheme.kernels)) != len(scheme.kernels):
        problems.append(SpecError(path, line_of(data, "kernels"), "a kernel is listed twice",
                                  field="kernels"))
    return problems


def _expand_keysets(loaded: Loaded[KernelSpec], data: Any,
                    keysets: Mapping[str, Loaded[KeySetSpec]]) -> tuple[Loaded[KernelSpec], list[SpecError]]:
    """The kernel with each ``{keyset: name}`` entry replaced by that key set's patterns."""
    keys: list[KeyPattern] = []
    problems = []
    for i, entry in enumerate(loaded.spec.keys):
        if entry.keyset is None:
            keys.append(entry)
        elif entry.keyset in keysets:
            keys += keysets[entry.keyset].spec.keys
        else:
            problems.append(SpecError(loaded.path, line_of(data, "keys", i),
                                      unknown_text("key set", entry.keyset, keysets), field=f"keys.{i}.keyset"))
    if problems:
        return loaded, problems
    return replace(loaded, spec=loaded.spec.model_copy(update={"keys": keys})), []


def _check_format(loaded: Loaded[FormatSpec], data: Any) -> list[SpecError]:
    problems = []
    for i, conv in enumerate(loaded.spec.converters):
        try:  # only moe_registry.formats or a package in the declaring spec dir, checked without importing
            guards.check_impl(conv.impl, f"format {loaded.spec.format} converter {conv.layout}", loaded.path,
                              loaded.builtin, guards.CONVERTER_PACKAGE)
        except ConfigError as err:
            problems.append(SpecError(loaded.path, line_of(data, "converters", i, "impl"), str(err),
                                      field=f"converters.{i}.impl"))
    return problems


def _check_kernel(loaded: Loaded[KernelSpec], data: Any, layouts: set[str]) -> list[SpecError]:
    problems = []
    if loaded.spec.layout not in layouts:
        problems.append(SpecError(loaded.path, line_of(data, "layout"),
                                  unknown_text("layout", loaded.spec.layout, layouts)
                                  + " (the layouts the format specs' converters produce)", field="layout"))
    try:  # impl: only moe_registry_kernels or a package in the declaring spec dir, checked without importing
        guards.check_impl(loaded.spec.impl, f"kernel {loaded.spec.kernel}", loaded.path, loaded.builtin)
    except ConfigError as err:
        problems.append(SpecError(loaded.path, line_of(data, "impl"), str(err), field="impl"))
    if loaded.spec.linear_impl is not None:
        try:
            guards.check_impl(loaded.spec.linear_impl, f"kernel {loaded.spec.kernel} linear", loaded.path,
                              loaded.builtin)
        except ConfigError as err:
            problems.append(SpecError(loaded.path, line_of(data, "linear_impl"), str(err), field="linear_impl"))
    for pattern in loaded.spec.keys:  # key sets expanded: a problem is reported at the kernel's keys
        if pattern.emulation is not None:
            try:
                parse_quant_key(pattern.emulation.activation)
            except KeyError_ as err:
                problems.append(SpecError(loaded.path, line_of(data, "keys"), f"emulation.activation: {err}",
                                          field="keys.emulation.activation"))
    for dim, limit in loaded.spec.shapes.items():
        for attr in ("multiple_of", "min", "max"):
            value = getattr(limit, attr)
            if value is None:
                continue
            expr = parse_expr(value)
            if expr.names:
                problems.append(SpecError(loaded.path, line_of(data, "shapes", dim, attr),
                                          f"may only use integers and $bindings, got {value!r}",
                                          field=f"shapes.{dim}.{attr}"))
    return problems


def build_registry(sources: list[tuple[Path, Path]], *, strict: bool = True) -> Registry:
    """Validate ``(path, spec root)`` files in order; a later root overrides an earlier one by
    name, while two files of one root defining one name is an error."""
    problems: list[SpecError] = []
    tables: dict[str, dict[str, Loaded[Any]]] = {kind: {} for kind in SPEC_KINDS}
    raw: dict[str, Any] = {}
    roots: dict[str, Path] = {}
    builtin_root = builtin_spec_dir()
    for path, root in sources:
        is_builtin = root == builtin_root
        try:
            data = load_yaml_file(path)
            spec = parse_spec(data, str(path))
        except SpecErrors as err:
            problems += err.problems
            continue
        except SpecError as err:
            problems.append(err)
            continue
        kind = next(k for k in SPEC_KINDS if k in data)
        name = getattr(spec, kind)
        table = tables[kind]
        prev = table.get(name)
        overrides = None
        if prev is not None:
            if roots[f"{kind}:{name}"] == root:
                problems.append(SpecError(str(path), line_of(data, kind),
                                          f"duplicate {kind} name {name!r} (also in {prev.path}:{prev.line})",
                                          field=kind))
                continue
            overrides = prev.path
        table[name] = Loaded(spec, str(path), line_of(data, kind) or 1, is_builtin, overrides)
        raw[f"{kind}:{name}"] = data
        roots[f"{kind}:{name}"] = root
    bad: list[tuple[str, str]] = []
    for name, loaded in list(tables["kernel"].items()):  # key sets are put in place first
        expanded, found = _expand_keysets(loaded, raw[f"kernel:{name}"], tables["keyset"])
        tables["kernel"][name] = expanded
        problems += found
        bad += [("kernel", name)] if found else []
    # every reference is checked against every spec that parsed; then the specs with problems leave
    layouts = {c.layout for loaded in tables["format"].values() for c in loaded.spec.converters}
    checks = {"format": lambda loaded, data: _check_format(loaded, data),
              "kernel": lambda loaded, data: _check_kernel(loaded, data, layouts),
              "scheme": lambda loaded, data: _check_scheme(loaded, data, tables["kernel"], tables["format"])}
    for kind in ("scheme", "kernel", "format"):
        for name, loaded in tables[kind].items():
            found = checks[kind](loaded, raw[f"{kind}:{name}"]) if (kind, name) not in bad else []
            problems += found
            bad += [(kind, name)] if found else []
    for kind, name in bad:
        del tables[kind][name]
    if problems and strict:
        raise SpecErrors(problems)
    views = {kind: {name: as_view(loaded) for name, loaded in tables[kind].items()}
             for kind in ("scheme", "kernel", "family", "format")}
    return Registry(views["scheme"], views["kernel"], views["family"], views["format"], tuple(problems))


def as_view(loaded: Loaded[Any]) -> Loaded[Any]:
    """The validated spec as its runtime view, built through the same encoding the cache stores, so a
    registry read from the cache and one validated now are built by one decoder."""
    try:
        return replace(loaded, spec=from_json(to_json(loaded.spec), view.RECORDS))
    except ValueError as err:  # a model changed and view.py was not regenerated: a developer's mistake
        raise RuntimeError(f"{err}: moe_registry/spec/view.py is stale; run python tools/gen_spec_view.py") from None


def validate_paths(paths: Iterable[str | Path]) -> list[SpecError]:
    """Every problem in the given files or dirs, checked together with the built-ins they refer to;
    each problem once (a file given twice, or a key wrong for every binding, is one problem)."""
    builtin = builtin_spec_dir()
    sources = [(p, builtin) for p in spec_files(builtin)]
    for p in map(Path, paths):
        if p.is_symlink() and not p.exists():  # dangling, or a loop (resolve() would raise)
            return [SpecError(str(p), None, "no such file or directory (a dangling symlink or a symlink loop)")]
        if p.resolve() == builtin.resolve():
            continue
        if p.is_dir():
            sources += [(f, p) for f in spec_files(p)]
        elif p.exists():
            sources.append((p, p))
        else:
            return [SpecError(str(p), None, "no such file or directory")]
    first: dict[Path, tuple[Path, Path]] = {}
    for f, root in sources:
        first.setdefault(f.resolve(), (f, root))
    unique = {str(p): p for p in build_registry(list(first.values()), strict=False).problems}
    return list(unique.values())
