"""cuBLAS's choice against every algorithm of cuBLASLt's heuristic list, on one GPU:

    python bench/bench_lt_algos.py [--shapes MxKxN,...] [--out FILE]

out[M, N] = a[M, K] @ w[N, K]^T in bf16 (the GEMM of one row block of a decomposed strategy,
or a whole problem). For each shape: torch.mm (cuBLAS's choice) and each algorithm i that
cuBLASLt lists (torch.ops.flux.lt_gemm_, index i), median of 30 CUDA-event timings behind a
GPU spin, the relative difference from torch.mm's output, and the name of the kernel each
one launches (from torch.profiler: the tile shape, stages and cluster are in nvjet's names).
Default shapes: the row blocks that the decomposed strategies run on the public suite at two
GPUs, and the whole AG 8192x8192x14336.
"""
import argparse
import json
import shlex
import statistics
import sys

import torch

import flux  # noqa: F401  (loads flux._C)

DEFAULT = ("4096x8192x14336,2048x8192x14336,8192x8192x4096,4096x8192x5120,1024x8192x8192,"
           "4096x14336x8192,2048x14336x8192,4096x4096x8192,8192x8192x14336")


def time_ms(fn, iters=30, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernel_name(fn) -> str:
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and "Memset" not in e.name and "memset" not in e.name]
    return names[-1] if names else "?"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    records = []
    for shape in args.shapes.split(","):
        m, k, n = map(int, shape.split("x"))
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        ref = torch.mm(a, w.t())
        out = torch.empty_like(ref)
        rec = {"shape": shape, "cublas_ms": time_ms(lambda: torch.mm(a, w.t(), out=out)),
               "cublas_kernel": kernel_name(lambda: torch.mm(a, w.t(), out=out)), "algos": []}
        count = torch.ops.flux.lt_gemm_algos(out, a, w, None)
        for i in range(count):
            out.fill_(float("nan"))
            torch.ops.flux.lt_gemm_(out, a, w, None, i)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t = time_ms(lambda: torch.ops.flux.lt_gemm_(out, a, w, None, i))
            rec["algos"].append({"index": i, "ms": t, "rel_err": err,
                                 "kernel": kernel_name(lambda: torch.ops.flux.lt_gemm_(out, a, w, None, i))})
        best = min(rec["algos"], key=lambda r: r["ms"], default=None)
        print(f"{shape:>18}  cuBLAS {rec['cublas_ms']:.3f}  {rec['cublas_kernel'][:60]}", flush=True)
        for r in rec["algos"]:
            mark = " <" if r is best else ""
            print(f"{'':>18}  lt[{r['index']}]  {r['ms']:.3f} ({r['ms'] / rec['cublas_ms'] - 1:+.1%}) "
                  f"err {r['rel_err']:.1e}  {r['kernel'][:60]}{mark}", flush=True)
        records.append(rec)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python bench/bench_lt_algos.py " + shlex.join(sys.argv[1:]),
                       "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                       "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
