// The ATen side of the generated kernel units, which are compiled without ATen (common/check.h):
// their errors, the device properties they read, and the CUTLASS workspace.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "common/check.h"

namespace flux {

void raise_error(const std::string& what) {
  TORCH_CHECK(false, what);
}

void raise_cuda_error(cudaError_t err, const char* file, int line) {
  c10::cuda::c10_cuda_check_implementation(static_cast<int32_t>(err), file, "", static_cast<uint32_t>(line), true);
  TORCH_CHECK(false, "CUDA error ", cudaGetErrorString(err), " at ", file, ":", line);  // not reached
}

int device_sm_count(int device) {
  return at::cuda::getDeviceProperties(device)->multiProcessorCount;
}

int device_major(int device) {
  return at::cuda::getDeviceProperties(device)->major;
}

Workspace cutlass_workspace(size_t bytes, int device) {
  auto t = std::make_shared<at::Tensor>(at::empty(
      {static_cast<int64_t>(bytes)},
      at::TensorOptions().dtype(at::kByte).device(at::kCUDA, static_cast<c10::DeviceIndex>(device))));
  return Workspace{t->data_ptr(), t};
}

}  // namespace flux
