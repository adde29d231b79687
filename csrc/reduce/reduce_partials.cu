// out[r, c] = bias[c] + sum_{w=0}^{W-1} partial_w[r, c]
//
// The last stage of GEMM+ReduceScatter, in two forms:
//   reduce_chunks_  the W partials of this rank's rows lie in one local buffer [W, R, C]
//                   (its own and the ones its peers pushed);
//   reduce_peers_   partial_w lies in rank w's symmetric buffer, read over NVLink by SM
//                   loads (the one-shot form, for small problems).
// Either way the reduction is one pass. Accumulation is in fp32 and always in rank order 0..W-1, so
// the result does not depend on which peer's data arrived first, and it is rounded to
// the output dtype once (NCCL's bf16 reduce-scatter rounds after every addition).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/check.h"

namespace flux {
namespace {

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Where partial w lives: at base + w * stride in one buffer, or behind a per-rank pointer.
template <typename T>
struct StridedSrc {
  const T* base;
  int64_t stride;
  __device__ __forceinline__ const T* operator()(int w) const { return base + w * stride; }
};
template <typename T>
struct PeerSrc {
  const void* const* ptrs;  // device array of W base addresses
  int64_t offset_bytes;
  __device__ __forceinline__ const T* operator()(int w) const {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(ptrs[w]) + offset_bytes);
  }
};

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(T (&buf)[VEC], const T* p) {
  if constexpr (VEC * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(buf) = *reinterpret_cast<const uint4*>(p);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) buf[v] = p[v];
  }
}

// VEC elements per access: 16-byte loads of the partials when the row length and the
// pointers allow it, single elements otherwise.
template <typename TIn, typename TOut, typename TBias, int VEC, typename Src>
__global__ void reduce_chunks_kernel(Src src, const TBias* __restrict__ bias, TOut* __restrict__ out, int world,
                                     int64_t rows, int64_t cols) {
  const int64_t n_vec = rows * cols / VEC;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_vec;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e = i * VEC;
    float acc[VEC];
    if (bias != nullptr) {
      const int64_t c = e % cols;  // VEC divides cols, so the vector stays in one row
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = to_float(bias[c + v]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
    }
    for (int w = 0; w < world; ++w) {
      TIn buf[VEC];
      load_vec<TIn, VEC>(buf, src(w) + e);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] += to_float(buf[v]);
    }
    TOut res[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) res[v] = static_cast<TOut>(acc[v]);
    if constexpr (VEC * sizeof(TOut) % 16 == 0) {
#pragma unroll
      for (int k = 0; k < (int)(VEC * sizeof(TOut) / 16); ++k)
        reinterpret_cast<uint4*>(out + e)[k] = reinterpret_cast<uint4*>(res)[k];
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[e + v] = res[v];
    }
  }
}

// src_aligned: every partial's base address is 16-byte aligned.
template <typename TIn, typename TOut, typename TBias, template <typename> class Src>
void launch(Src<TIn> src, bool src_aligned, const TBias* bias, at::Tensor& out, int world, int64_t rows,
            int64_t cols, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(TIn);
  const bool vec_ok = cols % kVec == 0 && src_aligned && is_aligned(out.data_ptr(), 16) &&
                      (kVec * sizeof(TOut)) % 16 == 0;
  const int vec = vec_ok ? kVec : 1;
  const int64_t work = rows * cols / vec;
  const int threads = 256;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, sms * 8));
  auto* o = out.data_ptr<TOut>();
  if (vec_ok) {
    reduce_chunks_kernel<TIn, TOut, TBias, kVec><<<blocks, threads, 0, stream>>>(src, bias, o, world, rows, cols);
  } else {
    reduce_chunks_kernel<TIn, TOut, TBias, 1><<<blocks, threads, 0, stream>>>(src, bias, o, world, rows, cols);
  }
  FLUX_CHECK_LAUNCH();
}

}  // namespace

