"""Session 30: W4A8 GEMM1 tiles against GPTQ int4's, same machine, alternated (run in a snapshot)."""
import functools
import statistics
import sys

sys.path.insert(0, "tools")
import bench  # noqa: E402
import torch  # noqa: E402
import tune  # noqa: E402

schemes = bench.registry_schemes()
dev = torch.device("cuda")
name = torch.cuda.get_device_name()
G1 = {"BLOCK_K": 256, "BLOCK_M": 16, "BLOCK_N": 64, "GROUP_DOTS": True, "GROUP_M": 1, "SPLIT_K": 1,
      "SWAP_AB": False, "maxnreg": 128, "num_stages": 3, "num_warps": 4}
W1 = {"BLOCK_K": 128, "BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 1, "SPLIT_K": 1, "SWAP_AB": False,
      "maxnreg": 128, "num_stages": 5, "num_warps": 4}
for sch, m, variants in [
    ("compressed-tensors-w4a8-int", 8, {"today": None, "gptq_g1": G1, "gptq_g1_s4": {**G1, "num_stages": 4},
                                        "gptq_g1_nocap": {k: v for k, v in G1.items() if k != "maxnreg"}}),
    ("gptq-w4a16", 8, {"today": None, "w4a8_g1": W1}),
]:
    layer = tune.Layer(bench.SHAPES["qwen3"], schemes[sch], dev, False)
    x, tw, ti = layer.inputs(m)
    ref = layer.reference(x, tw, ti)
    _, d2 = tune.todays_configs(layer.shape, schemes[sch].keys, m, name, 132)
    for k, c1 in variants.items():
        if c1 is not None:
            print(sch, k, "rel err", layer.error((c1, d2), x, tw, ti, ref))
    pairs = [(None, None) if c1 is None else (c1, d2) for c1 in variants.values()]
    times = tune.alternated([functools.partial(layer.time, p, m, x, tw, ti) for p in pairs], 5)
    for k, seconds in zip(variants, times, strict=True):
        ts = [t * 1e6 for t in seconds]
        print(f"{sch:30s} M={m} {k:14s} median {statistics.median(ts):7.1f} us  ({' '.join(f'{t:.1f}' for t in ts)})")
    del layer
    torch.cuda.empty_cache()
