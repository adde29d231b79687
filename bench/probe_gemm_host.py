"""What does the hot path's GEMM cost on the host, and can it cost less without losing GPU speed?
(docs/design.md §7.3, "The GEMM's host cost")

Every strategy enqueues its GEMMs with ``at::mm_out`` (csrc/runtime/tensors.cpp, gemm_into). This
probe times three ways of enqueueing the same bf16 GEMM out[M, N] = a[M, K] @ W^T (W [N, K], as
nn.Linear), from C++ (an inline extension built at start):

  mm_out   at::mm_out(out, a, W^T view): what flux runs today (the dispatcher, ATen's checks,
           then cuBLAS);
  blas     cublasGemmEx on torch's cuBLAS handle, as ATen's bf16 gemm calls it, without the
           dispatcher and ATen's checks (the same kernels: results bitwise equal);
  lt       cublasLtMatmul with the descriptors made once per shape and the heuristic's first
           algorithm cached (what a plan could hold), a 32 MiB workspace of its own.

Per shape and way: host µs per call (median of --calls calls enqueued in batches of 20 behind a
GPU spin that outlasts them: no call waits for the device), GPU ms per call in a CUDA graph of 20
calls (median of 20 replays) and in an eager loop of 20 calls, and the largest difference from
at::mm_out's output (0 where the same kernel ran). One GPU, one process.

    python bench/probe_gemm_host.py [--shapes 128x8192x14336,...] [--out probe.json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

SRC = r"""
#include <ATen/ATen.h>
#include <cublas_v2.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#include <map>
#include <tuple>

#define LT_CHECK(x) do { cublasStatus_t s_ = (x); TORCH_CHECK(s_ == CUBLAS_STATUS_SUCCESS, #x, " failed: ", (int)s_); } while (0)

// out [M, N] = a [M, K] @ w^T, w [N, K]; all row-major bf16, contiguous.
void mm_out(at::Tensor out, const at::Tensor& a, const at::Tensor& w) {
  at::mm_out(out, a, w.t());
}

void blas(at::Tensor out, const at::Tensor& a, const at::Tensor& w) {
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  // What ATen's bf16 gemm runs: cublasGemmEx on torch's handle (its stream and workspace set by
  // getCurrentCUDABlasHandle), fp32 compute. Column-major: out^T [N, M] = w^T' x a^T.
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  const float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w.data_ptr(), CUDA_R_16BF, k, a.data_ptr(),
                        CUDA_R_16BF, k, &beta, out.data_ptr(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT_TENSOR_OP));
}

struct LtPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
};
static std::map<std::tuple<int64_t, int64_t, int64_t>, LtPlan> plans;
static at::Tensor workspace;

void lt(at::Tensor out, const at::Tensor& a, const at::Tensor& w) {
  const int64_t m = a.size(0), k = a.size(1), n = w.size(0);
  cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
  if (!workspace.defined()) workspace = at::empty({32 << 20}, a.options().dtype(at::kByte));
  auto key = std::make_tuple(m, n, k);
  auto it = plans.find(key);
  if (it == plans.end()) {
    LtPlan p;
    LT_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, k, n, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, k, m, k));
    LT_CHECK(cublasLtMatrixLayoutCreate(&p.lc, CUDA_R_16BF, n, m, n));
    cublasLtMatmulPreference_t pref;
    LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = workspace.numel();
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(h, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &res, &found));
    TORCH_CHECK(found > 0, "no cuBLASLt algorithm for ", m, "x", k, "x", n);
    cublasLtMatmulPreferenceDestroy(pref);
    p.algo = res.algo;
    it = plans.emplace(key, p).first;
  }
  const LtPlan& p = it->second;
  const float alpha = 1.0f, beta = 0.0f;
  LT_CHECK(cublasLtMatmul(h, p.desc, &alpha, w.data_ptr(), p.la, a.data_ptr(), p.lb, &beta, out.data_ptr(), p.lc,
                          out.data_ptr(), p.lc, &p.algo, workspace.data_ptr(), workspace.numel(),
                          at::cuda::getCurrentCUDAStream().stream()));
}
"""

DEFAULT_SHAPES = ("128x8192x14336,512x8192x14336,1024x1024x1024,2048x8192x8192,2048x8192x14336,"
                  "4096x8192x14336,4096x14336x8192,8192x8192x14336")
BATCH = 20


def _loaded(name):
    """Path of the shared library ``name`` this process has loaded (torch loads cuBLASLt)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if os.path.basename(path).startswith(name):
                return path
    raise RuntimeError(f"{name} is not loaded")