// partials: [W, R, C], each [R, C] slice contiguous (any stride between slices, so a row
// range of every slot can be reduced); out: [R, C] contiguous; bias: [C] or None.
void reduce_chunks_(at::Tensor& out, const at::Tensor& partials, const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "reduce_chunks_";
  FLUX_CHECK(partials.is_cuda() && out.is_cuda(), op, "tensors must be on a CUDA device");
  FLUX_CHECK(partials.dim() == 3, op, "partials must be [world, rows, cols], got ", partials.sizes());
  const int64_t world = partials.size(0), rows = partials.size(1), cols = partials.size(2);
  FLUX_CHECK(partials.stride(2) == 1 && (rows <= 1 || partials.stride(1) == cols) && out.is_contiguous(), op,
             "each partials[w] must be a contiguous [rows, cols] block and out contiguous; got strides ",
             partials.strides());
  FLUX_CHECK(out.numel() == rows * cols && out.size(-1) == cols, op, "out ", out.sizes(),
             " does not match partials ", partials.sizes());
  FLUX_CHECK(out.get_device() == partials.get_device(), op, "out and partials on different devices");
  if (bias.has_value()) {
    FLUX_CHECK(bias->is_contiguous() && bias->numel() == cols && bias->is_cuda(), op,
               "bias must be a contiguous CUDA tensor of ", cols, " elements");
    FLUX_CHECK(bias->scalar_type() == out.scalar_type(), op, "bias dtype ", bias->scalar_type(),
               " differs from the output dtype ", out.scalar_type());
  }
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(partials.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Bounded dispatch: partials in {bf16, fp16, fp32}; out (and bias) in {partials dtype, fp32}.
  const int64_t slot_stride = world > 1 ? partials.stride(0) : rows * cols;
  const bool aligned = is_aligned(partials.data_ptr(), 16) && (slot_stride * partials.element_size()) % 16 == 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, partials.scalar_type(), "reduce_chunks_in", [&] {
    using TIn = scalar_t;
    StridedSrc<TIn> src{partials.data_ptr<TIn>(), slot_stride};
    if (out.scalar_type() == partials.scalar_type()) {
      const TIn* b = bias.has_value() ? bias->data_ptr<TIn>() : nullptr;
      launch<TIn, TIn, TIn>(src, aligned, b, out, (int)world, rows, cols, stream);
    } else if (out.scalar_type() == at::kFloat) {
      const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
      launch<TIn, float, float>(src, aligned, b, out, (int)world, rows, cols, stream);
    } else {
      FLUX_CHECK(false, op, "unsupported output dtype ", out.scalar_type(), " for partials of ",
                 partials.scalar_type());
    }
  });
}

// ptrs_dev: device array of the W ranks' buffer base addresses (a symmetric workspace);
// partial w = [rows, cols] of out's dtype at ptrs[w] + offset_bytes. The caller orders this
// after every peer's partial is complete (a barrier) and before any peer overwrites it.
void reduce_peers_(at::Tensor& out, int64_t ptrs_dev, int64_t world, int64_t offset_bytes,
                   const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "reduce_peers_";
  FLUX_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() >= 1, op, "out must be a contiguous CUDA tensor");
  FLUX_CHECK(world >= 1 && world <= 1024, op, "bad world size ", world);
  const int64_t cols = out.size(-1), rows = cols ? out.numel() / cols : 0;
  if (bias.has_value()) {
    FLUX_CHECK(bias->is_contiguous() && bias->numel() == cols && bias->is_cuda() &&
                   bias->scalar_type() == out.scalar_type(),
               op, "bias must be a contiguous CUDA tensor of ", cols, " elements in the output dtype");
  }
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Workspace bases are allocation-granularity aligned, so alignment is the offset's.
  const bool aligned = offset_bytes % 16 == 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "reduce_peers", [&] {
    PeerSrc<scalar_t> src{reinterpret_cast<const void* const*>(ptrs_dev), offset_bytes};
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    launch<scalar_t, scalar_t, scalar_t>(src, aligned, b, out, (int)world, rows, cols, stream);
  });
}

}  // namespace flux
