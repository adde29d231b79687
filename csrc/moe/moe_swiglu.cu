// SwiGLU of the MoE experts' first GEMM output (flux.nn.MoE), one pass each way:
//
//   forward   h [R, 2F] (gate = h[:, :F], up = h[:, F:])  ->  a [R, F] = silu(gate) * up
//   backward  da [R, F], h                                ->  dh [R, 2F]:
//             dh[:, :F] = da * up * silu'(gate),   dh[:, F:] = da * silu(gate)
//
// computed in fp32 (silu(g) = g / (1 + exp(-g)), silu'(g) = s(g) (1 + g (1 - s(g))), s the
// logistic function) and rounded once to h's dtype. Elementwise, N elements per access (16 bytes
// where F and the pointers allow, else 1).
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

template <typename T, int N>
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_fwd_kernel(const T* __restrict__ h, int64_t rows, int64_t f, T* __restrict__ a) {
  const int64_t groups = f / N, total = rows * groups;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / groups, c = (i - r * groups) * N;
    const SwPack<T, N> g = ld<T, N>(h + r * 2 * f + c), u = ld<T, N>(h + r * 2 * f + f + c);
    SwPack<T, N> o;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float x = static_cast<float>(g.v[j]);
      o.v[j] = static_cast<T>(x / (1.0f + __expf(-x)) * static_cast<float>(u.v[j]));
    }
    st<T, N>(a + r * f + c, o);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kSwigluThreads)
swiglu_bwd_kernel(const T* __restrict__ da, const T* __restrict__ h, int64_t rows, int64_t f,
                  T* __restrict__ dh) {
  const int64_t groups = f / N, total = rows * groups;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / groups, c = (i - r * groups) * N;
    const SwPack<T, N> g = ld<T, N>(h + r * 2 * f + c), u = ld<T, N>(h + r * 2 * f + f + c);
    const SwPack<T, N> d = ld<T, N>(da + r * f + c);
    SwPack<T, N> dg, du;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float x = static_cast<float>(g.v[j]), up = static_cast<float>(u.v[j]), dv = static_cast<float>(d.v[j]);
      const float s = 1.0f / (1.0f + __expf(-x));
      dg.v[j] = static_cast<T>(dv * up * s * (1.0f + x * (1.0f - s)));
      du.v[j] = static_cast<T>(dv * x * s);
    }
    st<T, N>(dh + r * 2 * f + c, dg);
    st<T, N>(dh + r * 2 * f + f + c, du);
  }
}

int swiglu_grid(int64_t items) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = (items + kSwigluThreads - 1) / kSwigluThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, static_cast<int64_t>(sms) * 8)));
}

void check_h(const at::Tensor& h, const char* op) {
  FLUX_CHECK(h.is_cuda() && h.dim() == 2 && h.is_contiguous() && h.size(1) % 2 == 0, op,
             "h must be a contiguous 2-D CUDA tensor [R, 2F]");
}

}  // namespace

at::Tensor moe_swiglu(const at::Tensor& h) {
  constexpr const char* op = "moe_swiglu";
  check_h(h, op);
  const int64_t rows = h.size(0), f = h.size(1) / 2;
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor a = at::empty({rows, f}, h.options());
  if (rows == 0 || f == 0) return a;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "moe_swiglu", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const bool vec = f % kVec == 0 && is_aligned(h.data_ptr(), 16) && is_aligned(a.data_ptr(), 16);
    if (vec) {
      const int grid = swiglu_grid(rows * f / kVec);
      moe_launch::check(op, "swiglu_fwd_kernel", swiglu_fwd_kernel<scalar_t, kVec>, grid, kSwigluThreads, 0);
      swiglu_fwd_kernel<scalar_t, kVec><<<grid, kSwigluThreads, 0, stream>>>(
          h.data_ptr<scalar_t>(), rows, f, a.data_ptr<scalar_t>());
    } else {
      const int grid = swiglu_grid(rows * f);
      moe_launch::check(op, "swiglu_fwd_kernel", swiglu_fwd_kernel<scalar_t, 1>, grid, kSwigluThreads, 0);
      swiglu_fwd_kernel<scalar_t, 1><<<grid, kSwigluThreads, 0, stream>>>(h.data_ptr<scalar_t>(), rows, f,
                                                                          a.data_ptr<scalar_t>());
    }
    FLUX_CHECK_LAUNCH();
  });
  return a;
}

at::Tensor moe_swiglu_backward(const at::Tensor& grad, const at::Tensor& h) {
  constexpr const char* op = "moe_swiglu_backward";
  check_h(h, op);
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
    if (vec) {
      const int grid = swiglu_grid(rows * f / kVec);
      moe_launch::check(op, "swiglu_bwd_kernel", swiglu_bwd_kernel<scalar_t, kVec>, grid, kSwigluThreads, 0);
      swiglu_bwd_kernel<scalar_t, kVec><<<grid, kSwigluThreads, 0, stream>>>(
          grad.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), rows, f, dh.data_ptr<scalar_t>());
    } else {
      const int grid = swiglu_grid(rows * f);
      moe_launch::check(op, "swiglu_bwd_kernel", swiglu_bwd_kernel<scalar_t, 1>, grid, kSwigluThreads, 0);
      swiglu_bwd_kernel<scalar_t, 1><<<grid, kSwigluThreads, 0, stream>>>(
          grad.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), rows, f, dh.data_ptr<scalar_t>());
    }
    FLUX_CHECK_LAUNCH();
  });
  return dh;
}

}  // namespace flux
