// flux::copy_overlapped_: a device-to-device copy that asks the driver for a copy engine
// (cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute), so that it can run while
// a GEMM holds every SM. A plain cudaMemcpyAsync between two addresses of the same GPU may run
// as a copy kernel, which then waits for the GEMM to free SMs. The flag is a hint: where the
// driver ignores it the copy is still correct, only not overlapped. Stream-ordered on the
// current stream; under graph capture, where batched copies may not be capturable, a plain
// cudaMemcpyAsync is used.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"

namespace flux {

void copy_overlapped_(at::Tensor& dst, const at::Tensor& src) {
  constexpr const char* op = "copy_overlapped_";
  FLUX_CHECK(dst.is_cuda() && src.is_cuda() && dst.device() == src.device(), op,
             "CUDA tensors on one device expected");
  FLUX_CHECK(dst.is_contiguous() && src.is_contiguous(), op, "contiguous tensors expected");
  FLUX_CHECK(dst.scalar_type() == src.scalar_type() && dst.numel() == src.numel(), op,
             "same dtype and size expected (", dst.scalar_type(), " ", dst.numel(), " vs ", src.scalar_type(), " ",
             src.numel(), ")");
  const size_t bytes = src.numel() * src.element_size();
  if (bytes == 0) return;
  const c10::cuda::CUDAGuard guard(dst.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FLUX_CHECK(cudaStreamIsCapturing(stream, &capture) == cudaSuccess, op, "cudaStreamIsCapturing failed");
  if (capture == cudaStreamCaptureStatusNone) {
    void* dsts[1] = {dst.data_ptr()};
    const void* srcs[1] = {src.data_ptr()};
    size_t sizes[1] = {bytes};
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx[1] = {0};
    const cudaError_t err = cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, attr_idx, 1, stream);
    if (err == cudaSuccess) return;
    (void)cudaGetLastError();  // not supported here: fall through to the plain copy
  }
  const cudaError_t err = cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), bytes, cudaMemcpyDeviceToDevice, stream);
  FLUX_CHECK(err == cudaSuccess, op, "cudaMemcpyAsync failed: ", cudaGetErrorString(err));
}

}  // namespace flux
