// Shared checks for flux CUDA ops. Every message names the op that raised it.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#define FLUX_CHECK(cond, op, ...) TORCH_CHECK((cond), "flux.", op, ": ", __VA_ARGS__)

// Check the launch of the kernel just enqueued (configuration errors surface here;
// faults inside the kernel surface at the next synchronisation).
#define FLUX_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

// Check a CUDA runtime call.
#define FLUX_CUDA(expr) C10_CUDA_CHECK(expr)

namespace flux {

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace flux
