"""Tile configurations of the fused MoE GEMMs: tuned tables, defaults, and the rules that make a
config legal for a variant.

:func:`get_config` picks BLOCK_M/N/K, GROUP_M, SPLIT_K, num_warps and num_stages (and, where a
tuned entry sets them, ``maxnreg``: a cap on registers per thread, and ``GROUP_DOTS``: one dot
per weight group, :func:`group_dot_width`) for one GEMM:
the nearest entry of a tuned table (``configs/<device>__<weight key>__<activation key>.json``,
written by tools/tune.py) over :func:`default_config`'s heuristics. :func:`config_override`
replaces both for the layers called inside it (tuner, tests). :func:`_fit_config` then makes a
config legal for a variant (what the kernels' ``tl.static_assert`` calls check), and
:func:`_layer_configs` gives a layer's GEMM1 and GEMM2 configs together. The SM count the
heuristics aim at is the device's own (:func:`_num_sms`).
"""

import collections
import contextlib
import contextvars
import functools
import json
import logging
import math
import re
from pathlib import Path

import torch
import triton

from moe_registry.core.keys import QuantKey, parse_quant_key

from .variant import KernelVariant, swappable, variant_from_keys

__all__ = ["CONFIG_DIR", "config_file", "shape_key", "default_config", "get_config", "nearest_shape_config",
           "config_override", "group_dot_width", "takes_zero_sums", "zero_sums_fit"]

log = logging.getLogger("moe_registry")
# the tuned tables ship beside the package root (moe_registry_kernels.configs), where tools/tune.py writes them
CONFIG_DIR = Path(__file__).parents[1] / "configs"
# a tuned entry stands for token counts up to this factor away from its own (tables are tuned at
# 1, 8, 64, 512, 4096: every count lands on one); farther counts take the defaults
TUNED_REACH = 4.0
# the SM count where no GPU says one: the interpreter behaves as an H100 would (so CPU tests cover
# split-K), and so do callers of default_config / get_config that name no count
INTERPRETER_SMS = 132
# a shape nobody tuned takes the nearest tuned shape's tiles from this many rows an expert up (mean rows: tokens x
# top-k / experts); below, few experts see a token each and the hand-written decode tiles were faster (H200, four
# untuned shapes: at 1 token on every one, at 8 on DeepSeek-V3's and gpt-oss-120b's, a quarter of a row)
TRANSFER_ROWS = 0.5
# from this many rows an expert, the decode defaults of 4-bit codes of a fixed zero under a 16-bit dot take one dot
# per weight group on long tiles (GROUP_DOT_TILE): on an H200 at a quarter of a row (8 tokens) 1.19x the narrow
# tiles on DeepSeek-V3's shape and 1.07x on gpt-oss-120b's; at one token (a sixteenth of a row or less) 0.89-1.06x
# over four shapes, so not there
GROUP_DOT_ROWS = 0.25
GROUP_DOT_TILE = {"BLOCK_N": 128, "BLOCK_K": 512, "GROUP_DOTS": True, "num_stages": 3}
# a device takes the tables of a device with the same SMs (the same die, clocks and SM count; only the memory
# differs) for what its own tables lack (every entry where it has none), said once in the log: nearer to its
# best than the untuned defaults. Both ways: each was tuned where the other was not (the H100 holds every
# benchmark shape and token count of most key pairs, the H200 per-channel FP8 on Mixtral's shape past one token)
TUNED_STAND_INS = {"NVIDIA H200": "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3": "NVIDIA H200"}


@functools.cache  # a layer call names its table by these on every call
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def config_file(weight_key: QuantKey | str, activation_key: QuantKey | str, device_name: str) -> Path:
    """Where tuned configs for a variant on a device live: configs/<device>__<weight>__<act>.json
    (the activation key is part of it: int8 and fp8 dots are tuned apart from 16-bit ones)."""
    return _config_path(CONFIG_DIR, device_name, str(weight_key), str(activation_key))


@functools.cache  # a layer call names its table (and its stand-in's) on every call; CONFIG_DIR is part of the key
def _config_path(config_dir: Path, device_name: str, weight_key: str, activation_key: str) -> Path:
    return config_dir / f"{_slug(device_name)}__{_slug(weight_key)}__{_slug(activation_key)}.json"


