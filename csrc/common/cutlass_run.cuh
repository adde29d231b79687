// Running a CUTLASS 3.x device-level GEMM (GemmUniversalAdapter) from a torch op: the checks,
// the CUTLASS workspace (from PyTorch's allocator) and the launch, each failure naming the op.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "common/check.h"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

namespace flux {

bool fused_pdl();  // common/fused_gemm.cuh

inline cutlass::KernelHardwareInfo hardware_info(int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  return hw;
}

// Whether this process has set ``Gemm``'s dynamic shared memory limit on ``device``
// (GemmUniversalAdapter::initialize calls cudaFuncSetAttribute on every call, ~3 µs of host time).
template <class Gemm>
bool& smem_limit_set(int device) {
  static bool set[64] = {};
  return set[device & 63];
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
  const int device = byte_options.device().index();
  if (ws_bytes == 0 && smem_limit_set<Gemm>(device)) {
    // No workspace to initialise and the function attribute already set: the parameters only.
    FLUX_CHECK(gemm.update(args, nullptr) == cutlass::Status::kSuccess, op, "CUTLASS update failed");
  } else {
    FLUX_CHECK(gemm.initialize(args, ws_bytes ? ws.data_ptr() : nullptr, stream) == cutlass::Status::kSuccess, op,
               "CUTLASS initialize failed");
    smem_limit_set<Gemm>(device) = true;
  }
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
  // The sm_90a code waits on the preceding grid (fused_gemm.cuh); code of another target built
  // alongside (FLUX_CUDA_ARCH) would not.
  const bool pdl = fused_pdl() && at::cuda::getDeviceProperties(device)->major == 9;
#else
  const bool pdl = false;  // the kernels have no griddepcontrol.wait: an early start would be unsafe
#endif
  FLUX_CHECK(gemm.run(stream, /*cuda_adapter=*/nullptr, pdl) == cutlass::Status::kSuccess, op,
             "CUTLASS launch failed");
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux
