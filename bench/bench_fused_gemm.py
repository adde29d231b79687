"""The fused AG+GEMM kernel alone on one GPU, against cuBLAS, with every shard already in
place (flags set), so only the GEMM and its tile order are measured:

    python bench/bench_fused_gemm.py [--world 2] [--shapes MxKxN,...]

For each shape: cuBLAS (torch.mm) and the fused kernel's configurations under several
rasters and swizzle sizes, median of 20 CUDA-event timings after warm-up, and the relative difference of the
outputs. Prints a table; --out writes JSON.
"""
import argparse
import json
import shlex
import statistics
import sys

import torch

import flux  # noqa: F401  (loads flux._C)


def time_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # queue the call behind a spin: no launch gap in the timing
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--shapes", default="8192x8192x14336,8192x8192x5120,4096x8192x14336,16384x8192x4096,"
                                       "2048x8192x8192,512x8192x14336")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    flags = torch.ones(args.world, dtype=torch.int32, device=dev)
    # (name, raster, swizzle, configuration): 1 = along N, 0 = CUTLASS's heuristic, 2 = along M.
    variants = [("c0N8", 1, 8, 0), ("c0N1", 1, 1, 0), ("c1N8", 1, 8, 1), ("c1N1", 1, 1, 1),
                ("c2N8", 1, 8, 2), ("c2N1", 1, 1, 2), ("c0heur1", 0, 1, 0)]
    rows_out = []
    print(f"{'shape':>18} {'cuBLAS':>8} " + " ".join(f"{v[0]:>8}" for v in variants))
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 0.1
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.1
        ref = torch.mm(a, w.t())
        t_ref = time_ms(lambda: torch.mm(a, w.t()))
        rec = {"shape": shape, "cublas_ms": t_ref, "variants": {}}
        cells = []
        for name, raster, swz, cfg in variants:
            out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            call = lambda: torch.ops.flux.ag_gemm_fused_(out, a, w, None, flags, 1 % args.world, args.world,
                                                         m // args.world, 10000, 0, raster, swz, cfg)
            call()
            torch.cuda.synchronize()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t = time_ms(call)
            rec["variants"][name] = {"ms": t, "rel_err": err, "vs_cublas": t / t_ref}
            cells.append(f"{t:8.3f}" + ("!" if err > 1e-2 else ""))
        print(f"{shape:>18} {t_ref:8.3f} " + " ".join(cells), flush=True)
        rows_out.append(rec)
    if args.out:
        json.dump({"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows_out},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
