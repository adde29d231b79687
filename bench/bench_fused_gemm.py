"""A fused kernel alone on one GPU, against cuBLAS, with every peer's data already in place
(flags set), so only the GEMM, its epilogue and its tile order are measured:

    python bench/bench_fused_gemm.py [--op ag|rs] [--world 2] [--shapes MxKxN,...]

--op ag (default): the fused AG+GEMM kernel over all M rows against torch.mm.
--op rs: the fused GEMM+RS own-block kernel (world size 2) on one rank's block of a public RS
shape (each rank's GEMM at two ranks): M/2 of its rows, all K, its epilogue adding the peer's partial (a random tensor here),
against torch.mm alone and torch.mm followed by the addition (what `decomposed` does).

For each shape: cuBLAS and the fused kernel's configurations under several rasters and swizzle
sizes, median of 20 CUDA-event timings after warm-up, and the relative difference of the
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
    p.add_argument("--op", choices=("ag", "rs"), default="ag")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--shapes", default=None, help="MxKxN,... (default: the op's public suite without the "
                                                  "smallest shapes)")
    p.add_argument("--segments", type=int, default=8, help="--op rs: segments of the peer's partial")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.op == "rs":
        return main_rs(args)
    args.shapes = args.shapes or ("8192x8192x14336,8192x8192x5120,4096x8192x14336,16384x8192x4096,"
                                  "2048x8192x8192,512x8192x14336")
    dev = torch.device("cuda", 0)
    flags = torch.ones(args.world, dtype=torch.int32, device=dev)
    # (name, raster, swizzle, configuration): 1 = along N, 0 = CUTLASS's heuristic, 2 = along M.
    variants = [("c0N8", 1, 8, 0), ("c0N1", 1, 1, 0), ("c1N8", 1, 8, 1), ("c1N1", 1, 1, 1),
                ("c2N8", 1, 8, 2), ("c2N1", 1, 1, 2), ("c3N8", 1, 8, 3), ("c3N4", 1, 4, 3), ("c3N1", 1, 1, 3)]
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
    write(args, rows_out)


def main_rs(args):
    if args.world != 2:
        raise SystemExit("bench_fused_gemm --op rs: the fused RS kernel folds one peer's partial (--world 2)")
    shapes = args.shapes or "8192x14336x8192,8192x4096x8192,4096x14336x8192,2048x8192x8192,512x8192x8192"
    dev = torch.device("cuda", 0)
    flags = torch.ones(args.segments, dtype=torch.int32, device=dev)
    # (name, swizzle, configuration), raster along N as the strategy launches it.
    variants = [("c0s1", 1, 0), ("c0s8", 8, 0), ("c1s1", 1, 1), ("c1s8", 8, 1), ("c2s1", 1, 2), ("c2s8", 8, 2)]
    rows_out = []
    print(f"{'shape':>18} {'rows':>6} {'mm':>8} {'mm+add':>8} " + " ".join(f"{v[0]:>8}" for v in variants))
    for shape in shapes.split(","):
        m_all, k_all, n = map(int, shape.split("x"))
        m, k = m_all // 2, k_all  # one rank's own block at world size 2
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 0.1
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.1
        src = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        ref = torch.mm(a, w.t()).float() + src.float()
        buf = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        t_mm = time_ms(lambda: torch.mm(a, w.t(), out=buf))
        t_mm_add = time_ms(lambda: torch.add(torch.mm(a, w.t(), out=buf), src, out=buf))
        rec = {"shape": shape, "rows": m, "k_local": k, "cublas_ms": t_mm, "cublas_add_ms": t_mm_add,
               "variants": {}}
        seg_rows = -(-m // args.segments)
        cells = []
        for name, swz, cfg in variants:
            out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            call = lambda: torch.ops.flux.gemm_rs_fused_(out, a, w, None, src, flags, seg_rows, 0, 1, 10000, 0,
                                                         1, swz, cfg)
            call()
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            t = time_ms(call)
            rec["variants"][name] = {"ms": t, "rel_err": err, "vs_cublas": t / t_mm, "vs_cublas_add": t / t_mm_add}
            cells.append(f"{t:8.3f}" + ("!" if err > 1e-2 else ""))
        print(f"{shape:>18} {m:6d} {t_mm:8.3f} {t_mm_add:8.3f} " + " ".join(cells), flush=True)
        rows_out.append(rec)
    write(args, rows_out)


def write(args, rows_out):
    if args.out:
        json.dump({"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "op": args.op,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows_out},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
