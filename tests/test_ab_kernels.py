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


def test_per_byte_rows_print_their_bytes_per_microsecond_over_their_yardsticks(monkeypatch, capsys):
    """print_per_byte: medians of steps taken in turn, and each row's bytes per µs over its yardstick's."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels

    order: list[str] = []

    def step(label: str, times: list[float]):
        it = iter(times)
        return lambda: order.append(label) or next(it)

    rows = [ab_kernels.Timed("base", step("base", [10.0, 12.0, 11.0]), 1000),
            ab_kernels.Timed("half the bytes", step("half", [4.0, 6.0, 5.0]), 500, "base", 1e-3)]
    ab_kernels.print_per_byte(rows, 3)
    assert order == ["base", "half"] * 3
    base, half = capsys.readouterr().out.splitlines()
    assert "11.0 us" in base and "per byte" not in base and "(10.0 12.0 11.0)" in base
    # (500 / 5.0) / (1000 / 11.0) = 1.1
    assert "5.0 us" in half and "per byte 1.100" in half and "err 1.00e-03" in half


def test_a_two_tensor_layer_holds_no_scale_and_zero_words(monkeypatch):
    """two_tensor_layer: the AWQ experts it builds read float16 scales and 8-bit zero points as two
    tensors; the word packing is back in place after it."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels
    import bench
    import torch
    from moe_registry_kernels import triton_moe

    packing = triton_moe._scale_zero_words
    tiny = bench.Shape("tiny", 4, 2, 128, 128)
    layer = ab_kernels.two_tensor_layer(tiny, bench.registry_schemes()["awq-w4a16"], torch.device("cpu"), (1,))
    tensors = layer.kernels[0]._tensors
    assert tensors[1].dtype == torch.float16 and tensors[2] is not tensors[1]
    assert triton_moe._scale_zero_words is packing


def test_a_timed_variant_is_checked_and_timed_under_its_own_kernel(monkeypatch):
    """timed_variant: the row's error against the reference under its kernel, its weights' bytes, its
    yardstick, and a step that times it under that kernel (today's put back after the test)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels
    from moe_registry_kernels import triton_moe

    monkeypatch.setattr(triton_moe, "_fused_moe_kernel", triton_moe._fused_moe_kernel)
    seen: list = []

    class Checked(_Layer):
        weight_bytes = 1234

        def error(self, configs, *args) -> float:
            seen.append(("error", triton_moe._fused_moe_kernel, args[-1]))
            return 0.25

    row = ab_kernels.timed_variant("a", Checked([2e-6], seen), (), 8, "other", "base", "ref")
    assert (row.label, row.weight_bytes, row.yardstick, row.error) == ("a", 1234, "base", 0.25)
    assert seen == [("error", "other", "ref")]
    assert row.step() == pytest.approx(2.0) and seen[-1] == "other"
    assert ab_kernels.timed_variant("b", Checked([1e-6], seen), (), 8, "other").error == 0.0


def test_a_timed_setting_is_checked_and_timed_under_its_setting(monkeypatch):
    """timed_setting: the setting put in place before the row's error is found and before each timing
    (the layer's graph is captured under it), whatever another row set in between; no reference, no
    error."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels

    state = {"flag": None}
    seen: list = []

    class Flagged:
        weight_bytes = 77

        def __init__(self, times: list[float]) -> None:
            self.times = iter(times)

        def time(self, configs, m, *inputs) -> float:
            seen.append(("time", state["flag"], m))
            return next(self.times)

        def error(self, configs, *args) -> float:
            seen.append(("error", state["flag"], args[-1]))
            return 0.5

    def setting(value):
        return lambda: state.update(flag=value)

    on = ab_kernels.timed_setting("on", Flagged([3e-6]), (), 4, setting("on"), "base", "ref")
    off = ab_kernels.timed_setting("off", Flagged([5e-6]), (), 4, setting("off"))
    assert (on.label, on.weight_bytes, on.yardstick, on.error, off.error) == ("on", 77, "base", 0.5, 0.0)
    assert seen == [("error", "on", "ref")]
    assert on.step() == pytest.approx(3.0) and seen[-1] == ("time", "on", 4)
    assert off.step() == pytest.approx(5.0) and seen[-1] == ("time", "off", 4)


def test_decode_cells_are_timed_against_the_yardstick_of_their_weight_width(monkeypatch):
    """print_cells_per_byte: each cell's schemes as rows under today's kernel, checked against their
    reference, each compared with GPTQ int4 (4-bit weights) or GPTQ int8 (8-bit) of the same cell,
    which is a row of its own once a cell; then one per-byte table."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels
    import bench
    import torch

    class Built:
        def __init__(self, shape, scheme, device, dry) -> None:
            self.shape, self.scheme, self.weight_bytes = shape, scheme, 1

        def inputs(self, m):
            return (m,)

        def reference(self, *inputs):
            return ("ref", self.scheme.name)

        def error(self, configs, *args) -> float:
            assert args[-1] == ("ref", self.scheme.name)
            return 0.0

    schemes = bench.registry_schemes()
    monkeypatch.setattr(ab_kernels, "this_gpu", lambda: ab_kernels.Gpu(schemes, torch.device("cpu"), "cpu", 1))
    monkeypatch.setattr(ab_kernels.tune, "Layer", Built)
    printed: list = []
    monkeypatch.setattr(ab_kernels, "print_per_byte", lambda rows, rounds: printed.append((rows, rounds)))
    ab_kernels.print_cells_per_byte({("qwen3", 8): ["modelopt-nvfp4", "modelopt-fp8"],
                                     ("dsv2lite", 1): ["mxfp4"]}, 5)
    [(rows, rounds)] = printed
    assert rounds == 5
    assert [(r.label, r.yardstick) for r in rows] == [
        ("modelopt-nvfp4 qwen3 M=8", "gptq-w4a16 qwen3 M=8"), ("modelopt-fp8 qwen3 M=8", "gptq-w8a16 qwen3 M=8"),
        ("gptq-w4a16 qwen3 M=8", None), ("gptq-w8a16 qwen3 M=8", None),
        ("mxfp4 dsv2lite M=1", "gptq-w4a16 dsv2lite M=1"), ("gptq-w4a16 dsv2lite M=1", None)]


def test_a_one_token_cell_holds_the_scheme_beside_its_yardstick(monkeypatch):
    """one_token_cell: the scheme's layer and the yardstick's on one shape, one token of the scheme's
    inputs with its reference, and the yardstick row's label."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import ab_kernels
    import bench
    import torch

    monkeypatch.setitem(bench.SHAPES, "tiny", bench.Shape("tiny", 4, 2, 128, 128))
    gpu = ab_kernels.Gpu(bench.registry_schemes(), torch.device("cpu"), "cpu", 1)
    cell = ab_kernels.one_token_cell(gpu, "tiny", "compressed-tensors-w4a8-int", "gptq-w4a16")
    assert cell.layer.scheme is gpu.schemes["compressed-tensors-w4a8-int"]
    assert cell.yardstick.scheme is gpu.schemes["gptq-w4a16"]
    assert cell.inputs[0].shape == (1, 128) and cell.base == "gptq-w4a16 tiny M=1"
    assert torch.equal(cell.ref, cell.layer.reference(*cell.inputs))
