"""Guards for untrusted input: files, numbers, regular expressions, nesting depth, tensor values.

Nothing in a model dir is trusted (docs/security.md): a safetensors index may name
files outside the dir, a config may hold a billion layers or a regex that backtracks for hours, a
tensor may hold NaN. Every place that reads such input goes through one of these checks, so each
class of hostile input is refused in one place, with a one-line error of the project's types.
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moe_registry.core.errors import CheckpointError, ConfigError

try:  # the parser behind re.compile (public as sre_parse before 3.11)
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = [
    "MAX_JSON_BYTES", "MAX_INDEX_BYTES", "MAX_DEPTH", "MAX_LAYERS", "MAX_EXPERTS", "MAX_DIM", "MAX_RUN_TOKENS",
    "MAX_PATTERN_CHARS", "MAX_SUBJECT_CHARS", "check_file", "read_text", "inside", "shard_path", "load_json_text",
    "read_json_file", "check_json_depth", "check_int", "check_number", "short_repr", "compile_bounded",
    "bounded_match", "bounded_search", "capped_subject", "expert_index", "check_tensor_values", "FLOAT_DTYPES",
]

MAX_JSON_BYTES = 4 * 1024 * 1024  # config.json, hf_quant_config.json, runtime files
MAX_INDEX_BYTES = 64 * 1024 * 1024  # model.safetensors.index.json (DeepSeek-V3's is ~9 MB)
MAX_DEPTH = 64  # JSON nesting; real configs nest < 10 deep
MAX_LAYERS = 4096
MAX_EXPERTS = 65536
MAX_DIM = 1 << 20  # hidden / intermediate sizes
MAX_RUN_TOKENS = 1 << 16  # tokens `run` builds on its own (random hidden states)
MAX_PATTERN_CHARS = 512
MAX_SUBJECT_CHARS = 256
MAX_UNBOUNDED_REPEATS = 3

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
Err = Callable[[str], Exception]


# ---------------------------------------------------------------- files


def check_file(path: Path, what: str, error: Err = ConfigError, *, max_bytes: int | None = None) -> int:
    """``path`` must be a regular file (after symlinks) of at most ``max_bytes``; returns its size.

    Checked with stat before anything opens it: opening a FIFO for reading blocks until a writer
    comes, a device may never end, a symlink loop raises ELOOP deep inside a library."""
    try:
        st = os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise error(f"{path}: {what} is a symlink loop") from None
        if err.errno == errno.ENOENT:
            raise error(f"{path}: no such file or directory") from None
        raise error(f"{path}: cannot read {what}: {err.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise error(f"{path}: {what} is {kind}; wanted a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{path}: {what} is {st.st_size} bytes; at most {max_bytes} are read")
    return st.st_size


def read_text(path: Path, what: str, error: Err = ConfigError, *, max_bytes: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a checked regular file, never more than ``max_bytes`` read (a file that
    grows after the stat is cut off and refused)."""
    check_file(path, what, error, max_bytes=max_bytes)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as err:
        raise error(f"{path}: cannot read {what}: {err.strerror}") from None
    if len(data) > max_bytes:
        raise error(f"{path}: {what} is larger than {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: {what} is not UTF-8 text") from None


def _allowed_roots(root: Path) -> list[Path]:
    """The model dir, and for a Hugging Face cache snapshot (``<repo>/snapshots/<rev>``, whose files
    are symlinks into ``<repo>/blobs``) that repo's blobs dir."""
    real = root.resolve()
    roots = [real]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        roots.append((root.parent.parent / "blobs").resolve())
    return roots


def inside(root: Path, path: Path) -> bool:
    """Whether ``path`` (symlinks resolved) lies in the model dir ``root`` (or its HF cache blobs)."""
    real = path.resolve()
    return any(real == r or real.is_relative_to(r) for r in _allowed_roots(root))


