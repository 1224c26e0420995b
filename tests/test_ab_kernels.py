"""tools/ab_kernels.py: what the kernel A/B scripts in docs/bench share, on the CPU (no timing of
kernels: stand-in layers whose times are given)."""

from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
AWQ = "uint4 scale:float16:group(128):static zp:group"


class _Layer:
    """Stands in for tune.Layer: each time() returns the next of ``times`` and records the kernel in use."""

    def __init__(self, times: list[float], seen: list) -> None:
        self.times, self.seen = iter(times), seen

    def time(self, configs, m, *inputs) -> float:
        from moe_registry_kernels import triton_moe

        self.seen.append(triton_moe._fused_moe_kernel)
        return next(self.times)


def test_rows_alternate_under_their_own_kernel_and_print_medians(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels
    from moe_registry_kernels import triton_moe

    today = triton_moe._fused_moe_kernel
    monkeypatch.setattr(triton_moe, "_fused_moe_kernel", today)  # put back after the rows set theirs
    seen: list = []
    rows = [ab_kernels.Variant("a", _Layer([3e-6, 1e-6, 2e-6], seen), (), (None, None), "other", 8, 0.5),
            ab_kernels.Variant("b", _Layer([5e-6, 6e-6, 4e-6], seen), (), (None, None), today, 8, 0.0)]
    ab_kernels.print_alternated(rows)
    assert seen == ["other", today] * 3  # in turn, each under its own kernel
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["a", "2.0"] and "err 5.00e-01" in lines[0] and "(3.0 1.0 2.0)" in lines[0]
    assert lines[1].split()[:2] == ["b", "5.0"]


def test_a_seed_on_the_factored_zero_point_dot_and_another_commits_kernel(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels
    from moe_registry_kernels import moe_gemm
    from moe_registry_kernels.triton_moe import scheme_from_keys

    seed = ({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
             "maxnreg": 128}, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4,
                               "num_stages": 3, "SPLIT_K": 2})
    gemm1, gemm2 = ab_kernels.zero_sums_tiles(seed, scheme_from_keys(AWQ, "unquantized"))
    assert gemm1["ZERO_SUMS"] is True and "maxnreg" not in gemm1 and gemm2["SPLIT_K"] == 2
    assert "ZERO_SUMS" not in gemm2  # a K tile over two groups without per-group dots cannot take it
    kernel = ab_kernels.kernel_from_file(moe_gemm.__file__)
    assert kernel is not moe_gemm._fused_moe_kernel and kernel.fn.__name__ == "_fused_moe_kernel"