def shape_key(num_experts: int, top_k: int, n: int, k: int) -> str:
    """A tuned table's shape class: one GEMM (N outputs, K inputs) of a layer with E experts, top-k."""
    return f"E{num_experts}_top{top_k}_N{n}_K{k}"


@functools.cache
def _load_config_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with path.open() as f:
        return json.load(f)


def _pow2_floor(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def default_config(tokens: int, top_k: int, num_experts: int, n: int, k: int, weight_key: QuantKey | str,
                   num_sms: int = INTERPRETER_SMS, activation_key: QuantKey | str | None = None) -> dict:
    """Untuned tile config. Decode (few rows per expert): BLOCK_M 16 and 64-wide N tiles for more
    programs, and split-K when the tiles alone leave most of the ``num_sms`` idle; prefill: 64/128
    rows. Sub-16-bit weights take longer K tiles (a 4-bit tile of 128 is 64 bytes). Given the
    ``activation_key``, the tiles the pair runs best without a table (GROUP_DOT_ROWS); without it, the
    base a tuned entry's keys are laid over (an entry leaves out the options it does not take, so the base
    holds none)."""
    qk = parse_quant_key(weight_key) if isinstance(weight_key, str) else weight_key
    narrow = qk.quantized and qk.dtype.bits <= 8
    pairs = max(tokens * top_k, 1)
    rows = triton.cdiv(pairs, num_experts)
    if rows <= 8:  # random routing: an expert often gets twice the mean, and a second block rereads it
        bm, gm = 16, 1
    elif rows <= 32:
        bm, gm = 32, 4
    elif rows <= 96:
        bm, gm = 64, 8
    else:
        bm, gm = 128, 8
    bk = 128 if narrow else 64
    if bm <= 32:
        config = {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": 4, "num_stages": 4}
    else:
        config = {"BLOCK_M": bm, "BLOCK_N": 128, "BLOCK_K": bk, "GROUP_M": gm,
                  "num_warps": 8 if bm == 128 else 4, "num_stages": 3}
    if (activation_key is not None and bm == 16 and pairs / num_experts >= GROUP_DOT_ROWS
            and k >= 2 * GROUP_DOT_TILE["BLOCK_K"]
            and _takes_group_dot_tile(variant_from_keys(str(weight_key), str(activation_key)), bm)):
        config.update(GROUP_DOT_TILE)
    config["SPLIT_K"] = _split_k(pairs, num_experts, n, k, config, num_sms)
    return config


def _takes_group_dot_tile(variant: KernelVariant, block_m: int) -> bool:
    """Whether GROUP_DOT_TILE is what the decode defaults give ``variant``: 16-bit activations (what it was
    measured on) and weights whose tiles take one dot per group without ZERO_SUMS (a fixed zero code)."""
    return variant.act_quant == "none" and group_dot_width(variant, block_m) > 0


def _split_k(pairs: int, num_experts: int, n: int, k: int, config: dict, num_sms: int) -> int:
    """K pieces for a decode tile (BLOCK_M <= 32) that leaves most SMs idle: about two programs an SM."""
    if config["BLOCK_M"] > 32:
        return 1
    blocks = min(pairs, num_experts) + pairs // config["BLOCK_M"]  # about one per expert hit, + full ones
    tiles = blocks * triton.cdiv(n, config["BLOCK_N"])
    if tiles >= num_sms:
        return 1
    return max(min(_pow2_floor(2 * num_sms // tiles), _pow2_floor(k // (4 * config["BLOCK_K"])), 8), 1)


def _rows(tokens: int, top_k: int, num_experts: int) -> float:
    return max(tokens * top_k, 1) / num_experts


def _nearest_shape(table: dict, tokens: int, top_k: int, num_experts: int, n: int, k: int) -> tuple[str, str] | None:
    """The tuned entry (shape key, token count) of another shape whose GEMM is nearest this one: rows an expert
    sees (what BLOCK_M and the tile's reuse follow) within TUNED_REACH, then K and N (how long each program
    streams, how many programs there are), by ratio. None where no entry's rows are that near."""
    rows, best, best_d = _rows(tokens, top_k, num_experts), None, math.inf
    for shape, by_tokens in table.items():
        dims = re.fullmatch(r"E(\d+)_top(\d+)_N(\d+)_K(\d+)", shape)
        if dims is None or not isinstance(by_tokens, dict):
            continue
        e, top, tn, tk = map(int, dims.groups())
        for t in by_tokens:
            d_rows = abs(math.log(rows / _rows(int(t), top, e)))
            if d_rows > math.log(TUNED_REACH):
                continue
            d = d_rows + 0.5 * (abs(math.log(k / tk)) + abs(math.log(n / tn)))
            if d < best_d:
                best, best_d = (shape, t), d
    return best


def get_config(tokens: int, top_k: int, num_experts: int, n: int, k: int, weight_key: QuantKey | str,
               activation_key: QuantKey | str, device_name: str, num_sms: int = INTERPRETER_SMS, *,
               warn: bool = True) -> dict:
    """Tile config (BLOCK_M/N/K, GROUP_M, SPLIT_K, num_warps, num_stages) for one MoE GEMM of
    ``tokens`` tokens, top-k routing over ``num_experts``, projection ``n``×``k``.

    A tuned file (:func:`config_file`) maps :func:`shape_key` to ``{"<tokens>": config}``; the
    entry with the nearest token count (by ratio, within TUNED_REACH) wins and its keys override
    :func:`default_config`. A shape the file has no table for takes the entry of the nearest tuned
    shape (:func:`_nearest_shape`), split-K redone for its own programs, from TRANSFER_ROWS rows an
    expert up; below that, token counts nobody tuned, and devices without a file get the defaults.
    Both say so once, unless ``warn`` is False (a caller whose launch reads no tile).
    """
    def plain() -> dict:  # what an entry is laid over: the defaults without options (an entry names its own)
        return default_config(tokens, top_k, num_experts, n, k, weight_key, num_sms)

    path, table = _device_table(weight_key, activation_key, device_name, warn)
    shape = shape_key(num_experts, top_k, n, k)
    by_tokens = (table or {}).get(shape)
    if not by_tokens:
        # a shape nobody tuned takes the tiles tuned for the nearest shape of this scheme on this device (the
        # table knows the scheme's loop on this GPU, the hand-written defaults only its kind)
        near = (_nearest_shape(table, tokens, top_k, num_experts, n, k)
                if table and _rows(tokens, top_k, num_experts) >= TRANSFER_ROWS else None)
        config = (_transferred(plain(), table[near[0]][near[1]], tokens, top_k, num_experts, n, k, num_sms)
                  if near is not None else
                  default_config(tokens, top_k, num_experts, n, k, weight_key, num_sms, activation_key))
        if warn:
            why = (f"{path.name} has no {shape} table; taking its {near[0]} tiles tuned at {near[1]} tokens"
                   if near else f"{path.name} has no {shape} table" if table else f"no tuned config file {path}")
            _warn_default(device_name, str(weight_key), str(activation_key), shape, why,
                          "Using another shape's tuned MoE config" if near else "Using default MoE config")
        return config
    distance = {t: abs(math.log(int(t) / max(tokens, 1))) for t in by_tokens}
    nearest = min(distance, key=distance.__getitem__)
    if distance[nearest] <= math.log(TUNED_REACH):  # a decode entry says nothing about prefill
        return {**plain(), **by_tokens[nearest]}
    if warn:
        why = f"{path.name}'s {shape} table is tuned at {', '.join(by_tokens)} tokens, none near {tokens}"
        _warn_default(device_name, str(weight_key), str(activation_key), shape, why)
    return default_config(tokens, top_k, num_experts, n, k, weight_key, num_sms, activation_key)


def _device_table(weight_key: QuantKey | str, activation_key: QuantKey | str, device_name: str,
                  warn: bool) -> tuple[Path, dict | None]:
    """The device's tuned table for the key pair, the (shape, token count) entries it lacks taken from its
    stand-in's table (said once), and the path of the table it is named by (its own where it has one)."""
    path = config_file(weight_key, activation_key, device_name)
    table = _load_config_file(path)
    stand_in = TUNED_STAND_INS.get(device_name)
    if stand_in is None:
        return path, table
    stand_in_path = config_file(weight_key, activation_key, stand_in)
    stand_in_table = _load_config_file(stand_in_path)
    if stand_in_table is None:
        return path, table
    if warn:
        _say_stand_in(device_name, stand_in, stand_in_path, table is not None)
    if table is None:
        return stand_in_path, stand_in_table
    return path, _with_stand_in(table, stand_in_table)


# merged tables by the ids of the two loaded ones (held with them, so an id names no other): a layer call
# looks its table up on every call
_MERGED: dict[tuple[int, int], tuple[dict, dict, dict]] = {}


def _with_stand_in(table: dict, stand_in_table: dict) -> dict:
    """``table`` with each shape's token counts it lacks (and shapes) from ``stand_in_table``: an entry tuned on
    the device itself wins, the stand-in's are nearer than the defaults (a decode entry says nothing of prefill)."""
    key = (id(table), id(stand_in_table))
    kept = _MERGED.get(key)
    if kept is not None and kept[0] is table and kept[1] is stand_in_table:
        return kept[2]
    merged = dict(stand_in_table)
    for shape, entries in table.items():
        by_tokens = stand_in_table.get(shape)
        merged[shape] = {**by_tokens, **entries} if isinstance(by_tokens, dict) and shape != "meta" else entries
    _MERGED[key] = (table, stand_in_table, merged)
    return merged


def _transferred(defaults: dict, entry: dict, tokens: int, top_k: int, num_experts: int, n: int, k: int,
                 num_sms: int) -> dict:
    """Another shape's tuned ``entry`` over this GEMM's defaults, split-K redone for this GEMM's own programs."""
    config = {**defaults, **entry}
    config["SPLIT_K"] = _split_k(max(tokens * top_k, 1), num_experts, n, k, config, num_sms)
    return config


def nearest_shape_config(tokens: int, top_k: int, num_experts: int, n: int, k: int, weight_key: QuantKey | str,
                         activation_key: QuantKey | str, device_name: str,
                         num_sms: int = INTERPRETER_SMS) -> dict | None:
    """What the nearest tuned shape's entry gives this GEMM, whatever the rows an expert sees (get_config takes it
    from TRANSFER_ROWS up, for a shape the table lacks; tools/bench_untuned.py times it everywhere); None where
    the device has no table or no entry's rows are in reach."""
    _, table = _device_table(weight_key, activation_key, device_name, False)
    near = _nearest_shape(table, tokens, top_k, num_experts, n, k) if table else None
    if near is None:
        return None
    defaults = default_config(tokens, top_k, num_experts, n, k, weight_key, num_sms)
    return _transferred(defaults, table[near[0]][near[1]], tokens, top_k, num_experts, n, k, num_sms)


_WARNED_DEFAULT: set[tuple[str, str, str, str]] = set()
_SAID_STAND_IN: set[Path] = set()


def _say_stand_in(device_name: str, stand_in: str, path: Path, own: bool) -> None:
    """Say once per table that a device runs on another device's tuned tiles (``own``: where its own table lacks
    an entry)."""
    if path in _SAID_STAND_IN:
        return
    _SAID_STAND_IN.add(path)
    log.info("MoE tiles for %s: %s%s, tuned on %s (same SMs; tools/tune.py tunes this device)", device_name,
             "where its own table has no entry, " if own else "", path.name, stand_in)


def _warn_default(device_name: str, weight_key: str, activation_key: str, shape: str, why: str,
                  what: str = "Using default MoE config") -> None:
    """Say once per (device, keys, shape) that a GEMM runs on tiles not tuned for it (as vLLM's "Using
    default MoE config"): a shape nobody tuned is often several times slower than a tuned one. ``what``:
    which tiles it runs instead."""
    seen = (device_name, weight_key, activation_key, shape)
    if seen in _WARNED_DEFAULT:
        return
    _WARNED_DEFAULT.add(seen)
    log.warning("%s for %s on %s (weight %s, activation %s): %s; performance might be sub-optimal (tools/tune.py "
                "tunes it)", what, shape, device_name, weight_key, activation_key, why)


_OVERRIDE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("moe_config_override", default=None)


@contextlib.contextmanager
def config_override(gemm1: dict | None = None, gemm2: dict | None = None):
    """Run the layers called inside with these tile configs (keys as in :func:`get_config`; GEMM2
    takes GEMM1's BLOCK_M, since both walk the same aligned blocks). For the tuner and for tests
    that run tuned configs through the conformance cases."""
    token = _OVERRIDE.set({"gemm1": gemm1, "gemm2": gemm2})
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def group_dot_width(variant: KernelVariant, block_m: int, zero_sums: bool = False) -> int:
    """The weight group a tile's per-group dots (the ``GROUP_DOTS`` config key: one dot per group,
    each group's scale on its result) span, or 0 where the variant cannot take them: 4-bit integer
    codes with a fixed zero code (or with zero points, on ``zero_sums`` tiles: ZERO_SUMS) and group
    scales of 32 columns or more, under a 16-bit dot (16-bit activations, or W4A8's codes on tiles
    of few rows: variant.float_w4a8). The kernel takes them on tiles of BLOCK_M <= 32 that span
    several groups, on weights without act-order."""
    sixteen_bit_dot = variant.act_quant == "none" or variant.float_w4a8(block_m)
    zero = variant.zero_code > 0 or zero_sums and takes_zero_sums(variant)
    takes = (variant.packed and zero and variant.weight_scale == "group" and sixteen_bit_dot
             and variant.weight_group >= 32)
    return variant.weight_group if takes else 0


def takes_zero_sums(variant: KernelVariant) -> bool:
    """Whether the variant's tiles can take the ``ZERO_SUMS`` config key (zero points on the
    factored dot, corrected by the layer's per-group input sums; see gemm.FACTORED): integer
    codes with zero points (uint4, uint8), or 4-bit codes of a fixed zero (uint4b8, int4: bfloat16 dots
    of the raw codes, see gemm.RAW_CODES), and group scales under a 16-bit dot."""
    codes = variant.weight_type in ("uint4", "uint8") or variant.packed and variant.zero_code > 0
    return codes and variant.weight_scale == "group" and variant.act_quant == "none"


def zero_sums_fit(variant: KernelVariant, config: dict) -> bool:
    """Whether a fitted tile takes ZERO_SUMS (:func:`takes_zero_sums`): the standard kernel's tiles
    of BLOCK_M <= 32 whose K tile lies in one group, or takes one dot per group (GROUP_DOTS)."""
    return (takes_zero_sums(variant) and not config["SWAP_AB"] and config["BLOCK_M"] <= 32
            and (variant.weight_group % config["BLOCK_K"] == 0 or bool(config.get("GROUP_DOTS"))))


def input_halves_fit(variant: KernelVariant, config: dict) -> bool:
    """Whether a fitted GEMM2 config can read its input as GEMM1's epilogue stores it on request, its
    even columns then its odd ones (the ``INPUT_HALVES`` key): the nibble half-dots' two operands as
    two contiguous loads, where the plain tile splits every step's activations (every warp its own
    copy, two half-word selects a register pair). 4-bit weights on the 16-bit dot, unquantised
    activations, the standard kernel, no ZERO_SUMS (its input sums read the columns in order)."""
    return (variant.packed and variant.dot == "float" and variant.act_quant == "none" and not config["SWAP_AB"]
            and not config.get("ZERO_SUMS"))


def _fit_config(config: dict, variant: KernelVariant, *, can_split: bool, can_swap: bool = True) -> dict:
    """A config made legal for the variant: BLOCK_K no wider than a weight block or an fp8
    activation group (their scales change inside the tile otherwise), at least 32 for 4-bit
    weights (each nibble half-dot needs K >= 16); SPLIT_K 1 where the launch cannot split;
    SWAP_AB (the swapped-operand kernel) only where it runs the variant; GROUP_DOTS kept only
    where the tile spans several of the variant's groups (group_dot_width; absent otherwise);
    ZERO_SUMS kept only where the tile can take it (zero_sums_fit; absent otherwise), INPUT_HALVES
    likewise (input_halves_fit)."""
    config = dict(config)
    config["SWAP_AB"] = bool(config.get("SWAP_AB", False)) and can_swap and swappable(variant)
    bk = config["BLOCK_K"]
    zero_sums = config.pop("ZERO_SUMS", False)
    halves = config.pop("INPUT_HALVES", False)
    group_dots = (config.pop("GROUP_DOTS", False) and not config["SWAP_AB"]
                  and 0 < group_dot_width(variant, config["BLOCK_M"], zero_sums) < bk)
    if variant.weight_scale == "block":
        bk = min(bk, variant.weight_group)
    if variant.act_quant == "fp8_group":
        bk = min(bk, variant.act_group)
    if variant.dot == "int8" and variant.weight_scale == "group" and not group_dots:
        bk = min(bk, variant.weight_group)  # W4A8: a K tile's int32 dot takes one group's scale
    if variant.packed:
        bk = max(bk, 32)
    config["BLOCK_K"] = bk
    config["BLOCK_N"] = max(config["BLOCK_N"], 32)
    if group_dots:
        config["GROUP_DOTS"] = True
    if zero_sums and zero_sums_fit(variant, config):
        config["ZERO_SUMS"] = True
    elif group_dots and variant.zero_code == 0:  # zero-point weights take per-group dots with ZERO_SUMS only
        del config["GROUP_DOTS"]
    if halves and input_halves_fit(variant, config):
        config["INPUT_HALVES"] = True
    if not can_split:
        config["SPLIT_K"] = 1
    config.setdefault("SPLIT_K", 1)
    return config


# the fitted (GEMM1, GEMM2) configs of recent layer calls, with the table they came from: every layer of a model asks
# for the same few token counts at each step, and finding a pair again took longer than launching a decode GEMM
# (about 60 us a layer on a 2-vCPU host)
_LAYER_CONFIGS: collections.OrderedDict = collections.OrderedDict()
LAYER_CONFIGS_KEPT = 1024


def _layer_configs(tokens: int, top_k: int, num_experts: int, w13, w2, weight_key: str,
                   activation_key: str, variant: KernelVariant, device: torch.device, *,
                   split_gemm2: bool, tiles_read: tuple[bool, bool] = (True, True)) -> tuple[dict, dict]:
    """GEMM1 and GEMM2 configs (overridden, tuned or default), fitted; GEMM2 shares BLOCK_M.
    ``w13`` and ``w2`` give each GEMM's shape as ``n`` outputs and ``k`` inputs. ``tiles_read``:
    whether each GEMM's launch reads its tile config (not the decode GEMV's): an untuned one that is
    not read is not warned about. Kept per call's arguments and the device's table (a table read again is
    another key); an override is never kept."""
    name, sms = _device_name(device), _num_sms(device)
    override = _OVERRIDE.get() or {}
    if not override:
        path, table = _device_table(weight_key, activation_key, name, False)
        key = (tokens, top_k, num_experts, w13.n, w13.k, w2.n, w2.k, str(weight_key), str(activation_key), variant,
               name, sms, split_gemm2, tiles_read, path, id(table))
        kept = _LAYER_CONFIGS.get(key)
        if kept is not None and kept[0] is table:
            _LAYER_CONFIGS.move_to_end(key)
            return dict(kept[1]), dict(kept[2])
    config1 = override.get("gemm1") or get_config(tokens, top_k, num_experts, w13.n, w13.k, weight_key,
                                                  activation_key, name, sms, warn=tiles_read[0])
    config2 = override.get("gemm2") or get_config(tokens, top_k, num_experts, w2.n, w2.k, weight_key,
                                                  activation_key, name, sms, warn=tiles_read[1])
    fitted = _fit_pair(config1, config2, variant, split_gemm2=split_gemm2)
    if not override:
        _LAYER_CONFIGS[key] = (table, *fitted)  # the table held: its id names no other while kept
        if len(_LAYER_CONFIGS) > LAYER_CONFIGS_KEPT:
            _LAYER_CONFIGS.popitem(last=False)
    return dict(fitted[0]), dict(fitted[1])


def _fit_pair(config1: dict, config2: dict, variant: KernelVariant, *, split_gemm2: bool = True) -> tuple[dict, dict]:
    """A layer's GEMM1 and GEMM2 configs made legal together (:func:`_fit_config`): GEMM1 unsplit
    (it applies the activation), GEMM2 on GEMM1's BLOCK_M (both walk the same aligned blocks);
    ``split_gemm2`` False (the batched format): no split and no swapped kernel either. GEMM2 reads its
    input in halves (INPUT_HALVES) only where the plain kernel's epilogue of the standard format's
    GEMM1 writes them; GEMM1's own input is the hidden state, in order."""
    config1 = _fit_config({k: v for k, v in config1.items() if k != "INPUT_HALVES"}, variant, can_split=False,
                          can_swap=split_gemm2)
    config2 = _fit_config({**config2, "BLOCK_M": config1["BLOCK_M"]}, variant, can_split=split_gemm2,
                          can_swap=split_gemm2)
    if config2.get("INPUT_HALVES") and (config1["SWAP_AB"] or not split_gemm2):
        del config2["INPUT_HALVES"]
    return config1, config2


@functools.cache
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.cache
def _num_sms(device: torch.device) -> int:
    """The multiprocessors the tiles should keep busy: the GPU's own count."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS
