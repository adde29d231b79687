// SwiGLU of the MoE experts' first GEMM output (flux.nn.MoE), one pass each way:
//
//   forward   h [R, 2F] (gate = h[:, :F], up = h[:, F:])  ->  a [R, F] = silu(gate) * up
//   backward  da [R, F], h                                ->  dh [R, 2F]:
//             dh[:, :F] = da * up * silu'(gate),   dh[:, F:] = da * silu(gate)
//
// computed in fp32 (silu(g) = g / (1 + exp(-g)), silu'(g) = s(g) (1 + g (1 - s(g))), s the
// logistic function) and rounded once to h's dtype. Elementwise, N elements per access (16 bytes
// where F and the pointers allow, else 1). Slab mode (counts given, slab C: the bounded dispatch's
// [E, C, *] layout): row r is computed only where r % C < counts[r / C]; the others are neither read
// nor written (the masked grouped GEMMs on either side read none of them).
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"
#include "moe/launch.h"
#include "ops.h"

namespace flux {
namespace {

constexpr int kSwigluThreads = 256;

template <typename T, int N>
struct alignas(sizeof(T) * N) SwPack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ SwPack<T, N> ld(const T* p) {
  return *reinterpret_cast<const SwPack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void st(T* p, const SwPack<T, N>& v) {
  *reinterpret_cast<SwPack<T, N>*>(p) = v;
}

// Row-major work: a block takes whole rows (grid-stride), its threads the row's N-element groups,
// so that a thread's addresses need no 64-bit division (the element-wise grid-stride form spent
// about a third of the backward's time on it: 2.4 TB/s of HBM traffic against 3.9 for this one,
// the same as a plain copy, on an H200 at 32768 x 2048).
template <typename T, int N>
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_fwd_kernel(const T* __restrict__ h, int64_t rows, int64_t f, const int64_t* __restrict__ counts,
                  int64_t slab, T* __restrict__ a) {
  const int64_t groups = f / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (counts != nullptr && r % slab >= counts[r / slab]) continue;
    const T* hr = h + r * 2 * f;
    T* ar = a + r * f;
    for (int64_t c = threadIdx.x; c < groups; c += blockDim.x) {
      const SwPack<T, N> g = ld<T, N>(hr + c * N), u = ld<T, N>(hr + f + c * N);
      SwPack<T, N> o;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float x = static_cast<float>(g.v[j]);
        o.v[j] = static_cast<T>(x / (1.0f + __expf(-x)) * static_cast<float>(u.v[j]));
      }
      st<T, N>(ar + c * N, o);
    }
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_bwd_kernel(const T* __restrict__ da, const T* __restrict__ h, int64_t rows, int64_t f,
                  const int64_t* __restrict__ counts, int64_t slab, T* __restrict__ dh) {
  const int64_t groups = f / N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (counts != nullptr && r % slab >= counts[r / slab]) continue;
    const T* hr = h + r * 2 * f;
    const T* dar = da + r * f;
    T* dhr = dh + r * 2 * f;
    for (int64_t c = threadIdx.x; c < groups; c += blockDim.x) {
      const SwPack<T, N> g = ld<T, N>(hr + c * N), u = ld<T, N>(hr + f + c * N);
      const SwPack<T, N> d = ld<T, N>(dar + c * N);
      SwPack<T, N> dg, du;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float x = static_cast<float>(g.v[j]), up = static_cast<float>(u.v[j]), dv = static_cast<float>(d.v[j]);
        const float s = 1.0f / (1.0f + __expf(-x));
        dg.v[j] = static_cast<T>(dv * up * s * (1.0f + x * (1.0f - s)));
        du.v[j] = static_cast<T>(dv * x * s);
      }
      st<T, N>(dhr + c * N, dg);
      st<T, N>(dhr + f + c * N, du);
    }
  }
}

// Threads (at each launch): the row's groups in whole warps, at most kSwigluThreads.
// Blocks: one per row, at most blocks_per_sm per SM (measured on an H200 at 32768 x 2048: 4 for
// the forward, 16 for the backward, within a few percent of the others).
int swiglu_grid(int64_t rows, int blocks_per_sm) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, static_cast<int64_t>(sms) * blocks_per_sm)));
}

void check_h(const at::Tensor& h, const char* op) {
  FLUX_CHECK(h.is_cuda() && h.dim() == 2 && h.is_contiguous() && h.size(1) % 2 == 0, op,
             "h must be a contiguous 2-D CUDA tensor [R, 2F]");
}

// The slab mode's counts pointer (nullptr without counts), checked against h's rows.
const int64_t* slab_counts(const std::optional<at::Tensor>& counts, int64_t slab, const at::Tensor& h,
                           const char* op) {
  if (!counts.has_value()) return nullptr;
  FLUX_CHECK(slab > 0 && counts->is_cuda() && counts->device() == h.device() && counts->scalar_type() == at::kLong &&
                 counts->dim() == 1 && counts->is_contiguous() && counts->numel() * slab == h.size(0),
             op, "counts must be a contiguous int64 [E] tensor on h's device, with slab > 0 and E * slab = ",
             h.size(0), " rows");
  return counts->data_ptr<int64_t>();
}

}  // namespace

at::Tensor moe_swiglu(const at::Tensor& h, const std::optional<at::Tensor>& counts, int64_t slab) {
  constexpr const char* op = "moe_swiglu";
  check_h(h, op);
  const int64_t* cnt = slab_counts(counts, slab, h, op);
  const int64_t rows = h.size(0), f = h.size(1) / 2;
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor a = at::empty({rows, f}, h.options());
  if (rows == 0 || f == 0) return a;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "moe_swiglu", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool vec = f % kVec == 0 && is_aligned(h.data_ptr(), 16) && is_aligned(a.data_ptr(), 16);
    const int grid = swiglu_grid(rows, 4);
    if (vec) {
      const int threads = static_cast<int>(std::min<int64_t>(kSwigluThreads, (f / kVec + 31) / 32 * 32));
      moe_launch::check(op, "swiglu_fwd_kernel", swiglu_fwd_kernel<scalar_t, kVec>, grid, threads, 0);
      swiglu_fwd_kernel<scalar_t, kVec><<<grid, threads, 0, stream>>>(h.data_ptr<scalar_t>(), rows, f, cnt,
                                                                       slab, a.data_ptr<scalar_t>());
    } else {
      const int threads = static_cast<int>(std::min<int64_t>(kSwigluThreads, (f + 31) / 32 * 32));
      moe_launch::check(op, "swiglu_fwd_kernel", swiglu_fwd_kernel<scalar_t, 1>, grid, threads, 0);
      swiglu_fwd_kernel<scalar_t, 1><<<grid, threads, 0, stream>>>(h.data_ptr<scalar_t>(), rows, f, cnt, slab,
                                                                    a.data_ptr<scalar_t>());
    }
    FLUX_CHECK_LAUNCH();
  });
  return a;
}

at::Tensor moe_swiglu_backward(const at::Tensor& grad, const at::Tensor& h, const std::optional<at::Tensor>& counts,
                               int64_t slab) {
  constexpr const char* op = "moe_swiglu_backward";
  check_h(h, op);
  const int64_t* cnt = slab_counts(counts, slab, h, op);
  const int64_t rows = h.size(0), f = h.size(1) / 2;
  FLUX_CHECK(grad.is_cuda() && grad.is_contiguous() && grad.dim() == 2 && grad.size(0) == rows &&
                 grad.size(1) == f && grad.scalar_type() == h.scalar_type(),
             op, "grad must be a contiguous [R, F] CUDA tensor in h's dtype");
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor dh = at::empty_like(h);
  if (rows == 0 || f == 0) return dh;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "moe_swiglu_backward", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool vec = f % kVec == 0 && is_aligned(h.data_ptr(), 16) && is_aligned(grad.data_ptr(), 16) &&
                     is_aligned(dh.data_ptr(), 16);
    const int grid = swiglu_grid(rows, 16);
    if (vec) {
      const int threads = static_cast<int>(std::min<int64_t>(kSwigluThreads, (f / kVec + 31) / 32 * 32));
      moe_launch::check(op, "swiglu_bwd_kernel", swiglu_bwd_kernel<scalar_t, kVec>, grid, threads, 0);
      swiglu_bwd_kernel<scalar_t, kVec><<<grid, threads, 0, stream>>>(
          grad.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), rows, f, cnt, slab, dh.data_ptr<scalar_t>());
    } else {
      const int threads = static_cast<int>(std::min<int64_t>(kSwigluThreads, (f + 31) / 32 * 32));
      moe_launch::check(op, "swiglu_bwd_kernel", swiglu_bwd_kernel<scalar_t, 1>, grid, threads, 0);
      swiglu_bwd_kernel<scalar_t, 1><<<grid, threads, 0, stream>>>(
          grad.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), rows, f, cnt, slab, dh.data_ptr<scalar_t>());
    }
    FLUX_CHECK_LAUNCH();
  });
  return dh;
}

}  // namespace flux
