// Running a CUTLASS 3.x device-level GEMM (GemmUniversalAdapter) from a torch op: the checks,
// the CUTLASS workspace (from PyTorch's allocator) and the launch, each failure naming the op.
// Included by the generated kernel units, which are compiled without ATen (common/check.h).
#pragma once

#include "common/check.h"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.h"

namespace flux {

bool fused_pdl();  // common/fused_gemm.cuh

inline cutlass::KernelHardwareInfo hardware_info(int device) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = device_sm_count(device);
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
void run_cutlass_gemm(const char* op, const typename Gemm::Arguments& args, int device, cudaStream_t stream, int m,
                      int n, int k, bool pdl_allowed = true) {
  Gemm gemm;
  FLUX_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, op, "CUTLASS cannot run this problem (M=", m,
             " N=", n, " K=", k, ")");
  // A workspace exists for the stream-K scheduler only (partial accumulators of the tiles whose
  // K loop is split, and the barriers between the CTAs that share one). It comes from PyTorch's
  // caching allocator on `stream`: a block is handed out again only in stream order, and under
  // CUDA-graph capture from the graph's pool. (A buffer cached here would be raced by launches on
  // other streams, or by the next launch while this one runs.)
  const size_t ws_bytes = Gemm::get_workspace_size(args);
  const Workspace ws = ws_bytes > 0 ? cutlass_workspace(ws_bytes, device) : Workspace{};
  void* ws_ptr = ws.ptr;
  if (!smem_limit_set<Gemm>(device)) {
    // The workspace, the parameters, and the kernel's dynamic shared memory limit.
    FLUX_CHECK(gemm.initialize(args, ws_ptr, stream) == cutlass::Status::kSuccess, op, "CUTLASS initialize failed");
    smem_limit_set<Gemm>(device) = true;
  } else {
    // The function attribute already set. CUTLASS zeroes the stream-K barriers (only they need
    // it: partials are written before they are read) with cudaMemsetAsync on `stream`, which a
    // graph capture records as a memset node before the kernel.
    if (ws_bytes > 0) {
      FLUX_CHECK(Gemm::GemmKernel::initialize_workspace(args, ws_ptr, stream) == cutlass::Status::kSuccess, op,
                 "CUTLASS workspace initialisation failed");
    }
    FLUX_CHECK(gemm.update(args, ws_ptr) == cutlass::Status::kSuccess, op, "CUTLASS update failed");
  }
#if defined(CUTLASS_ENABLE_GDC_FOR_SM90)
  // The sm_90a code waits on the preceding grid (fused_gemm.cuh); code of another target built
  // alongside (FLUX_CUDA_ARCH) would not.
  // With a workspace the kernel follows its memset, not a kernel: nothing for PDL to overlap, and
  // the stream-K consumer warps, which touch the workspace, never execute griddepcontrol.wait.
  // pdl_allowed: false where the kernel reads, before its wait, what the kernel before it writes.
  const bool pdl = pdl_allowed && fused_pdl() && ws_bytes == 0 && device_major(device) == 9;
#else
  (void)pdl_allowed;
  const bool pdl = false;  // the kernels have no griddepcontrol.wait: an early start would be unsafe
#endif
  FLUX_CHECK(gemm.run(stream, /*cuda_adapter=*/nullptr, pdl) == cutlass::Status::kSuccess, op,
             "CUTLASS launch failed");
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux
