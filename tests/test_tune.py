"""tools/tune.py end to end through the interpreter: configs written where the kernel reads them,
picked up by get_config, and an interrupted run resumes instead of starting over; the search
keeps today's configs unless a candidate beats them side by side."""

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
AWQ = "uint4 scale:float16:group(128):static zp:group"


def _tune(out: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """tools/tune.py's main() in this process (exit code, stdout)."""
    import tune

    code = tune.main(["--dry-run", "--schemes", "awq-w4a16", "--out", str(out), *args])
    return code, capsys.readouterr().out


def test_tune_writes_configs_and_resumes(tmp_path, monkeypatch, capsys):
    """The whole tool on the tiny dry-run shape, each measurement one interpreted layer call (the
    tool's own timing repeats it 6 times: minutes under the interpreter, and nothing more tested)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench

    def one_call(fn, min_seconds, device, warmup_seconds=0.0):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    monkeypatch.setattr(bench, "_median_time", one_call)
    code, out = _tune(tmp_path, capsys, "--m", "1")
    assert code == 0
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == ["dry_run__uint4_scale_float16_group_128_static_zp_group__unquantized.json"]
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
    from moe_registry_kernels import triton_moe

    monkeypatch.setattr(triton_moe, "CONFIG_DIR", tmp_path)
    triton_moe._load_config_file.cache_clear()
    try:
        got = triton_moe.get_config(1, 2, 8, 128, 128, AWQ, "unquantized", "dry-run")
        assert {k: got[k] for k in table["E8_top2_N128_K128"]["1"]} == table["E8_top2_N128_K128"]["1"]
    finally:
        triton_moe._load_config_file.cache_clear()
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
    from moe_registry_kernels import triton_moe

    today = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 256, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 8,
             "num_stages": 2}
    monkeypatch.setattr(triton_moe, "CONFIG_DIR", tmp_path)
    triton_moe._load_config_file.cache_clear()
    table = {"E8_top2_N256_K128": {"1": today}, "E8_top2_N128_K128": {"1": today}}
    (tmp_path / triton_moe.config_file(AWQ, "unquantized", "cpu").name).write_text(json.dumps(table))
    try:
        c1, c2, t, base = tune.tune_target(_SlowCandidates(tune), 1, 1e-2, [], limit=2, splits=(1,))
    finally:
        triton_moe._load_config_file.cache_clear()
    assert (t, base) == (1.0, 1.0)
    assert {k: c1[k] for k in today} == today and {k: c2[k] for k in today} == today


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
    from moe_registry_kernels import triton_moe

    monkeypatch.setattr(triton_moe, "CONFIG_DIR", tmp_path)
    triton_moe._load_config_file.cache_clear()
    layer = _LuckyCandidates(tune, search_s=0.5, side_by_side_s=side_by_side_s)
    log: list[str] = []
    c1, c2, t, base = tune.tune_target(layer, 1, 1e-2, log, limit=2, splits=(1,))
    assert layer.today_timings == 1 + tune.CONFIRM_ROUNDS
    today = triton_moe.get_config(1, 2, 8, 256, 128, AWQ, "unquantized", "cpu")
    if keeps_today:
        assert (c1, t, base) == (today, 1.0, 1.0)
        assert "kept today's configs: 1000000.0 us against 990000.0 us" in log[-1]
    else:
        assert c1 != today and (t, base) == (0.5, 1.0)
