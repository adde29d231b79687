// Split-K for the fused GEMMs (configurations with splits > 1 in flux/fused_configs.py), the
// decomposition cuBLAS uses on problems of few tiles and deep K: the K loop is cut into S equal
// slices, computed by one batched launch of the persistent GEMM (L = S; slice s reads columns
// [s*K/S, (s+1)*K/S) of A and of the weight: the same row strides, a batch stride of K/S
// elements) into fp32 partials [S, M, N], then one pass
//
//   out[r, c] = sum_{s=0}^{S-1} partial_s[r, c] (+ source[r, c]) (+ bias[c])
//
// in slice order (deterministic), rounded once to the output dtype, as the unsplit kernel's
// epilogue computes it. Nothing is zeroed before the launch and nothing waits between CTAs
// (no stream-K barriers, no workspace memset), so both kernels keep programmatic dependent
// launch: the reduction is launched as the GEMM's dependent and waits for it on the device.
// The partials come from PyTorch's caching allocator on the launch's stream (cutlass_workspace).
// Included by the generated kernel units (csrc/ag_gemm/ag_gemm_fused.cuh, csrc/gemm_rs/rs_fused.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/check.h"
#include "common/flag_wait.cuh"
#include "cute/tensor.hpp"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/numeric_types.h"
#include "cutlass/util/packed_stride.hpp"

namespace flux {

bool fused_pdl();  // common/fused_gemm.cuh

// The reduction's arguments. `flags` (GEMM+RS): flags[s] != 0 once rows [s * rows_per_segment, ...)
// of `source` are in place; the pass waits (bounded) for all of them before it reads any.
template <class Out>
struct SplitKReduce {
  const float* partials = nullptr;  // [splits, m, n]
  const Out* source = nullptr;      // [m, n] or nullptr
  const Out* bias = nullptr;        // [n] or nullptr
  Out* out = nullptr;               // [m, n]
  int64_t m = 0;
  int n = 0, splits = 1;
  const uint32_t* flags = nullptr;
  int segments = 0, rank = 0, peer = 0;
  uint64_t timeout_ns = 0;
  uint32_t* error = nullptr;  // host-mapped [2]: (waiting rank + 1, missing rank) on timeout
};

template <class Out>
__device__ __forceinline__ float split_k_load(const Out* p) {
  return static_cast<float>(*p);
}

// Four consecutive elements per thread and step (n is a multiple of 8: 16-byte partial loads).
template <class Out>
__global__ void __launch_bounds__(256) split_k_reduce_kernel(const SplitKReduce<Out> p) {
  // Under programmatic dependent launch this grid may start before the GEMM that writes the
  // partials has finished: wait for it (and its memory) first; a no-op otherwise.
  cutlass::arch::wait_on_dependent_grids();
  if (p.flags != nullptr) {
    for (int s = threadIdx.x; s < p.segments; s += blockDim.x) {
      wait_flag_bounded(p.flags + s, p.timeout_ns, p.error, p.rank, p.peer);
    }
    __syncthreads();  // the acquires above order every thread's loads of `source` below
  }
  const int64_t mn = p.m * p.n;
  const int64_t quads = mn / 4;
  for (int64_t q = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; q < quads; q += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = q * 4;
    float4 acc = reinterpret_cast<const float4*>(p.partials + i)[0];
    for (int s = 1; s < p.splits; ++s) {
      const float4 v = reinterpret_cast<const float4*>(p.partials + s * mn + i)[0];
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    float r[4] = {acc.x, acc.y, acc.z, acc.w};
    const int c = static_cast<int>(i % p.n);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (p.source != nullptr) r[j] += split_k_load(p.source + i + j);
      if (p.bias != nullptr) r[j] += split_k_load(p.bias + c + j);
    }
    if constexpr (sizeof(Out) == 4) {
      reinterpret_cast<float4*>(p.out + i)[0] = make_float4(r[0], r[1], r[2], r[3]);
    } else {
      cutlass::Array<Out, 4> o;
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] = Out(r[j]);
      reinterpret_cast<cutlass::Array<Out, 4>*>(p.out + i)[0] = o;
    }
  }
}

template <class Out>
void launch_split_k_reduce(const char* op, const SplitKReduce<Out>& p, int device, cudaStream_t stream) {
  const int64_t quads = p.m * p.n / 4;
  const int threads = 256;
  const int64_t want = (quads + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 4LL * device_sm_count(device) ? want : 4LL * device_sm_count(device));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks > 0 ? blocks : 1);
  cfg.blockDim = dim3(threads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
  attr[0].val.programmaticStreamSerializationAllowed = fused_pdl() && device_major(device) == 9;
#else
  attr[0].val.programmaticStreamSerializationAllowed = 0;  // no griddepcontrol.wait in the kernel
#endif
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  // A launch can also report an earlier kernel's failure (a readiness wait that timed out and trapped).
  const cudaError_t e = cudaLaunchKernelEx(&cfg, split_k_reduce_kernel<Out>, p);
  FLUX_CHECK(e == cudaSuccess, op, "split-K reduction launch failed: ", cudaGetErrorString(e));
  FLUX_CHECK_LAUNCH();
}

// The batched GEMM's arguments for slices of K / splits: A [M, K] and weight [N, K] keep their row
// strides (K) and step by K / splits elements per batch; D is the fp32 partials [splits, M, N],
// without bias or source (the reduction adds them).
template <class G>
void set_split_k(typename G::Gemm::Arguments& args, int m, int n, int k, int splits, float* partials) {
  using Kernel = typename G::Gemm::GemmKernel;
  // Swapped operands (fused_gemm.cuh): CUTLASS's (M, N) is (n, m), and its column-major slice of D^T is
  // the same m x n row-major block of partials.
  const int pm = G::kSwapped ? n : m, pn = G::kSwapped ? m : n;
  const int ks = k / splits;
  args.problem_shape = {pm, pn, ks, splits};
  auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(pm, k, 1));
  auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(pn, k, 1));
  cute::get<2>(sa) = ks;
  cute::get<2>(sb) = ks;
  auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(pm, pn, splits));
  args.mainloop.dA = sa;
  args.mainloop.dB = sb;
  args.epilogue.ptr_D = partials;
  args.epilogue.dD = sd;
  args.epilogue.dC = sd;
  args.epilogue.thread.bias_ptr = nullptr;
  args.epilogue.thread.beta = 0.0f;
}

// The output element type of a dtype variant (fused_gemm.cuh's FusedDtype) as the reduction writes it.
template <int Dtype>
struct SplitKOut;
template <>
struct SplitKOut<0> { using T = cutlass::bfloat16_t; };
template <>
struct SplitKOut<1> { using T = cutlass::half_t; };
template <>
struct SplitKOut<2> { using T = float; };
template <>
struct SplitKOut<3> { using T = float; };

}  // namespace flux
