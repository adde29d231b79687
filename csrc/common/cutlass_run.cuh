// Running a CUTLASS 3.x device-level GEMM (GemmUniversalAdapter) from a torch op: the checks,
// the CUTLASS workspace (from PyTorch's allocator) and the launch, each failure naming the op.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "common/check.h"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

namespace flux {

inline cutlass::KernelHardwareInfo hardware_info(int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  return hw;
}

template <class Gemm>
void run_cutlass_gemm(const char* op, const typename Gemm::Arguments& args, const at::TensorOptions& byte_options,
                      cudaStream_t stream, int m, int n, int k) {
  Gemm gemm;
  FLUX_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, op, "CUTLASS cannot run this problem (M=", m,
             " N=", n, " K=", k, ")");
  const size_t ws_bytes = Gemm::get_workspace_size(args);
  at::Tensor ws;
  if (ws_bytes > 0) ws = at::empty({(int64_t)ws_bytes}, byte_options);
  FLUX_CHECK(gemm.initialize(args, ws_bytes ? ws.data_ptr() : nullptr, stream) == cutlass::Status::kSuccess, op,
             "CUTLASS initialize failed");
  FLUX_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, op, "CUTLASS launch failed");
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux
