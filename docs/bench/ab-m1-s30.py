"""Session 30: one-token cells timed in alternation (five rounds, medians): W4A8 GEMM1 tiles with
per-group dots against today's, beside GPTQ int4; FP8 block-128 beside GPTQ int8. Run in a snapshot
on the GPU: python3 ab-m1-s30.py (from the repository root)."""
import statistics
import sys

sys.path.insert(0, "tools")
import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402

schemes = bench.registry_schemes()
dev = torch.device("cuda")
name = torch.cuda.get_device_name()
GD = {"BLOCK_M": 16, "GROUP_M": 1, "SPLIT_K": 1, "SWAP_AB": False, "num_warps": 4, "GROUP_DOTS": True}
cells = [
    ("compressed-tensors-w4a8-int", "qwen3", {
        "today": None,
        "gd_k256_n32_s3": {**GD, "BLOCK_K": 256, "BLOCK_N": 32, "num_stages": 3},
        "gd_k256_n64_s3": {**GD, "BLOCK_K": 256, "BLOCK_N": 64, "num_stages": 3},
        "gd_k512_n64_s3": {**GD, "BLOCK_K": 512, "BLOCK_N": 64, "num_stages": 3},
        "gd_k256_n64_s4": {**GD, "BLOCK_K": 256, "BLOCK_N": 64, "num_stages": 4}}),
    ("gptq-w4a16", "qwen3", {"today": None}),
    ("fp8-block128", "qwen3", {"today": None}),
    ("gptq-w8a16", "qwen3", {"today": None}),
    ("fp8-block128", "dsv2lite", {"today": None}),
    ("gptq-w8a16", "dsv2lite", {"today": None}),
]
runs = []
for sch, shape, variants in cells:
    layer = tune.Layer(bench.SHAPES[shape], schemes[sch], dev, False)
    x, tw, ti = layer.inputs(1)
    ref = layer.reference(x, tw, ti)
    _, d2 = tune.todays_configs(layer.shape, schemes[sch].keys, 1, name, 132)
    for k, c1 in variants.items():
        configs = (None, None) if c1 is None else (c1, d2)
        if c1 is not None:
            print(sch, shape, k, "rel err", f"{layer.error(configs, x, tw, ti, ref):.3e}")
        runs.append((f"{sch} {shape} {k}", layer, configs, (x, tw, ti)))
times = tune.alternated([lambda r=r: r[1].time(r[2], 1, *r[3]) * 1e6 for r in runs], 5)
for (label, *_), ts in zip(runs, times, strict=True):
    print(f"{label:52s} M=1 median {statistics.median(ts):6.1f} us  ({' '.join(f'{t:.1f}' for t in ts)})")
