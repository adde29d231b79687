// torch.ops.flux.grouped_mm_cutlass: checks, the output and the per-expert argument scratch, then
// one instantiation of the grouped GEMM (grouped_gemm.cuh; generated from flux/fused_configs.py).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "moe/grouped_gemm.cuh"
#include "ops.h"

namespace flux {

// slab == 0: offs int32 cumulative row ends, one per expert. slab C > 0: offs int64 rows per
// expert, a's rows are E slabs of C (expert e's rows e * C .. e * C + offs[e] - 1, the rest neither
// read nor written; grouped_gemm.cuh).
at::Tensor grouped_mm_cutlass(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, int64_t kind,
                              int64_t config, int64_t slab) {
  constexpr const char* op = "grouped_mm_cutlass";
#if !defined(FLUX_WITH_SM90)
  FLUX_CHECK(false, op, "flux._C was built without an sm_90a target (FLUX_CUDA_ARCH)");
#endif
  FLUX_CHECK(kind >= kGroupedNK && kind <= kGroupedWgrad, op, "kind must be 0 (nk), 1 (kn) or 2 (wgrad), got ", kind);
  FLUX_CHECK(config >= 0 && config < 4096, op, "unknown configuration ", config);
  FLUX_CHECK(a.is_cuda() && b.is_cuda() && offs.is_cuda() && a.device() == b.device() && a.device() == offs.device(),
             op, "a, b and offs must be CUDA tensors on one device");
  FLUX_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16, op, "bf16 a and b expected, got ",
             a.scalar_type(), " and ", b.scalar_type());
  FLUX_CHECK(slab >= 0, op, "slab must be >= 0, got ", slab);
  FLUX_CHECK(offs.scalar_type() == (slab ? at::kLong : at::kInt) && offs.dim() == 1 && offs.is_contiguous() &&
                 offs.numel() >= 1,
             op, slab ? "offs must be a contiguous 1-D int64 tensor of rows per expert (slab > 0)"
                      : "offs must be a contiguous 1-D int32 tensor of one cumulative row end per expert");
  FLUX_CHECK(slab == 0 || a.size(0) == offs.numel() * slab, op, "slab ", slab, ": a must have E * slab = ",
             offs.numel() * slab, " rows, got ", a.size(0));
  FLUX_CHECK(a.dim() == 2 && a.is_contiguous() && b.is_contiguous(), op, "contiguous a [R, *] and b expected");
  FLUX_CHECK(a.size(0) < (int64_t(1) << 31), op, "more rows than int32 offsets hold");
  FLUX_CHECK(is_aligned(a.data_ptr(), 16) && is_aligned(b.data_ptr(), 16), op, "a and b must start 16-byte aligned");
  const int64_t groups = offs.numel();
  int64_t n, k;
  at::Tensor d;
  if (kind == kGroupedWgrad) {  // a [R, M], b [R, N] -> d [E, M, N]
    FLUX_CHECK(b.dim() == 2 && b.size(0) == a.size(0), op, "wgrad: a [R, M] and b [R, N] expected, got ", a.sizes(),
               " and ", b.sizes());
    n = a.size(1), k = b.size(1);
    d = at::empty({groups, n, k}, a.options());
  } else {  // a [R, K], b [E, N, K] (nk) or [E, K, N] (kn) -> d [R, N]
    FLUX_CHECK(b.dim() == 3 && b.size(0) == groups, op, "b must be [E, N, K] or [E, K, N] with E = offs.numel() (",
               groups, "), got ", b.sizes());
    k = a.size(1);
    n = kind == kGroupedNK ? b.size(1) : b.size(2);
    FLUX_CHECK((kind == kGroupedNK ? b.size(2) : b.size(1)) == k, op, "a has K=", k, " but b is ", b.sizes());
    d = at::empty({a.size(0), n}, a.options());
  }
  FLUX_CHECK(n % 8 == 0 && k % 8 == 0, op, "the GEMM's N and K (or M and N) must be multiples of 8, got ", n, " and ",
             k);
  FLUX_CHECK(n < (int64_t(1) << 31) && k < (int64_t(1) << 31), op, "dimensions over int32");
  if (d.numel() == 0) return d;
  const c10::cuda::CUDAGuard guard(a.device());
  const at::TensorOptions bytes = a.options().dtype(at::kByte);
  at::Tensor scratch = at::empty({groups * kGroupedArgBytes}, bytes);
  GroupedGemmArgs args;
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.d = d.data_ptr();
  if (slab) {
    args.counts = offs.data_ptr<int64_t>();
    args.slab = slab;
  } else {
    args.offs = offs.data_ptr<int>();
  }
  args.groups = static_cast<int>(groups);
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  args.scratch = scratch.data_ptr();
  args.device = a.device().index();
  args.stream = at::cuda::getCurrentCUDAStream(a.device().index()).stream();
  FLUX_CHECK(grouped_dispatch(static_cast<int>(config), static_cast<int>(kind), args), op, "configuration ", config,
             " for kind ", kind, " is not built into flux._C (built: ", grouped_kernels_built(),
             "; FLUX_KERNELS selects them at build time)");
  return d;
}

}  // namespace flux