def build():
    from torch.utils.cpp_extension import load_inline

    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, x)  # loads cuBLAS and cuBLASLt
    torch.cuda.synchronize()
    libs = [_loaded("libcublasLt.so"), _loaded("libcublas.so")]
    decls = "\n".join(f"void {f}(at::Tensor out, const at::Tensor& a, const at::Tensor& w);"
                      for f in ("mm_out", "blas", "lt"))
    return load_inline("flux_probe_gemm_host", cpp_sources=[decls, SRC], functions=["mm_out", "blas", "lt"],
                       with_cuda=True, extra_cflags=["-O2"],
                       extra_ldflags=libs + [f"-Wl,-rpath,{os.path.dirname(lib)}" for lib in libs], verbose=False)


def host_us(fn, calls):
    cycles_per_us = torch.cuda.get_device_properties(0).clock_rate / 1e3
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < calls:
        torch.cuda._sleep(int((2000 + 500 * BATCH) * cycles_per_us))
        for _ in range(BATCH):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def gpu_ms(fn, graph):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm inside the side stream before capture
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(BATCH):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(BATCH):
                fn()
    samples = []
    for _ in range(23):
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / BATCH)
    return statistics.median(samples[3:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="MxKxN,... (out [M, N] = a [M, K] @ W^T, W [N, K])")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.time()
    ext = build()
    print(f"extension built in {time.time() - t0:.0f} s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    results = []
    for spec in args.shapes.split(","):
        m, k, n = (int(x) for x in spec.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
        ref = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ext.mm_out(ref, a, w)
        rec = {"shape": spec}
        for way in ("mm_out", "blas", "lt"):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
            fn = getattr(ext, way)
            fn(out, a, w)
            torch.cuda.synchronize()
            diff = (out.float() - ref.float()).abs().max().item()
            rec[way] = {"host_us": host_us(lambda: fn(out, a, w), args.calls), "graph_ms": gpu_ms(lambda: fn(out, a, w), True),
                        "loop_ms": gpu_ms(lambda: fn(out, a, w), False), "max_abs_diff_vs_mm_out": diff}
        results.append(rec)
        print(spec, " | ".join(f"{w_}: host {rec[w_]['host_us']:.1f} us, graph {rec[w_]['graph_ms']:.4f} ms, "
                                f"loop {rec[w_]['loop_ms']:.4f} ms, diff {rec[w_]['max_abs_diff_vs_mm_out']:.3g}"
                                for w_ in ("mm_out", "blas", "lt")), flush=True)
    print("\nshape            | host us: mm_out  blas   lt | graph ms: mm_out  blas    lt    | lt/mm_out graph")
    for rec in results:
        h = [rec[w_]["host_us"] for w_ in ("mm_out", "blas", "lt")]
        gm = [rec[w_]["graph_ms"] for w_ in ("mm_out", "blas", "lt")]
        print(f"{rec['shape']:16} | {h[0]:13.1f} {h[1]:5.1f} {h[2]:5.1f} | {gm[0]:14.4f} {gm[1]:.4f} {gm[2]:.4f} | "
              f"{gm[2] / gm[0]:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python3 bench/probe_gemm_host.py " + " ".join(sys.argv[1:]),
                       "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
