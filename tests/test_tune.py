"""tools/tune.py end to end through the interpreter: configs written where the kernel reads them,
picked up by get_config, and an interrupted run resumes instead of starting over; the search
keeps today's configs unless a candidate beats them side by side."""

import json
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
AWQ = "uint4 scale:float16:group(128):static zp:group"


def _config_module():
    """The module whose CONFIG_DIR the kernel's config_file reads (triton_moe, or where it moved)."""
    import sys

    from moe_registry_kernels.triton import tile_config

    return sys.modules[tile_config.config_file.__module__]


def _tune(out: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """tools/tune.py's main() in this process (exit code, stdout)."""
    import tune

    code = tune.main(["--dry-run", "--schemes", "awq-w4a16", "--out", str(out), *args])
    return code, capsys.readouterr().out


def test_tune_writes_configs_and_resumes(tmp_path, monkeypatch, capsys):
    """The whole tool on the tiny dry-run shape. Each candidate is still run once and checked against
    the reference by the tool; its timing is a constant, because the interpreter's times say nothing
    and repeating each call would take minutes."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench

    def one_call(fn, min_seconds, device, warmup_seconds=0.0):
        return 1e-3

    monkeypatch.setattr(bench, "_median_time", one_call)
    code, out = _tune(tmp_path, capsys, "--m", "1")
    assert code == 0
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == ["dry_run__uint4_scale_float16_group_128_static_zp_group__unquantized.json"]
    assert not list(tmp_path.glob("*.partial"))  # the entry's measurements go once it is written
    table = json.loads(files[0].read_text())
    # tiny shape: E=8, top-2, hidden 128, intermediate 128; one entry per GEMM for M=1
    assert table.pop("meta") == {"device": "dry-run", "weight_key": AWQ, "activation_key": "unquantized"}
    assert set(table) == {"E8_top2_N256_K128", "E8_top2_N128_K128"}
    for by_tokens in table.values():
        assert set(by_tokens) == {"1"}
        config = by_tokens["1"]
        assert {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"} <= set(config)
    assert f"{'tiny':<10}{'awq-w4a16':<26}{1:>6}" in out

    # the kernel reads the file for that device name
    from moe_registry_kernels.triton import tile_config

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    try:
        got = tile_config.get_config(1, 2, 8, 128, 128, AWQ, "unquantized", "dry-run")
        assert {k: got[k] for k in table["E8_top2_N128_K128"]["1"]} == table["E8_top2_N128_K128"]["1"]
    finally:
        tile_config._load_config_file.cache_clear()
    monkeypatch.undo()  # the tool writes to --out again, not to CONFIG_DIR
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.setattr(bench, "_median_time", one_call)

    # done entries are skipped; a new M is added next to them
    code, out = _tune(tmp_path, capsys, "--m", "1", "8")
    assert code == 0
    assert f"{'tiny':<10}{'awq-w4a16':<26}{1:>6}" not in out and f"{'tiny':<10}{'awq-w4a16':<26}{8:>6}" in out
    table = json.loads(files[0].read_text())
    table.pop("meta")
    assert all(set(by_tokens) == {"1", "8"} for by_tokens in table.values())


def test_prefill_candidates_include_the_swapped_kernel_only_where_it_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    for bm in (64, 128):
        plain = tune.tile_candidates(bm, narrow=True)
        both = tune.tile_candidates(bm, narrow=True, swap=True)
        assert not any(c["SWAP_AB"] for c in plain)
        assert plain == [c for c in both if not c["SWAP_AB"]] and any(c["SWAP_AB"] for c in both)
    # 256 token rows only as the swapped kernel's wide side
    assert tune.tile_candidates(256, narrow=True) == []
    assert {c["SWAP_AB"] for c in tune.tile_candidates(256, narrow=True, swap=True)} == {True}
    mixtral = tune.bench.SHAPES["mixtral"]
    assert 256 in tune.block_ms(4096, mixtral)
    # compiling ahead skips block sizes without candidates (int8 dots never swap)
    pairs = tune.all_pairs(mixtral, tune.bench.registry_schemes()["quark-w8a8-int8"], [4096])
    assert pairs and all(c1["BLOCK_M"] != 256 for c1, _ in pairs)


class _SlowCandidates:
    """A stand-in layer on which today's configs take 1 s and every candidate 2 s."""

    def __init__(self, tune) -> None:
        from moe_registry.core.keys import parse_quant_key

        self.shape = tune.bench.DRY_SHAPES["tiny"]
        self.wkey, self.akey = parse_quant_key(AWQ), parse_quant_key("unquantized")
        self.device = __import__("torch").device("cpu")

    def inputs(self, m):
        return None, None, None

    def reference(self, *args):
        return None

    def error(self, configs, *args):
        return 0.0

    def time(self, configs, *args):
        return 1.0 if configs == (None, None) else 2.0


def test_tuner_keeps_todays_configs_unless_beaten(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    today = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 8,
             "num_stages": 2}
    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    table = {"E8_top2_N256_K128": {"1": today}, "E8_top2_N128_K128": {"1": today}}
    (tmp_path / tile_config.config_file(AWQ, "unquantized", "cpu").name).write_text(json.dumps(table))
    log: list[str] = []
    try:
        c1, c2, t, base = tune.tune_target(_SlowCandidates(tune), 1, 1e-2, log, limit=2, splits=(1,))
    finally:
        tile_config._load_config_file.cache_clear()
    assert (t, base) == (1.0, 1.0)
    assert {k: c1[k] for k in today} == today and {k: c2[k] for k in today} == today
    # the log (printed by --verbose) holds today's time, then every candidate's with its two configs
    assert log[0].startswith("  1000000.0 us today's configs {'BLOCK_M': 16, 'BLOCK_N': 128")
    timed = log[1:]
    assert len(timed) >= 2 and all(line.startswith("  2000000.0 us {") for line in timed)
    assert len({line for line in timed}) == len(timed)  # each candidate pair once


class _LuckyCandidates(_SlowCandidates):
    """Every candidate times at ``search_s`` during the search (today's configs at 1 s), and at
    ``side_by_side_s`` once today's configs are timed again (the confirmation)."""

    def __init__(self, tune, search_s: float, side_by_side_s: float) -> None:
        super().__init__(tune)
        self.search_s, self.side_by_side_s, self.today_timings = search_s, side_by_side_s, 0

    def time(self, configs, *args):
        if configs == (None, None):
            self.today_timings += 1
            return 1.0
        return self.search_s if self.today_timings == 1 else self.side_by_side_s


@pytest.mark.parametrize("side_by_side_s,keeps_today", [(0.99, True), (0.5, False)])
def test_tuner_confirms_a_winner_side_by_side(side_by_side_s, keeps_today, tmp_path, monkeypatch):
    """A candidate that won the search by luck (clocks, timing) loses to today's configs when the
    two are timed alternately, and today's stay; a real winner is kept, with its confirmed time."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    layer = _LuckyCandidates(tune, search_s=0.5, side_by_side_s=side_by_side_s)
    log: list[str] = []
    c1, c2, t, base = tune.tune_target(layer, 1, 1e-2, log, limit=2, splits=(1,))
    assert layer.today_timings == 1 + tune.CONFIRM_ROUNDS
    today = tile_config.get_config(1, 2, 8, 256, 128, AWQ, "unquantized", "cpu")
    if keeps_today:
        assert (c1, t, base) == (today, 1.0, 1.0)
        assert "kept today's configs: 1000000.0 us against 990000.0 us" in log[-1]
    else:
        assert c1 != today and (t, base) == (0.5, 1.0)


def test_alternated_takes_the_steps_in_turn(monkeypatch):
    """Each round takes every step once, in order (so each sees the GPU the others see)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    calls: list[str] = []
    steps = [lambda: calls.append("a") or 1.0, lambda: calls.append("b") or 2.0]
    assert tune.alternated(steps, 3) == [[1.0] * 3, [2.0] * 3]
    assert calls == ["a", "b"] * 3


class _RegisterBound(_SlowCandidates):
    """Today's configs and every tile candidate take 1 s; GEMM1 capped at 80 registers a thread
    saves 0.25 s and GEMM2 capped at 96 another 0.25 s. Records the config pairs timed."""

    def __init__(self, tune) -> None:
        super().__init__(tune)
        self.timed: list[tuple[dict, dict]] = []

    def time(self, configs, *args):
        if configs == (None, None):
            return 1.0
        self.timed.append(configs)
        c1, c2 = configs
        return 1.0 - 0.25 * (c1.get("maxnreg") == 80) - 0.25 * (c2.get("maxnreg") == 96)


@pytest.mark.parametrize("registers_only", [True, False])
def test_tuner_caps_registers_of_the_winner(registers_only, tmp_path, monkeypatch):
    """Register caps are tried on the winning tiles, GEMM1's then GEMM2's, and kept where they are
    faster; --registers-only tries nothing else (today's tiles stay as they are)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    layer = _RegisterBound(tune)
    c1, c2, t, base = tune.tune_target(layer, 1, 1e-2, [], limit=2, splits=(1,), registers_only=registers_only)
    today1 = tile_config.get_config(1, 2, 8, 256, 128, AWQ, "unquantized", "cpu")
    today2 = tile_config.get_config(1, 2, 8, 128, 128, AWQ, "unquantized", "cpu")
    assert (c1["maxnreg"], c2["maxnreg"]) == (80, 96) and (t, base) == (0.5, 1.0)
    tiles = [({k: v for k, v in a.items() if k != "maxnreg"}, {k: v for k, v in b.items() if k != "maxnreg"})
             for a, b in layer.timed]
    if registers_only:
        assert {k: c1[k] for k in today1} == today1 and {k: c2[k] for k in today2} == today2
        assert all(pair == (today1, today2) for pair in tiles)
        assert len(layer.timed) == 2 * len(tune.REGISTER_CAPS) + tune.CONFIRM_ROUNDS  # + the confirmation
    else:
        assert len(layer.timed) > 2 * len(tune.REGISTER_CAPS) + tune.CONFIRM_ROUNDS
        assert any(pair != (today1, today2) for pair in tiles)


GPTQ = "uint4b8 scale:float16:group(128):static"


class _HalvesWin(_RegisterBound):
    """_RegisterBound on which a GEMM2 reading its input in halves saves 0.25 s more."""

    def __init__(self, tune, wkey: str) -> None:
        from moe_registry.core.keys import parse_quant_key

        super().__init__(tune)
        self.wkey = parse_quant_key(wkey)

    def time(self, configs, *args):
        t = super().time(configs, *args)
        return t - 0.25 * bool(configs != (None, None) and configs[1].get("INPUT_HALVES"))


@pytest.mark.parametrize("wkey, takes_halves", [(None, True), ("int8 scale:float16:channel:static", False)])
@pytest.mark.parametrize("registers_only", [True, False])
def test_tuner_tries_gemm2_reading_its_input_in_halves_on_the_winner(wkey, takes_halves, registers_only, tmp_path,
                                                                     monkeypatch):
    """After the search, the winner's GEMM2 is timed reading its input in halves (INPUT_HALVES) where the
    scheme's tiles take it (4-bit weights on 16-bit dots), kept where faster and then register-capped;
    not on 8-bit weights, nor in a --registers-only run."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    layer = _HalvesWin(tune, wkey or GPTQ)
    c1, c2, t, _ = tune.tune_target(layer, 1, 1e-2, [], limit=2, splits=(1,), registers_only=registers_only)
    tried = [b for _, b in layer.timed if b.get("INPUT_HALVES")]
    if takes_halves and not registers_only:
        assert c2.get("INPUT_HALVES") is True and c2["maxnreg"] == 96 and t == 0.25
        # once, then under both GEMMs' caps, then in the confirmation
        assert len(tried) == 1 + 2 * len(tune.REGISTER_CAPS) + tune.CONFIRM_ROUNDS
    else:
        assert tried == [] and "INPUT_HALVES" not in c2 and t == 0.5


class _SeedWins(_RegisterBound):
    """_RegisterBound on which only ``fast`` (a GEMM1 tile, BLOCK_N and BLOCK_K) saves time."""

    def __init__(self, tune, fast: dict) -> None:
        super().__init__(tune)
        self.fast = fast

    def time(self, configs, *args):
        if configs == (None, None):
            return 1.0
        self.timed.append(configs)
        c1 = configs[0]
        return 0.5 if all(c1.get(k) == v for k, v in self.fast.items()) and "maxnreg" not in c1 else 1.0


@pytest.mark.parametrize("seeds_only", [True, False])
def test_tuner_starts_from_other_key_pairs_tables(seeds_only, tmp_path, monkeypatch):
    """The configs another key pair's table holds for the same GEMM shapes and token count are
    timed first (whole, and each half with today's other half), fitted to this scheme: W4A8
    starts from GPTQ int4's per-group-dot tiles. The swapped kernel's tiles are no seed for a
    scheme it does not run, a table at another token count gives none, and neither does the
    scheme's own table. --seeds-only times nothing else but the register caps on the winner."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config
    from moe_registry_kernels.triton import variant as triton_variant

    from moe_registry.core.keys import parse_quant_key

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    keys = ("uint4b8 scale:float32:group(128):static", "int8 scale:float32:token:dynamic")  # W4A8
    tile = {"BLOCK_M": 16, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}
    seed1 = {**tile, "BLOCK_N": 32, "BLOCK_K": 512, "GROUP_DOTS": True, "maxnreg": 96}
    seed2 = {**tile, "BLOCK_N": 128, "BLOCK_K": 64}
    gemms = ("E8_top2_N256_K128", "E8_top2_N128_K128")
    tables = {
        (GPTQ, "unquantized"): {gemms[0]: {"1": seed1}, gemms[1]: {"1": seed2}},
        # the swapped kernel's tile (W4A8 has no swapped kernel) and another token count: no seeds
        (GPTQ, "fp8e4m3 scale:float32:token:dynamic"): {
            gemms[0]: {"1": {**seed1, "BLOCK_N": 64, "SWAP_AB": True}}, gemms[1]: {"1": {**seed2, "SWAP_AB": True}}},
        ("int8 scale:float32:channel:static", "unquantized"): {gemms[0]: {"8": seed2}, gemms[1]: {"8": seed2}},
    }
    for pair, table in tables.items():
        (tmp_path / tile_config.config_file(*pair, "cpu").name).write_text(json.dumps(table))
    layer = _SeedWins(tune, {"BLOCK_N": 32, "BLOCK_K": 512, "GROUP_DOTS": True})
    layer.wkey, layer.akey = parse_quant_key(keys[0]), parse_quant_key(keys[1])
    kscheme = triton_variant.variant_from_keys(*keys)

    def seeds() -> list[tuple]:
        today = tune.todays_configs(layer.shape, keys, 1, "cpu", 132)
        pairs = tune.seed_pairs(layer.shape, keys, 1, "cpu", kscheme, today)
        assert all(not c["SWAP_AB"] for pair in pairs for c in pair)
        return [(c1["BLOCK_N"], c1["BLOCK_K"], c1.get("GROUP_DOTS"), c1.get("maxnreg"), c2["BLOCK_N"], c2["BLOCK_K"])
                for c1, c2 in pairs], today

    got, today = seeds()
    # each seed as tuned and without its register cap (a cap fits the kernel it was tuned on)
    assert got == [(32, 512, True, 96, 128, 64), (32, 512, True, None, 128, 64),
                   (32, 512, True, 96, today[1]["BLOCK_N"], today[1]["BLOCK_K"]),
                   (32, 512, True, None, today[1]["BLOCK_N"], today[1]["BLOCK_K"]),
                   (today[0]["BLOCK_N"], today[0]["BLOCK_K"], None, None, 128, 64)]
    # the scheme's own table is no seed (and is today's configs)
    (tmp_path / tile_config.config_file(*keys, "cpu").name).write_text(
        json.dumps({gemms[0]: {"1": seed2}, gemms[1]: {"1": seed2}}))
    tile_config._load_config_file.cache_clear()
    got, today = seeds()
    assert got == [(32, 512, True, 96, 128, 64), (32, 512, True, None, 128, 64)]  # halves: today's or the whole
    try:
        c1, c2, t, base = tune.tune_target(layer, 1, 1e-2, [], limit=2, splits=(1,), seeds_only=seeds_only)
    finally:
        tile_config._load_config_file.cache_clear()
    # the uncapped seed wins (_SeedWins: a capped tile is no faster)
    assert (c1["BLOCK_N"], c1["BLOCK_K"], c1["GROUP_DOTS"], c1.get("maxnreg"), t, base) == (32, 512, True, None,
                                                                                          0.5, 1.0)
    assert [c["BLOCK_K"] for c, _ in layer.timed[:2]] == [512, 512]  # the seeds come first
    searched = len(layer.timed) - 2 - 2 * len(tune.REGISTER_CAPS) - tune.CONFIRM_ROUNDS
    assert searched == 0 if seeds_only else searched > 0


def test_schemes_that_take_zero_sums_try_todays_tiles_on_them_first(tmp_path, monkeypatch):
    """GPTQ int4 (a fixed zero) and AWQ (zero points) take ZERO_SUMS: the first seed is today's pair on the
    factored dot, where the fit keeps it; W4A8 (no 16-bit dot) gets no such seed."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config
    from moe_registry_kernels.triton import variant as triton_variant

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    shape = tune.bench.Shape("tiny", experts=8, top_k=2, hidden=128, intermediate=128)
    today = ({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
              "num_stages": 3, "SWAP_AB": False},) * 2
    for keys, seeded in (((GPTQ, "unquantized"), True),
                         (("uint4 scale:float16:group(128):static zp:group", "unquantized"), True),
                         (("uint4b8 scale:float32:group(128):static", "int8 scale:float32:token:dynamic"), False)):
        pairs = tune.seed_pairs(shape, keys, 1, "cpu", triton_variant.variant_from_keys(*keys), today)
        assert [(c1.get("ZERO_SUMS"), c2.get("ZERO_SUMS")) for c1, c2 in pairs] == ([(True, True)] if seeded else [])
        if seeded:
            assert all({k: c[k] for k in today[0]} == today[0] for c in pairs[0])
    tile_config._load_config_file.cache_clear()


def test_seeds_only_and_registers_only_exclude_each_other(tune_fake, tmp_path, capsys):
    args = ["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "--out", str(tmp_path)]
    assert tune_fake.main([*args, "--seeds-only", "--registers-only"]) == 2
    assert "--registers-only and --seeds-only exclude each other" in capsys.readouterr().err


class _KilledAt(_RegisterBound):
    """_RegisterBound whose ``kill_at``-th candidate timing is killed (a time limit's kill); the
    candidate pairs time differently, so the winner depends on every measurement."""

    def __init__(self, tune, kill_at: int | None = None) -> None:
        super().__init__(tune)
        self.kill_at = kill_at

    def time(self, configs, *args):
        if configs == (None, None):
            return 1.0
        if len(self.timed) + 1 == self.kill_at:
            raise KeyboardInterrupt
        c1, c2 = configs
        return super().time(configs) - 1e-4 * (c1["BLOCK_N"] + c2["BLOCK_N"] / 7 + c2["SPLIT_K"])


def test_a_search_killed_midway_goes_on_from_its_last_measurement(tmp_path, monkeypatch):
    """Each candidate's measurement is on disk as it is taken: the search run again after a kill
    times only what the first run had not, and ends where an uninterrupted search ends."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    search = {"limit": 2, "splits": (1, 2)}
    whole = _KilledAt(tune)
    expected = tune.tune_target(whole, 1, 1e-2, [], **search)
    candidates = list(whole.timed)
    assert len(candidates) > 8

    path = tmp_path / "table.json.partial"
    first = _KilledAt(tune, kill_at=6)
    with pytest.raises(KeyboardInterrupt):
        tune.tune_target(first, 1, 1e-2, [], taken=tune.Measurements(path, "cpu", "E8 M=1"), **search)
    assert len(first.timed) == 5
    record = json.loads(path.read_text())
    assert record["device"] == "cpu" and len(record["entries"]["E8 M=1"]) == 5

    again = _KilledAt(tune)
    seen: list[int] = []
    got = tune.tune_target(again, 1, 1e-2, [], taken=tune.Measurements(path, "cpu", "E8 M=1"),
                           progress=seen.append, **search)
    assert got == expected
    assert first.timed + again.timed == candidates  # nothing timed twice, nothing left out
    assert seen == list(range(6, len(candidates) - tune.CONFIRM_ROUNDS + 1))


def test_the_search_takes_todays_block_m_first(tmp_path, monkeypatch):
    """A budget can cut a search short (Mixtral's M = 512 ran out after its 32-row tiles): the BLOCK_M of today's
    configs is searched first, then the others in their order."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    today = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tune, "block_ms", lambda m, shape: [16, 32, 64])
    tile_config._load_config_file.cache_clear()
    table = {"E8_top2_N256_K128": {"1": today}, "E8_top2_N128_K128": {"1": today}}
    (tmp_path / tile_config.config_file(AWQ, "unquantized", "cpu").name).write_text(json.dumps(table))
    layer = _RegisterBound(tune)
    try:
        tune.tune_target(layer, 1, 1e-2, [], limit=2, splits=(1,), seeds=[])
    finally:
        tile_config._load_config_file.cache_clear()
    assert list(dict.fromkeys(c1["BLOCK_M"] for c1, _ in layer.timed)) == [64, 16, 32]


def test_a_search_past_its_deadline_stops_at_the_first_candidate_not_measured(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    path = tmp_path / "table.json.partial"
    layer = _KilledAt(tune)
    with pytest.raises(tune.SearchCutOff):
        tune.tune_target(layer, 1, 1e-2, [], limit=2, splits=(1,), taken=tune.Measurements(path, "cpu", "M=1"),
                         deadline=0.0)
    assert layer.timed == [] and not path.exists()
    # measured before the cut-off: a refused candidate stays refused (logged), the rest are read back
    whole = _KilledAt(tune)
    expected = tune.tune_target(whole, 1, 1e-2, [], limit=2, splits=(1,), taken=tune.Measurements(path, "cpu", "M=1"))
    record = json.loads(path.read_text())["entries"]["M=1"]
    refused = next(iter(record))
    record[refused] = None
    path.write_text(json.dumps({"device": "cpu", "entries": {"M=1": record}}))
    layer, log = _KilledAt(tune), []
    got = tune.tune_target(layer, 1, 1e-2, log, limit=2, splits=(1,), taken=tune.Measurements(path, "cpu", "M=1"),
                           deadline=0.0)
    assert len(layer.timed) == tune.CONFIRM_ROUNDS  # only the side-by-side confirmation
    assert got[:2] == expected[:2]
    assert [line.endswith(": refused before the search was cut off") for line in log
            if line.lstrip().startswith("skip")] == [True]


def test_measurements_of_another_device_or_unreadable_are_not_used(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    path = tmp_path / "t.json.partial"
    c = {"BLOCK_M": 16}
    path.write_text(json.dumps({"device": "NVIDIA H200", "entries": {"M=1": {tune.pair_key(c, c): 1.0}}}))
    kept = tune.Measurements(path, "NVIDIA H100 80GB HBM3", "M=1")
    assert len(kept) == 0
    assert capsys.readouterr().err.strip() == (f"tune.py: {path}: measured on 'NVIDIA H200', not "
                                                 "'NVIDIA H100 80GB HBM3'; starting over")
    path.write_text("{not json")
    assert len(tune.Measurements(path, "cpu", "M=1")) == 0
    assert capsys.readouterr().err.strip() == (f"tune.py: {path}: not a record of measurements "
                                                 "(JSONDecodeError); starting over")
    # two entries share the file; finishing one keeps the other's record, finishing both removes it
    path.unlink()
    one, two = tune.Measurements(path, "cpu", "M=1"), tune.Measurements(path, "cpu", "M=8")
    one.add(c, c, 1.0)
    two.add(c, c, math.inf)
    assert json.loads(path.read_text())["entries"] == {"M=1": {tune.pair_key(c, c): 1.0},
                                                       "M=8": {tune.pair_key(c, c): None}}
    assert tune.Measurements(path, "cpu", "M=8").seconds(c, c) == math.inf
    one.forget()
    assert set(json.loads(path.read_text())["entries"]) == {"M=8"}
    two.forget()
    assert not path.exists()


def test_precompile_counts_what_compiled(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    class InProcess:
        def __init__(self, max_workers, mp_context):
            self.workers = max_workers

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, jobs):
            jobs = list(jobs)
            assert len(jobs) == self.workers == 3
            return map(fn, jobs)

    monkeypatch.setattr(tune, "ProcessPoolExecutor", InProcess)
    monkeypatch.setattr(tune, "compile_workers", lambda requested, shape: 3)
    monkeypatch.setattr(tune, "_compile_worker", lambda job: len(job[2]) - 1)  # one of each worker's fails
    pairs = [({"BLOCK_N": n}, {}) for n in range(10)]
    scheme = tune.bench.registry_schemes()["awq-w4a16"]
    assert tune.precompile("qwen3", scheme, pairs, False, 12) == 10 - 3
    assert tune.precompile("qwen3", scheme, pairs, True, 12) is None  # the interpreter compiles nothing ahead
    assert tune.precompile("qwen3", scheme, pairs[:3], False, 12) is None


class _CompilerCrash(_SlowCandidates):
    """A stand-in layer on which GEMM1 tiles 32 columns wide crash the compiler, which prints its
    IR to file descriptor 2 first, and on which a register cap of 80 fails ptxas, whose PTX
    Triton prints to file descriptor 1."""

    def error(self, configs, *args):
        if configs[0]["BLOCK_N"] == 32:
            os.write(2, b"// -----// IR Dump Before TritonGPUPipeline\n" + b"  %0 = tt.load ...\n" * 2000
                     + b'loc("moe_gemm.py":420:12): error: failed to legalize operation\n')
            raise RuntimeError("PassManager::run failed")
        if configs[0].get("maxnreg") == 80:
            os.write(1, b"\n=====\nInternal Triton PTX codegen error\n`ptxas` stderr:\nptxas fatal   : (C7602) "
                     b"Insufficient registers (80)\n" + b".visible .entry _fused_moe_kernel(\n" * 2000)
            raise RuntimeError("Internal Triton PTX codegen error\n`ptxas` stderr: ...")
        os.write(1, b"a candidate's own line on stdout\n")
        os.write(2, b"Using default MoE config for a shape\n")
        return 0.0


def test_a_candidate_that_crashes_the_compiler_is_one_line(tmp_path, monkeypatch, capfd):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    log: list[str] = []
    tune.tune_target(_CompilerCrash(tune), 1, 1e-2, log, limit=2, splits=(1,))
    skipped = [line for line in log if line.lstrip().startswith("skip") and "'BLOCK_N': 32" in line.split("}")[0]]
    assert skipped and all(line.endswith(": RuntimeError: PassManager::run failed: loc(\"moe_gemm.py\":420:12): "
                                         "error: failed to legalize operation") for line in skipped)
    ptxas = [line for line in log if "maxnreg': 80" in line.split("}")[0]]  # GEMM1's cap (GEMM2's compiles)
    assert ptxas and all(line.lstrip().startswith("skip") and line.endswith(
        ": RuntimeError: Internal Triton PTX codegen error: ptxas fatal   : (C7602) Insufficient registers (80)")
        for line in ptxas)
    out, err = capfd.readouterr()
    assert "IR Dump" not in err and "tt.load" not in err  # the dumps are held back
    assert ".entry" not in out and ".entry" not in err
    assert "Using default MoE config for a shape" in err  # what a candidate that runs prints still shows
    assert "a candidate's own line on stdout" in out


def test_register_variants_and_compile_workers(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    tile = {"BLOCK_M": 16, "BLOCK_N": 64}
    assert tune.register_variants(tile) == [{**tile, "maxnreg": cap} for cap in tune.REGISTER_CAPS]
    capped = {**tile, "maxnreg": 96}
    assert tune.register_variants(capped) == [tile] + [{**tile, "maxnreg": c} for c in tune.REGISTER_CAPS if c != 96]
    assert capped == {**tile, "maxnreg": 96}  # not modified
    # compile workers: as many as 90% of the free GPU memory holds, at least one, at most those asked for
    free = 80 << 30
    monkeypatch.setattr(tune.torch.cuda, "mem_get_info", lambda: (free, free))
    mixtral = tune.bench.SHAPES["mixtral"]  # a worker's 2 experts: 1.4 GB of float32 weights
    per_worker = tune.WORKER_BYTES_PER_WEIGHT_BYTE * 4 * 2 * 3 * 14336 * 4096 + tune.WORKER_CONTEXT_BYTES
    assert tune.compile_workers(12, mixtral) == int(0.9 * free) // per_worker == 5
    assert tune.compile_workers(12, tune.bench.SHAPES["qwen3"]) == 12
    free = 1 << 30
    assert tune.compile_workers(12, mixtral) == 1


# ---------------------------------------------------------------------------------------------
# the schemes, keys and tolerances are the registry's; every entry kept as it is tuned


class _Searched:
    """Stands in for the search: records (scheme keys, M, tolerance) and returns configs that name
    the call that made them; ``kill_at``: the call that raises, as a time limit's kill would."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.calls: list[tuple[str, int, float]] = []
        self.kill_at = kill_at

    def __call__(self, layer, m, tolerance, log, **search):
        self.calls.append((layer.weight, m, tolerance))
        if len(self.calls) == self.kill_at:
            raise KeyboardInterrupt
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "call": len(self.calls)}
        return config, config, 1.0, 2.0


@pytest.fixture
def tune_fake(monkeypatch):
    """tools/tune.py with the shipped specs, its layer and search replaced (nothing compiled or timed)."""
    from moe_registry.spec.loader import SPEC_PATH_ENV

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.delenv(SPEC_PATH_ENV, raising=False)
    import tune

    monkeypatch.setattr(tune, "Layer", lambda shape, scheme, device, dry: scheme)
    return tune


def _entries(path: Path) -> dict:
    table = json.loads(path.read_text())
    table.pop("meta")
    return table


def test_tune_schemes_and_tolerances_come_from_the_specs(tune_fake, tmp_path, monkeypatch, capsys):
    from moe_registry.spec.loader import SPEC_PATH_ENV

    tune = tune_fake
    search = _Searched()
    monkeypatch.setattr(tune, "tune_target", search)
    # gptq-w4a16 and gptq-v2-w4a16 share keys (one config file); a user spec makes the second stricter
    user = tmp_path / "specs" / "schemes"
    user.mkdir(parents=True)
    strict = (ROOT / "specs/schemes/gptq-v2-w4a16.yaml").read_text().replace(
        "tolerance: {float16: 1.0e-2", "tolerance: {float16: 1.0e-3")
    (user / "gptq-v2-w4a16.yaml").write_text(strict)
    monkeypatch.setenv(SPEC_PATH_ENV, str(user.parent))
    code = tune.main(["--dry-run", "--schemes", "gptq-w4a16", "gptq-v2-w4a16", "unquantized", "--m", "1",
                      "--out", str(tmp_path / "configs")])
    assert code == 0
    gptq = "uint4b8 scale:float16:group(128):static"
    # one search per key pair, to the strictest tolerance of the schemes that bind the keys
    assert search.calls == [(gptq, 1, 1e-3), ("unquantized", 1, 5e-3)]
    files = sorted(f.name for f in (tmp_path / "configs").glob("*.json"))
    assert files == ["dry_run__uint4b8_scale_float16_group_128_static__unquantized.json",
                     "dry_run__unquantized__unquantized.json"]
    # unknown names: one line, the known ones listed
    capsys.readouterr()
    assert tune.main(["--dry-run", "--schemes", "gptq4", "--out", str(tmp_path / "configs")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "did you mean 'gptq-w4a16'?" in err
    assert "known: " + ", ".join(tune.bench.registry_schemes()) in err


def test_tune_default_is_every_key_pair_the_kernel_runs(tune_fake, tmp_path, monkeypatch):
    tune = tune_fake
    search = _Searched()
    monkeypatch.setattr(tune, "tune_target", search)
    assert tune.main(["--dry-run", "--m", "1", "--out", str(tmp_path)]) == 0
    schemes = tune.bench.registry_schemes()
    default = tune.bench.default_schemes(schemes)
    # one token of int8 activations on int4/int8 weights runs the decode GEMV: no tiles to tune
    shape = next(iter(tune.bench.DRY_SHAPES.values()))
    gemv = {n for n in default if tune.runs_decode_gemv(shape, schemes[n], 1)}
    assert {schemes[n].activation.split()[0] for n in gemv} == {"int8"} and len(gemv) >= 2
    assert sorted(w for w, _, _ in search.calls) == sorted(schemes[n].weight for n in default if n not in gemv)
    tuned_keys = {s.keys for s in schemes.values()} - {schemes[n].keys for n in gemv}
    assert len(list(tmp_path.glob("*.json"))) == len(tuned_keys)


def test_tune_skips_the_cells_the_decode_gemv_runs(tune_fake, tmp_path, monkeypatch, capsys):
    """W4A8 at one token runs the decode GEMV, which reads no tile config: the tuner says so in one
    line and searches only the other cells; with the GEMV off it searches them too."""
    tune = tune_fake
    search = _Searched()
    monkeypatch.setattr(tune, "tune_target", search)
    args = ["--dry-run", "--schemes", "compressed-tensors-w4a8-int", "--m", "1", "8", "--out", str(tmp_path)]
    assert tune.main(args) == 0
    err = capsys.readouterr().err
    assert "compressed-tensors-w4a8-int M=1: the decode GEMV runs both GEMMs (no tile config is read there)" in err
    assert [m for _, m, _ in search.calls] == [8]
    from moe_registry_kernels.triton import launch as triton_launch

    monkeypatch.setattr(triton_launch, "DECODE_GEMV", False)
    assert tune.main([*args, "--redo"]) == 0
    assert [m for _, m, _ in search.calls] == [8, 1, 8]


def test_tune_cut_off_keeps_finished_entries_and_resumes(tune_fake, tmp_path, monkeypatch):
    tune = tune_fake
    args = ["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "8", "64", "--out", str(tmp_path)]
    monkeypatch.setattr(tune, "tune_target", _Searched(kill_at=3))
    with pytest.raises(KeyboardInterrupt):
        tune.main(args)
    (path,) = tmp_path.glob("*.json")
    assert not list(tmp_path.glob("*.tmp"))
    kept = _entries(path)
    assert all({m: c["call"] for m, c in by_tokens.items()} == {"1": 1, "8": 2} for by_tokens in kept.values())

    search = _Searched()
    monkeypatch.setattr(tune, "tune_target", search)
    assert tune.main([*args, "--resume"]) == 0
    assert [m for _, m, _ in search.calls] == [64]
    table = _entries(path)
    for shape, by_tokens in table.items():
        assert {m: by_tokens[m] for m in ("1", "8")} == kept[shape] and by_tokens["64"]["call"] == 1

    # --redo tunes them all again; --resume and --redo together are refused
    search = _Searched()
    monkeypatch.setattr(tune, "tune_target", search)
    assert tune.main([*args, "--redo"]) == 0
    assert [m for _, m, _ in search.calls] == [1, 8, 64]
    with pytest.raises(SystemExit):
        tune.main([*args, "--redo", "--resume"])


def test_a_budget_spent_midway_keeps_the_entrys_measurements_for_the_next_run(tune_fake, tmp_path, monkeypatch,
                                                                              capsys):
    tune = tune_fake
    args = ["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "8", "--out", str(tmp_path)]
    c = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
    calls: list[tuple[int, int]] = []

    def cut_at_8(layer, m, tolerance, log, *, taken, deadline, progress, **search):
        calls.append((m, len(taken)))
        if m == 8:  # one candidate measured, then the budget is gone
            taken.add(c, {**c, "BLOCK_N": 32}, 2.0)
            raise tune.SearchCutOff
        return c, c, 1.0, 1.0

    monkeypatch.setattr(tune, "tune_target", cut_at_8)
    assert tune.main(args) == 0
    (path,) = tmp_path.glob("*.json")
    partial = tune.partial_path(path)
    err = capsys.readouterr().err
    assert (f"spent in the middle of tiny awq-w4a16 M=8: its 1 measurements are kept in {partial}; "
            "run again to go on") in err
    assert all(set(by_tokens) == {"1"} for by_tokens in _entries(path).values())
    assert len(json.loads(partial.read_text())["entries"]) == 1

    def finish(layer, m, tolerance, log, *, taken, deadline, progress, **search):
        calls.append((m, len(taken)))
        assert taken.seconds(c, {**c, "BLOCK_N": 32}) == 2.0
        return c, c, 1.0, 1.0

    # each entry's candidates are compiled ahead before its search, less those measured already
    compiled: list[list] = []

    def precompile(shape_name, scheme, pairs, dry, workers):
        compiled.append(pairs)
        return len(pairs) - 1

    monkeypatch.setattr(tune, "tune_target", finish)
    monkeypatch.setattr(tune, "all_pairs", lambda shape, scheme, ms: [(c, c), (c, {**c, "BLOCK_N": 32})])
    monkeypatch.setattr(tune, "seed_pairs", lambda *args, **kwargs: [])  # (AWQ's: today's tiles on ZERO_SUMS)
    monkeypatch.setattr(tune, "precompile", precompile)
    assert tune.main(args) == 0
    assert compiled == [[(c, c)]]
    assert "tiny awq-w4a16 M=8: 0 of 1 candidates compiled ahead in " in capsys.readouterr().err
    assert calls == [(1, 0), (8, 0), (8, 1)]
    assert all(set(by_tokens) == {"1", "8"} for by_tokens in _entries(path).values())
    assert not partial.exists()


def _search_noting_its_options(seen: list[dict]):
    """A stand-in for tune_target that notes the options main passed it and finds one small tile."""
    def search(layer, m, tolerance, log, **kwargs):
        seen.append(kwargs)
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
        return config, config, 1.0, 1.0

    return search


def test_registers_only_reaches_the_search(tune_fake, tmp_path, monkeypatch):
    tune = tune_fake
    seen: list[dict] = []
    monkeypatch.setattr(tune, "tune_target", _search_noting_its_options(seen))
    args = ["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "--out", str(tmp_path)]
    assert tune.main(args) == 0 and tune.main([*args, "--redo", "--registers-only"]) == 0
    assert tune.main([*args, "--redo", "--seeds-only"]) == 0
    assert [(kwargs["registers_only"], kwargs["seeds_only"]) for kwargs in seen] == [
        (False, False), (True, False), (False, True)]
    # the seeds read for compiling ahead are the search's (no second read); registers-only reads none
    assert [kwargs["seeds"] is None for kwargs in seen] == [False, True, False]


def test_try_lays_the_given_keys_over_todays_configs(monkeypatch):
    """--try: each overlay's keys over today's two configs (null removes one; gemm1/gemm2 one GEMM each), fitted
    as the layer runs them, today's own pair and repeats dropped; what is not a JSON object of keys is one line."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import argparse

    import tune
    from moe_registry_kernels.triton.api import variant_from_keys

    gptq = variant_from_keys("uint4b8 scale:float16:group(128):static", "unquantized")
    tile = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4, "num_stages": 4,
            "SPLIT_K": 1, "SWAP_AB": False, "GROUP_DOTS": True}
    today = ({**tile, "maxnreg": 168}, {**tile, "SPLIT_K": 2})
    overlays = [tune._overlay(text) for text in (
        '{"ZERO_SUMS": true, "num_stages": 3, "maxnreg": 128}', '{"gemm2": {"SPLIT_K": 4}}', '{"maxnreg": null}',
        '{"gemm1": {"maxnreg": 168}}', '{"ZERO_SUMS": true, "num_stages": 3, "maxnreg": 128}')]
    pairs = tune.tried_pairs(today, overlays, gptq)
    assert [(c1.get("ZERO_SUMS"), c1["num_stages"], c1.get("maxnreg"), c2.get("ZERO_SUMS"), c2.get("maxnreg"),
             c2["SPLIT_K"]) for c1, c2 in pairs] == [(True, 3, 128, True, 128, 2), (None, 4, 168, None, None, 4),
                                                    (None, 4, None, None, None, 2)]
    for bad, why in (("{", "not JSON"), ("[1]", "wanted a JSON object"), ("{}", "wanted a JSON object"),
                     ('{"gemm1": 3}', "gemm1 and gemm2 as JSON objects")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            tune._overlay(bad)


def test_try_reaches_the_search_as_its_only_seeds(tune_fake, tmp_path, monkeypatch, capsys):
    tune = tune_fake
    seen: list[dict] = []
    monkeypatch.setattr(tune, "tune_target", _search_noting_its_options(seen))
    monkeypatch.setattr(tune, "precompile", lambda name, scheme, pairs, dry, workers: seen.append({"pairs": pairs}))
    args = ["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "--out", str(tmp_path)]
    assert tune.main([*args, "--try", '{"num_stages": 5}', '{"gemm2": {"BLOCK_N": 32}}']) == 0
    compiled, searched = seen
    assert searched["seeds_only"] and searched["seeds"] == compiled["pairs"] and len(compiled["pairs"]) == 2
    assert compiled["pairs"][0][0]["num_stages"] == 5 and compiled["pairs"][1][1]["BLOCK_N"] == 32
    assert tune.main([*args, "--try", '{"num_stages": 5}', "--seeds-only"]) == 2
    assert "--seeds-only and --try exclude each other" in capsys.readouterr().err


def test_verbose_prints_each_entrys_log(tune_fake, tmp_path, monkeypatch, capsys):
    tune = tune_fake

    def search(layer, m, tolerance, log, **kwargs):
        log.append(f"  1.0 us candidate at M = {m}")
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
        return config, config, 1.0, 2.0

    monkeypatch.setattr(tune, "tune_target", search)
    args = ["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "8", "--out", str(tmp_path)]
    assert tune.main(args) == 0
    assert "candidate at M" not in capsys.readouterr().out
    assert tune.main([*args, "--redo", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert out.index("M=1: before") < out.index("  1.0 us candidate at M = 1") < out.index("M=8: before")
    assert "  1.0 us candidate at M = 8" in out


def test_each_entry_says_why_its_candidates_were_refused(tune_fake, tmp_path, monkeypatch, capsys):
    """A register cap ptxas rejects is not an accuracy refusal: the entry's line counts each kind apart."""
    tune = tune_fake

    def search(layer, m, tolerance, log, **kwargs):
        log += ["  reject {'a': 1} {'b': 1}: relative error 3.00e-02 > 1e-02",
                "  skip {'a': 2} {'b': 2}: RuntimeError: ptxas fatal   : (C7602) Insufficient registers (80)",
                "  skip {'a': 3} {'b': 3}: PTXASError: PTXAS error",
                f"  skip {{'a': 4}} {{'b': 4}}: {tune.CUT_OFF_REFUSAL}", "  1.0 us {'a': 5} {'b': 5}"]
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1}
        return config, config, 1.0, 2.0

    monkeypatch.setattr(tune, "tune_target", search)
    assert tune.main(["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("M=1: before 2000000.0 us, tuned 1000000.0 us (2.00x), 4 refused, 1 over tolerance, 2 not built or run, "
            "1 in an earlier run\n") in out
    assert out.rstrip().splitlines()[-2].endswith(f"{'2.00x':>10}{4:>9}")  # the summary's total


def test_tables_hold_the_configs_as_the_layer_runs_them(tune_fake, tmp_path, monkeypatch):
    """A winner is written as the layer fits it: a W4A8 K tile of 512 columns without per-group dots
    runs as one group of 128 (its int8 dot takes one group's scale), and the table says so; GEMM2
    takes GEMM1's BLOCK_M."""
    tune = tune_fake
    asked = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 512, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
             "num_stages": 3}

    def search(layer, m, tolerance, log, **kwargs):
        return asked, {**asked, "BLOCK_M": 32, "SPLIT_K": 2}, 1.0, 2.0

    monkeypatch.setattr(tune, "tune_target", search)
    args = ["--dry-run", "--schemes", "compressed-tensors-w4a8-int", "--m", "8", "--out", str(tmp_path)]
    assert tune.main(args) == 0
    (path,) = tmp_path.glob("*.json")
    entries = _entries(path)  # the tiny shape: hidden 128, intermediate 128 (M = 1 runs the decode GEMV)
    gemm1, gemm2 = entries["E8_top2_N256_K128"]["8"], entries["E8_top2_N128_K128"]["8"]
    assert (gemm1["BLOCK_K"], gemm1["BLOCK_M"], gemm2["BLOCK_K"], gemm2["BLOCK_M"]) == (128, 16, 128, 16)
    assert (gemm1["SPLIT_K"], gemm2["SPLIT_K"], gemm1["SWAP_AB"]) == (1, 2, False)


def test_decode_candidates_include_one_dot_per_group_where_the_scheme_takes_it(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    plain = tune.tile_candidates(16, narrow=True, swap=True)
    grouped = tune.tile_candidates(16, narrow=True, swap=True, group_dots=128)
    extra = grouped[len(plain):]
    assert grouped[:len(plain)] == plain and extra
    assert extra == [{**c, "GROUP_DOTS": True} for c in plain if not c["SWAP_AB"] and c["BLOCK_K"] > 128]
    assert tune.tile_candidates(64, narrow=True, group_dots=128) == tune.tile_candidates(64, narrow=True)  # prefill
    schemes = tune.bench.registry_schemes()
    gptq = tune.all_pairs(tune.bench.SHAPES["qwen3"], schemes["gptq-w4a16"], [8])
    assert any(c1.get("GROUP_DOTS") for c1, _ in gptq) and any(c2.get("GROUP_DOTS") for _, c2 in gptq)
    awq = tune.all_pairs(tune.bench.SHAPES["qwen3"], schemes["awq-w4a16"], [8])  # zero points: with ZERO_SUMS only
    grouped = [c for pair in awq for c in pair if c.get("GROUP_DOTS")]
    assert grouped and all(c.get("ZERO_SUMS") for c in grouped)


def test_w4a8_candidates_are_the_distinct_tiles_its_layer_runs(monkeypatch):
    """W4A8 decode tiles spanning several groups are tried with GROUP_DOTS (its 16-bit-dot tiles take
    them); without, the layer fits them to one group a K tile, and a tile it already runs as another
    candidate is not timed twice."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton.tile_config import _fit_config
    from moe_registry_kernels.triton.variant import variant_from_keys

    w4a8 = tune.bench.registry_schemes()["compressed-tensors-w4a8-int"]
    kscheme = variant_from_keys(*w4a8.keys)
    pairs = tune.all_pairs(tune.bench.SHAPES["qwen3"], w4a8, [8])
    tiles = {json.dumps(c1, sort_keys=True) for c1, _ in pairs}
    assert any(json.loads(t).get("GROUP_DOTS") for t in tiles)
    fitted = [json.dumps(_fit_config(json.loads(t), kscheme, can_split=True), sort_keys=True) for t in tiles]
    assert len(fitted) == len(set(fitted))
    raw = tune.tile_candidates(16, narrow=True, group_dots=128)
    assert len(tune.distinct_tiles(raw, kscheme)) < len(raw)  # the 256/512-column tiles without GROUP_DOTS went


def test_decode_candidates_include_wide_tiles_under_a_register_cap(monkeypatch):
    """Packed decode weights: 128-column tiles of 4 warps are tried capped (uncapped they hold 3
    programs an SM), and K 256 tiles of 3-4 stages under 128 registers (4 programs an SM); wider
    weights and prefill get no capped candidates."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    capped = [c for c in tune.tile_candidates(16, narrow=True) if "maxnreg" in c]
    wide = [c for c in capped if c["maxnreg"] == tune.WIDE_TILE_CAP]
    assert wide and all(c["BLOCK_N"] == 128 and c["num_warps"] == 4 for c in wide)
    assert {c["BLOCK_K"] for c in wide} == {128, 256}
    four = [(c["BLOCK_N"], c["BLOCK_K"], c["num_stages"]) for c in capped if c["maxnreg"] == 128]
    assert four == [(128, 256, 3), (64, 256, 4)]
    assert {c["maxnreg"] for c in capped} == {tune.WIDE_TILE_CAP, 128}
    # and on the factored dot, where zero-point or fixed-zero 4-bit schemes take it
    sums = [c for c in tune.tile_candidates(16, narrow=True, zero_sums=True) if c.get("ZERO_SUMS")]
    assert {(c["BLOCK_N"], c["BLOCK_K"], c["num_stages"]) for c in sums if c.get("maxnreg") == 128} == set(four)
    assert not any("maxnreg" in c for c in tune.tile_candidates(16, narrow=False))
    assert not any("maxnreg" in c for c in tune.tile_candidates(64, narrow=True))


def test_zero_point_schemes_try_the_factored_dot(monkeypatch, tmp_path):
    """Zero-point schemes (AWQ, W8A16 asym) and GPTQ int4 (raw codes of a fixed zero) try their decode
    tiles with ZERO_SUMS too, as the layer fits them (K tiles in one group or, 4-bit, one dot per group;
    standard kernel), and each seed from a fixed-zero table (GPTQ int8's) also on the factored dot; GPTQ
    int8 (8-bit codes: no raw dot) and prefill tiles get none."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune
    from moe_registry_kernels.triton import tile_config
    from moe_registry_kernels.triton import variant as triton_variant

    schemes = tune.bench.registry_schemes()
    for name in ("awq-w4a16", "compressed-tensors-w8a16-asym", "gptq-w4a16"):
        pairs = tune.all_pairs(tune.bench.SHAPES["qwen3"], schemes[name], [8])
        with_sums = [c for pair in pairs for c in pair if c.get("ZERO_SUMS")]
        assert with_sums and all(not c["SWAP_AB"] and (128 % c["BLOCK_K"] == 0 or c.get("GROUP_DOTS"))
                                 for c in with_sums), name
    assert not any(c.get("ZERO_SUMS") for pair in tune.all_pairs(tune.bench.SHAPES["qwen3"], schemes["gptq-w8a16"], [8])
                   for c in pair)
    assert not any(c.get("ZERO_SUMS") for c in tune.tile_candidates(64, narrow=False, zero_sums=True))  # prefill

    monkeypatch.setattr(_config_module(), "CONFIG_DIR", tmp_path)
    tile_config._load_config_file.cache_clear()
    asym = schemes["compressed-tensors-w8a16-asym"]
    shape = tune.bench.SHAPES["qwen3"]
    gemms = (tile_config.shape_key(shape.experts, shape.top_k, 2 * shape.intermediate, shape.hidden),
             tile_config.shape_key(shape.experts, shape.top_k, shape.hidden, shape.intermediate))
    seed = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4,
            "num_stages": 3}
    gptq8 = ("uint8b128 scale:float16:group(128):static", "unquantized")
    (tmp_path / tile_config.config_file(*gptq8, "cpu").name).write_text(
        json.dumps({gemms[0]: {"8": seed}, gemms[1]: {"8": seed}}))
    try:
        kscheme = triton_variant.variant_from_keys(*asym.keys)
        today = tune.todays_configs(shape, asym.keys, 8, "cpu", 132)
        pairs = tune.seed_pairs(shape, asym.keys, 8, "cpu", kscheme, today)
    finally:
        tile_config._load_config_file.cache_clear()
    whole = [(c1.get("ZERO_SUMS"), c2.get("ZERO_SUMS")) for c1, c2 in pairs
             if c1["BLOCK_N"] == c2["BLOCK_N"] == 128 and c1["BLOCK_K"] == c2["BLOCK_K"] == 128]
    assert (None, None) in whole and (True, True) in whole


def test_a_device_nobody_tuned_takes_its_stand_ins_tables(caplog):
    """An H200 (the H100's SMs) runs on the shipped H100 tables where it has none of its own, and says so; a
    device without a stand-in gets the defaults."""
    import logging

    from moe_registry_kernels.triton import tile_config

    h100 = tile_config.TUNED_STAND_INS["NVIDIA H200"]
    keys = ("int8 scale:float32:channel:static", "int8 scale:float32:token:dynamic")
    path = tile_config.config_file(*keys, h100)
    assert not tile_config.config_file(*keys, "NVIDIA H200").exists()
    table = json.loads(path.read_text())
    shape = next(s for s in table if s != "meta")
    e, top, n, k = (int(p.lstrip("EtopNK")) for p in shape.split("_"))
    tokens = next(iter(table[shape]))
    tile_config._SAID_STAND_IN.clear()
    with caplog.at_level(logging.INFO, logger="moe_registry"):
        got = tile_config.get_config(int(tokens), top, e, n, k, *keys, "NVIDIA H200")
    assert {key: got[key] for key in table[shape][tokens]} == table[shape][tokens]
    assert f"NVIDIA H200: {path.name}, tuned on {h100}" in caplog.text
    untuned = tile_config.get_config(int(tokens), top, e, n, k, AWQ, "unquantized", "Some GPU", warn=False)
    assert untuned == tile_config.default_config(int(tokens), top, e, n, k, AWQ)


def test_a_devices_own_entries_win_over_its_stand_ins(caplog):
    """Where an H200 has a table of its own (AWQ int4, tuned on an H200 at a few decode token counts), its
    entries run; the (shape, token count) entries it lacks are its stand-in's, and the log says so."""
    import logging

    from moe_registry_kernels.triton import tile_config

    own_path = tile_config.config_file(AWQ, "unquantized", "NVIDIA H200")
    h100_path = tile_config.config_file(AWQ, "unquantized", tile_config.TUNED_STAND_INS["NVIDIA H200"])
    own, h100 = json.loads(own_path.read_text()), json.loads(h100_path.read_text())
    shape = next(s for s in own if s != "meta" and set(h100[s]) - set(own[s]))
    e, top, n, k = (int(p.lstrip("EtopNK")) for p in shape.split("_"))
    tuned_here = next(t for t in own[shape] if own[shape][t] != h100[shape][t])
    lacking = next(t for t in h100[shape] if t not in own[shape])
    tile_config._SAID_STAND_IN.clear()
    with caplog.at_level(logging.INFO, logger="moe_registry"):
        for tokens, entry in ((tuned_here, own[shape][tuned_here]), (lacking, h100[shape][lacking])):
            got = tile_config.get_config(int(tokens), top, e, n, k, AWQ, "unquantized", "NVIDIA H200")
            assert {key: got[key] for key in entry} == entry, tokens
    assert f"where its own table has no entry, {h100_path.name}" in caplog.text


def test_share_tunes_every_nth_entry_and_bad_shares_are_one_line(tune_fake, tmp_path, monkeypatch, capsys):
    tune = tune_fake
    search = _Searched()
    monkeypatch.setattr(tune, "tune_target", search)
    args = ["--dry-run", "--schemes", "awq-w4a16", "--m", "1", "8", "64", "--out", str(tmp_path)]
    assert tune.main([*args, "--share", "1/2"]) == 0
    assert [m for _, m, _ in search.calls] == [8]
    assert "share 1/2" in capsys.readouterr().out
    for bad, why in (("2/2", "got '2/2'; wanted I/N with 0 <= I < N, e.g. 0/2"), ("half", "got 'half'; wanted I/N")):
        with pytest.raises(SystemExit):
            tune.main([*args, "--share", bad])
        assert f"argument --share: {why}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main([*args, "--gpus", "0"])
    assert "argument --gpus: got '0'; wanted a positive integer" in capsys.readouterr().err


def test_an_entry_is_written_into_the_table_as_it_is_on_disk(tmp_path, monkeypatch):
    """Tuners on several GPUs share a table: each entry goes into what is on disk at that moment, not into the
    table as this tuner read it at its start."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    path = tmp_path / "table.json"
    meta = {"device": "GPU X"}
    tune.write_entry(path, meta, {"E8_N1_K2": {"8": {"BLOCK_M": 16}}, "E8_N2_K1": {"8": {"BLOCK_M": 16}}})
    tune.write_entry(path, meta, {"E8_N1_K2": {"1": {"BLOCK_M": 32}}, "E8_N2_K1": {"1": {"BLOCK_M": 32}}})
    table = json.loads(path.read_text())
    assert table["meta"] == meta
    assert {k: sorted(v) for k, v in table.items() if k != "meta"} == {"E8_N1_K2": ["1", "8"], "E8_N2_K1": ["1", "8"]}
    assert not list(tmp_path.glob("*.tmp"))


def test_the_table_lock_holds_off_another_process(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import tune

    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
             "except BlockingIOError:\n    print('held')")

    def other() -> str:
        return subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True,
                              check=True).stdout.strip()

    with tune.locked(tmp_path):
        assert other() == "held"
    assert other() == "free"


def test_gpus_runs_a_tuner_per_share_into_the_same_table(tmp_path):
    """``--gpus 2`` on the dry-run shape: two processes, one entry each, both entries in the one table (each
    process writes its entry into the table as the other left it)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tune.py"), "--dry-run", "--schemes", "awq-w4a16",
                           "--m", "1", "8", "--gpus", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "share 0/2" in proc.stdout and "share 1/2" in proc.stdout
    (path,) = tmp_path.glob("*.json")
    table = _entries(path)
    assert len(table) == 2 and all(sorted(by_tokens) == ["1", "8"] for by_tokens in table.values()), table


def test_gpus_beyond_the_machines_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    import tune

    assert tune.main(["--schemes", "awq-w4a16", "--gpus", "2", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "tune.py: --gpus 2, but this machine shows 1 CUDA GPU\n"


def test_the_h100_takes_the_h200s_entries_where_its_own_tables_have_none(caplog):
    """Stand-ins go both ways between GPUs of the same SMs: the H100's per-channel FP8 table holds Mixtral's
    shape at one token only, the H200's (tuned on an H200) from 8 tokens up; an H100 runs those entries, its own
    one-token entry still wins, and the log says which table fills in."""
    import logging

    from moe_registry_kernels.triton import tile_config

    keys = ("fp8e4m3 scale:float32:channel:static", "fp8e4m3 scale:float32:token:dynamic")
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    own = json.loads(tile_config.config_file(*keys, h100).read_text())
    h200_path = tile_config.config_file(*keys, h200)
    other = json.loads(h200_path.read_text())
    shape = "E8_top2_N28672_K4096"  # Mixtral's GEMM1
    e, top, n, k = (int(p.lstrip("EtopNK")) for p in shape.split("_"))
    assert sorted(own[shape]) == ["1"] and "512" in other[shape]
    tile_config._SAID_STAND_IN.clear()
    with caplog.at_level(logging.INFO, logger="moe_registry"):
        got = tile_config.get_config(512, top, e, n, k, *keys, h100)
    assert {key: got[key] for key in other[shape]["512"]} == other[shape]["512"]
    assert f"MoE tiles for {h100}: where its own table has no entry, {h200_path.name}, tuned on {h200}" in caplog.text
    one = tile_config.get_config(1, top, e, n, k, *keys, h100)
    assert {key: one[key] for key in own[shape]["1"]} == own[shape]["1"]