def shard_path(root: Path, name: Any, index_path: Path, tensor: str) -> Path:
    """The file of a shard named in ``index_path``'s weight_map: a relative name inside ``root``,
    a regular file after symlinks, never a path outside the model dir."""
    where = f"{index_path}: weight_map[{short_repr(tensor)}]"
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: got {short_repr(name)}; wanted a shard file name")
    pure = Path(name)
    if "\x00" in name or pure.is_absolute() or ".." in pure.parts or name.startswith("~"):
        raise CheckpointError(f"{where} = {name!r}: the shard path leaves the model dir {root}; "
                              "wanted a file name inside it")
    path = root / name
    try:
        ok = inside(root, path)
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop on Python < 3.13
        raise CheckpointError(f"{where} = {name!r}: {path} is a symlink loop") from None
    if not ok:
        raise CheckpointError(f"{where} = {name!r}: {path} resolves to {path.resolve()}, outside the model dir "
                              f"{root}; wanted a file inside it")
    if not os.path.lexists(path):
        raise CheckpointError(f"{index_path}: names shard(s) that are not there: {name} (for {short_repr(tensor)})")
    check_file(path, "shard", CheckpointError)
    return path


# ---------------------------------------------------------------- JSON


def check_json_depth(text: str, where: str, error: Err = ConfigError, max_depth: int = MAX_DEPTH) -> None:
    """Refuse JSON nested deeper than ``max_depth`` before ``json.loads`` recurses into it."""
    if text.count("[") + text.count("{") <= max_depth:
        return
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    depth = 0
    for m in re.finditer(r"[\[\]{}]", stripped):
        depth += 1 if m.group() in "[{" else -1
        if depth > max_depth:
            line = stripped.count("\n", 0, m.start()) + 1
            raise error(f"{where}:{line}: JSON nests deeper than {max_depth} levels")


def load_json_text(text: str, where: str, what: str, error: Err = ConfigError,
                   max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` after the depth check; a number Python cannot hold (a 5000-digit integer, a
    float that overflows) is an error, not a traceback."""
    import json

    check_json_depth(text, where, error, max_depth)
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys(where, error))
    except json.JSONDecodeError as err:
        raise error(f"{where}:{err.lineno}: {what} is not valid JSON: {err.msg}") from None
    except (ValueError, RecursionError) as err:
        raise error(f"{where}: {what}: {_one_line(err)}") from None


def _unique_keys(where: str, error: Err) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """A ``json.loads`` object hook refusing a key given twice with different values: which one wins
    differs between JSON readers (Python keeps the last, others the first or refuse), so the file means
    two things. The same value given twice means one thing to every reader and is kept."""
    import json

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out and json.dumps(out[key], sort_keys=True) != json.dumps(value, sort_keys=True):
                raise error(f"{where}: key {short_repr(key)} is given twice with different values "
                            f"({short_repr(out[key], 40)}, then {short_repr(value, 40)}); wanted it once")
            out[key] = value
        return out
    return build


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; wanted finite numbers")


def read_json_file(path: Path, what: str, error: Err = ConfigError, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A checked regular file's JSON, size and depth limited."""
    return load_json_text(read_text(path, what, error, max_bytes=max_bytes), str(path), what, error)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


# ---------------------------------------------------------------- numbers


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters; an integer too long for ``repr`` (Python refuses
    more than 4300 digits) is described by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = repr(value)
    except ValueError:
        text = f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[:limit - 5] + " …" + text[-2:]


def check_int(value: Any, what: str, *, lo: int | None = None, hi: int | None = None,
              error: Err = ConfigError) -> int:
    """A real integer (not a bool, not 64.0) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{what}: got {short_repr(value)}; wanted an integer{_range(lo, hi)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise error(f"{what}: got {short_repr(value)}; wanted an integer{_range(lo, hi)}")
    return value


def check_number(value: Any, what: str, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, error: Err = ConfigError) -> float:
    """A finite real number (int or float, not a bool) within [lo, hi] (``lo_open``: above lo)."""
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if not bad:
        try:
            bad = not math.isfinite(value) or (lo is not None and (value <= lo if lo_open else value < lo)) \
                or (hi is not None and value > hi)
        except OverflowError:
            bad = True
    if bad:
        low = "" if lo is None else f"{'>' if lo_open else '>='} {lo:g}"
        high = "" if hi is None else f"<= {hi:g}"
        rng = " and ".join(s for s in (low, high) if s)
        raise error(f"{what}: got {short_repr(value)}; wanted a finite number{' ' + rng if rng else ''}")
    return float(value)


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def expert_index(text: str, tensor: str) -> int:
    """An expert number as written in a tensor name: canonical ASCII decimal (``3``, not ``03``,
    ``+3`` or a non-ASCII digit), so two spellings can never name one expert."""
    if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0") or len(text) > 9:
        raise CheckpointError(f"{tensor}: expert index {text!r} is not a canonical decimal number; "
                              "wanted e.g. 0, 3 or 17 (ASCII digits, no leading zeros)")
    return int(text)


# ---------------------------------------------------------------- regular expressions


def _repeats(parsed: Any, pattern: str, what: str, inside_repeat: bool, counts: list[int]) -> None:
    """Walk the parsed regex; refuse what can backtrack exponentially or read outside the match."""
    for op, av in parsed:
        name = str(op)
        if name in ("GROUPREF", "GROUPREF_EXISTS"):
            raise ConfigError(f"{what}: regex {pattern!r} uses a backreference; not allowed in configs")
        if name in ("ASSERT", "ASSERT_NOT"):
            raise ConfigError(f"{what}: regex {pattern!r} uses a lookaround; not allowed in configs")
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            low, high, sub = av
            many = high is _sre_parse.MAXREPEAT or high > 1
            if many and inside_repeat:
                raise ConfigError(f"{what}: regex {pattern!r} nests a repetition inside a repetition "
                                  "(catastrophic backtracking); write it without nested quantifiers")
            if high is _sre_parse.MAXREPEAT:
                counts[0] += 1
            _repeats(sub, pattern, what, inside_repeat or many, counts)
        elif name == "SUBPATTERN":
            _repeats(av[-1], pattern, what, inside_repeat, counts)
        elif name == "BRANCH":
            if inside_repeat:
                raise ConfigError(f"{what}: regex {pattern!r} repeats an alternation (catastrophic "
                                  "backtracking); not allowed in configs")
            for branch in av[1]:
                _repeats(branch, pattern, what, inside_repeat, counts)
        elif name == "ATOMIC_GROUP":
            _repeats(av, pattern, what, inside_repeat, counts)


_COMPILED: dict[tuple[str, str], re.Pattern[str]] = {}


def compile_bounded(pattern: Any, what: str) -> re.Pattern[str]:
    """Compile a regex read from a config, refusing patterns whose matching time is not bounded:
    longer than MAX_PATTERN_CHARS, backreferences, lookarounds, nested repetitions, repeated
    alternations or more than MAX_UNBOUNDED_REPEATS ``*``/``+``. With subjects capped at
    MAX_SUBJECT_CHARS the worst match is then polynomial of degree 3 in a few hundred characters."""
    if not isinstance(pattern, str):
        raise ConfigError(f"{what}: regex {short_repr(pattern)} is not a string")
    cached = _COMPILED.get((pattern, what))
    if cached is not None:
        return cached
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ConfigError(f"{what}: regex of {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    try:
        parsed = _sre_parse.parse(pattern)
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        raise ConfigError(f"{what}: bad regex {pattern!r}: {_one_line(err)}") from None
    counts = [0]
    _repeats(parsed, pattern, what, False, counts)
    if counts[0] > MAX_UNBOUNDED_REPEATS:
        raise ConfigError(f"{what}: regex {pattern!r} has {counts[0]} unbounded repetitions (* or +); "
                          f"at most {MAX_UNBOUNDED_REPEATS}")
    if len(_COMPILED) < 4096:
        _COMPILED[(pattern, what)] = compiled
    return compiled


def capped_subject(subject: str) -> str:
    """``subject``, refused in one line when it is longer than a config regex may be matched against."""
    if len(subject) > MAX_SUBJECT_CHARS:
        raise ConfigError(f"module name of {len(subject)} characters is too long to match against "
                          f"config regexes (at most {MAX_SUBJECT_CHARS})")
    return subject


def bounded_match(pattern: Any, subject: str, what: str) -> bool:
    """``re.match`` with a checked pattern and a length-capped subject."""
    return compile_bounded(pattern, what).match(capped_subject(subject)) is not None


def bounded_search(pattern: Any, subject: str, what: str) -> bool:
    """``re.search`` with a checked pattern and a length-capped subject."""
    return compile_bounded(pattern, what).search(capped_subject(subject)) is not None


# ---------------------------------------------------------------- tensor values

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_tensor_values(name: str, tensor: Any) -> None:
    """Refuse values that silently poison a layer, naming the tensor: NaN or infinity in a 16/32-bit
    float tensor, the fp8 e4m3fn NaN codes (0x7f, 0xff) and the e8m0 NaN code 0xff. The e8m0 code 0x00
    (2^-127) is kept: MX quantizers write it as the scale of an all-zero block. Vectorised: one pass."""
    import torch

    dt = tensor.dtype
    if dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        # min and max propagate NaN, and an infinity is one of them: one read of the tensor, no mask (a
        # mask's pass is most of the time a 16-bit checkpoint's load spends here); the mask only for the message
        if tensor.numel() and not all(math.isfinite(float(v)) for v in torch.aminmax(tensor)):
            bad = ~torch.isfinite(tensor)
            first = [int(i) for i in bad.nonzero()[0]]
            value = tensor[tuple(first)].item()
            count = int(bad.sum())
            raise CheckpointError(f"{name}: {count} of {tensor.numel()} values are NaN or infinite "
                                  f"(first at {first} = {value}); expected finite values")
        return
    codes = None
    if dt == getattr(torch, "float8_e4m3fn", None):
        codes = tensor.view(torch.uint8)
        bad = (codes & 0x7F) == 0x7F
        what = "the fp8 e4m3fn NaN encoding (0x7f/0xff)"
    elif dt == getattr(torch, "float8_e8m0fnu", None):
        codes = tensor.view(torch.uint8)
        bad = codes == 0xFF
        what = "0xff (NaN) in e8m0"
    if codes is not None and codes.numel() and bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(f"{name}: {int(bad.sum())} of {codes.numel()} values are {what} "
                              f"(first at {first} = 0x{int(codes[tuple(first)]):02x}); expected finite values")


def mapping_or_error(value: Any, what: str, error: Err = ConfigError) -> Mapping[str, Any]:
    """``value`` when it is a JSON object, else a one-line error naming ``what``."""
    if not isinstance(value, Mapping):
        raise error(f"{what}: got {type(value).__name__} {short_repr(value)}; wanted an object")
    return value


# ---------------------------------------------------------------- checkpoints


def checkpoint_files(model_dir: Path, index_name: str) -> list[Path]:
    """The safetensors files of a model dir: the shards its index names (each checked by
    :func:`shard_path`), else its ``*.safetensors`` files; every one a regular file inside the dir."""
    index_path = model_dir / index_name
    if os.path.lexists(index_path):
        index = read_json_file(index_path, "safetensors index", CheckpointError, max_bytes=MAX_INDEX_BYTES)
        if not isinstance(index, Mapping) or "weight_map" not in index:
            raise CheckpointError(f"{index_path}: not a safetensors index (no weight_map object)")
        weight_map = index["weight_map"]
        if not isinstance(weight_map, Mapping):
            raise CheckpointError(f"{index_path}: weight_map is a {type(weight_map).__name__}; wanted an object "
                                  "mapping tensor names to shard files")
        by_name: dict[str, Path] = {}
        for tensor, name in weight_map.items():
            if name not in by_name:
                by_name[name] = shard_path(model_dir, name, index_path, tensor)
        return sorted(set(by_name.values()))
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        if not inside(model_dir, path):
            raise CheckpointError(f"{path}: resolves to {path.resolve()}, outside the model dir {model_dir}; "
                                  "wanted a file inside it")
        check_file(path, "safetensors file", CheckpointError)
    return files


def no_duplicate_tensor(tensors: Mapping[str, Any], name: str, path: Path) -> None:
    """A tensor name held by two shards is refused (which one would win is an accident of order)."""
    if name in tensors and tensors[name].file != path:
        raise CheckpointError(f"{name}: stored in two shards, {tensors[name].file.name} and {path.name}; "
                              "wanted exactly one")


# ---------------------------------------------------------------- config.json values

SIZE_LIMITS = {"num_hidden_layers": MAX_LAYERS, "num_experts": MAX_EXPERTS, "top_k": MAX_EXPERTS,
               "shared_experts": MAX_EXPERTS}


def size_limit(what: str) -> int:
    """The largest value a config.json size field may hold (layers, experts, or a dimension)."""
    return SIZE_LIMITS.get(what, MAX_DIM)


def check_str_list(value: Any, what: str) -> list[str]:
    """None (absent) or a list of strings, e.g. ``architectures``."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{what}: got {short_repr(value)}; wanted a list of strings")
    return value


def check_layer_list(value: Any, what: str) -> list[int]:
    """None (absent) or a list of layer indices, e.g. ``mlp_only_layers``."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{what}: got {short_repr(value)}; wanted a list of layer indices")
    return [check_int(v, what, lo=0, hi=MAX_LAYERS) for v in value]


def check_sub_model_types(cfg: Mapping[str, Any], roots: list[str], types: list[str], family: str,
                          path: str) -> None:
    """A sub-config the family reads (``text_config``) must be of one of the family's model types:
    another model's text_config would give this family's code the other model's sizes."""
    for root in roots:
        sub = cfg.get(root)
        if isinstance(sub, Mapping) and "model_type" in sub and sub["model_type"] not in types:
            raise ConfigError(f"{path}: {root}.model_type: got {short_repr(sub['model_type'])}; family {family} "
                              f"reads {root} only of model type {' or '.join(types)}")


def check_quant_sources(inline: Mapping[str, Any], side: Mapping[str, Any], path: str, side_path: str) -> None:
    """config.json's quantization_config and hf_quant_config.json must not contradict each other:
    a scalar field both give (the side file's keys under ``quantization``) must be equal."""
    body = side.get("quantization", side)
    if not isinstance(body, Mapping):
        return
    for key, value in body.items():
        if key in inline and not isinstance(value, Mapping | list) and not isinstance(inline[key], Mapping | list):
            a, b = inline[key], value
            if (a.lower() if isinstance(a, str) else a) != (b.lower() if isinstance(b, str) else b):
                raise ConfigError(f"{path}: quantization_config.{key} = {short_repr(a)} but {side_path} says "
                                  f"{key} = {short_repr(b)}; remove or fix one of them")


# ---------------------------------------------------------------- specs

KERNEL_PACKAGE = "moe_registry_kernels"
CONVERTER_PACKAGE = "moe_registry.formats"


def check_template(text: str, allowed: tuple[str, ...], what: str) -> None:
    """A naming template may only hold the placeholders ``allowed`` (``{layer}``, ``{expert}``):
    ``str.format`` would otherwise read attributes (``{layer.__class__}``) or items of the value."""
    import string

    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(text)
                  if f is not None or spec or conv]
        bad = [f + (f"!{conv}" if conv else "") + (f":{spec}" if spec else "") for f, spec, conv in fields
               if f not in allowed or spec or conv]
    except ValueError as err:
        raise ValueError(f"{what} {text!r}: {err}") from None
    if bad or "{{" in text or "}}" in text:
        raise ValueError(f"{what} {text!r}: placeholder {{{(bad or ['{'])[0]}}} is not allowed; only "
                         + ", ".join(f"{{{a}}}" for a in allowed) + " (no attributes, indices, formats or braces)")


def spec_root(spec_path: str | Path) -> Path:
    """The spec dir a spec file belongs to (the dir above schemes/, kernels/ or models/)."""
    parent = Path(spec_path).parent
    return parent.parent if parent.name in ("schemes", "kernels", "models", "formats", "keysets") else parent


def check_impl(impl: str, owner: str, spec_path: str | Path, builtin: bool, package: str = KERNEL_PACKAGE) -> None:
    """An ``impl`` (a kernel's class, a format's converter) may name code in ``package``, or (for a
    user spec) in a package that lives in the spec dir declaring it; checked without importing
    anything, before the module is imported (importing runs its code). ``owner`` is e.g.
    ``kernel my-kernel``."""
    module = impl.partition(":")[0]
    top = module.split(".")[0]
    if module == package or module.startswith(package + "."):
        return
    where = f"{owner}: impl {impl}"
    if builtin:
        raise ConfigError(f"{where}: built-in code lives in {package}")
    import importlib.util

    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    root = spec_root(spec_path).resolve()
    origins = [Path(p) for p in (found.submodule_search_locations or [])] if found else []
    if found is not None and found.origin:
        origins.append(Path(found.origin))
    if not origins or not all(o.resolve().is_relative_to(root) for o in origins):
        raise ConfigError(f"{where}: module {module} is neither in {package} nor a package inside the spec "
                          f"dir {root} that declares it; refused before importing it")


# ---------------------------------------------------------------- run inputs


RUN_INPUT_DTYPES = ("float16", "bfloat16", "float32", "float64")
RUN_INPUT_TENSORS = ("hidden_states", "topk_ids", "topk_weights")


def check_run_input_names(path: Path, names: set[str]) -> None:
    """``--inputs`` holds hidden_states and, optionally, the routing; any other name is a mistake (a
    misspelt ``topk_ids`` would otherwise leave the router to choose, silently)."""
    import difflib

    unknown = sorted(names - set(RUN_INPUT_TENSORS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], RUN_INPUT_TENSORS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{path}: unknown tensor {short_repr(unknown[0])}{hint}"
                          + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else "")
                          + "; wanted hidden_states, optionally with both topk_ids and topk_weights")


def check_output_path(path: Path, flag: str) -> None:
    """An output file path: its dir must exist and the path must not be a directory, FIFO or socket
    (checked before the run, so a long run is not lost at the end)."""
    if not path.resolve().parent.is_dir():
        raise ConfigError(f"{flag}: {path.parent} is not a directory; create it first (nothing was run)")
    try:
        st = os.stat(path)
    except OSError:
        return  # not there yet: it is created
    if stat.S_ISDIR(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        kind = next(k for test, k in _KINDS if test(st.st_mode))
        raise ConfigError(f"{flag}: {path} is {kind}; wanted a file path (nothing was run)")


def write_bytes(path: Path, data: bytes, flag: str) -> None:
    """Write ``data`` to ``path``, every error (a full disk, a read-only file) one line naming it."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a full disk may say so only here
                os.fsync(f.fileno())
    except OSError as err:
        raise ConfigError(f"{flag}: cannot write {path}: {err.strerror or err}") from None


def check_run_inputs(path: Path, hidden: Any, topk_ids: Any, top_k: int) -> None:
    """``--inputs`` hidden states must be floating point with at least one token and finite; given
    routing must pick the config's top-k experts per token (another k is another model)."""
    import torch

    if str(hidden.dtype).removeprefix("torch.") not in RUN_INPUT_DTYPES:  # float8: no arithmetic to check it with
        raise ConfigError(f"{path}: hidden_states dtype {str(hidden.dtype).removeprefix('torch.')}; "
                          "wanted float16, bfloat16 or float32")
    if hidden.shape[0] < 1:
        raise ConfigError(f"{path}: hidden_states has 0 tokens; wanted at least 1")
    if hidden.shape[0] > MAX_RUN_TOKENS * 16:
        raise ConfigError(f"{path}: hidden_states has {hidden.shape[0]} tokens; at most {MAX_RUN_TOKENS * 16}")
    if not bool(torch.isfinite(hidden).all()):
        raise ConfigError(f"{path}: hidden_states holds NaN or infinite values; wanted finite values")
    if topk_ids is not None and topk_ids.numel() and topk_ids.dim() == 2:
        rows = topk_ids.sort(dim=1).values
        if bool((rows[:, 1:] == rows[:, :-1]).any()):
            raise ConfigError(f"{path}: topk_ids repeats an expert within a token's row; wanted distinct experts")
    if topk_ids is not None and (topk_ids.dim() != 2 or topk_ids.shape[1] != top_k):
        raise ConfigError(f"{path}: topk_ids shape {list(topk_ids.shape)}; wanted [tokens, {top_k}] "
                          f"(num_experts_per_tok {top_k} from config.json)")


def check_flag_sizes(**flags: int | None) -> None:
    """Size flags (``--max-tokens``, ``--tp``, ...) given on the command line or in a runtime file:
    integers >= 1 (``--max-tokens -7`` is a mistake, not an empty budget)."""
    for name, value in flags.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"{flag}: got {value}; wanted a positive integer")
        if value is not None:
            check_int(value, flag, lo=1, hi=1 << 40)  # the upper bound only stops absurd sizes


def same_value(seen: Any, wanted: Any) -> bool:
    """``seen == wanted`` where a bool is not an int and a float is not an int: ``group_size: 64.0``
    does not bind ``64`` (it would write ``group(64.0)``), ``bits: true`` is not ``1``."""
    if isinstance(seen, bool) or isinstance(wanted, bool):
        return isinstance(seen, bool) and isinstance(wanted, bool) and seen == wanted
    if isinstance(seen, float) != isinstance(wanted, float) and isinstance(seen, int | float) \
            and isinstance(wanted, int | float):
        return False
    return bool(seen == wanted)
