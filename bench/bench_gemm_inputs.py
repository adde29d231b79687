"""cuBLAS time of one bf16 GEMM as a function of the input values (same shapes, same
algorithm; only the numbers differ), to tell what distribution timings should use:

    python bench/bench_gemm_inputs.py [--shapes MxKxN,...] [--out results.json]

Distributions: x ~ N(0,1) with w ~ N(0,1/K) (what bench_ops.py and the autotuner use),
x, w ~ 0.1 N(0,1), x, w ~ U(-1,1), and zeros. Median of 30 CUDA-event timings, each behind a
1 ms spin; the distributions are interleaved over 3 rounds so that clock drift is shared.
"""
import argparse
import json
import math
import statistics

import torch


def inputs(kind, m, k, n, gen):
    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.float32, generator=gen)
    if kind == "N(0,1) x N(0,1/K)":
        return r(m, k).bfloat16(), (r(n, k) / math.sqrt(k)).bfloat16()
    if kind == "0.1 N(0,1) both":
        return (0.1 * r(m, k)).bfloat16(), (0.1 * r(n, k)).bfloat16()
    if kind == "U(-1,1) both":
        return (2 * torch.rand(m, k, device="cuda", generator=gen) - 1).bfloat16(), \
            (2 * torch.rand(n, k, device="cuda", generator=gen) - 1).bfloat16()
    return torch.zeros(m, k, device="cuda", dtype=torch.bfloat16), torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8192x8192x14336,16384x8192x4096,8192x8192x5120")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kinds = ["N(0,1) x N(0,1/K)", "0.1 N(0,1) both", "U(-1,1) both", "zeros"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        data = {kd: inputs(kd, m, k, n, gen) for kd in kinds}
        samples = {kd: [] for kd in kinds}
        for _ in range(3):
            for kd in kinds:
                x, w = data[kd]
                for _ in range(3):
                    torch.mm(x, w.t())
                for _ in range(10):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda._sleep(2_000_000)
                    a.record()
                    torch.mm(x, w.t())
                    b.record()
                    b.synchronize()
                    samples[kd].append(a.elapsed_time(b))
        row = {"shape": shape, "ms": {kd: statistics.median(v) for kd, v in samples.items()}}
        rows.append(row)
        print(f"{shape:>18}  " + "  ".join(f"{kd}: {t:.3f}" for kd, t in row["ms"].items()), flush=True)
        del data
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python bench/bench_gemm_inputs.py --shapes " + args.shapes,
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
