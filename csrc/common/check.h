// Shared checks for flux CUDA ops. Every message names the op that raised it.
//
// The generated CUTLASS translation units (setup.py defines FLUX_KERNEL_UNIT in them) are compiled
// without ATen: its headers cost nvcc about 40 s per unit, more than a third of a kernel unit's
// compile. There the checks raise through raise_error (kernel_host.cpp), the same c10::Error
// (RuntimeError in Python) with the same text as TORCH_CHECK's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#if defined(FLUX_KERNEL_UNIT)

#include <cuda_runtime.h>

#include <sstream>
#include <string>

namespace flux {

[[noreturn]] void raise_error(const std::string& what);          // TORCH_CHECK(false, what)
[[noreturn]] void raise_cuda_error(cudaError_t err, const char* file, int line);  // C10_CUDA_CHECK(err)

template <class... T>
std::string str_cat(const T&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}

}  // namespace flux

#define FLUX_CHECK(cond, op, ...)                                                            \
  do {                                                                                       \
    if (!(cond)) ::flux::raise_error(::flux::str_cat("flux.", op, ": ", __VA_ARGS__));        \
  } while (0)

#define FLUX_CHECK_LAUNCH()                                                                  \
  do {                                                                                       \
    const cudaError_t flux_err_ = cudaGetLastError();                                        \
    if (flux_err_ != cudaSuccess) ::flux::raise_cuda_error(flux_err_, __FILE__, __LINE__);   \
  } while (0)

#else

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#define FLUX_CHECK(cond, op, ...) TORCH_CHECK((cond), "flux.", op, ": ", __VA_ARGS__)

// Check the launch of the kernel just enqueued (configuration errors surface here;
// faults inside the kernel surface at the next synchronisation).
#define FLUX_CHECK_LAUNCH() C10_CUDA_KERNEL_LAUNCH_CHECK()

// Check a CUDA runtime call.
#define FLUX_CUDA(expr) C10_CUDA_CHECK(expr)

#endif

namespace flux {

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// What the kernel units ask of the ATen side (kernel_host.cpp): the device's SM count and major
// compute capability (ATen's cached properties), and a CUTLASS workspace of `bytes` from PyTorch's
// caching allocator on the device's current stream, held until `keep` is dropped (the block is
// handed out again only in stream order, or from the graph's pool under capture).
int device_sm_count(int device);
int device_major(int device);
struct Workspace {
  void* ptr = nullptr;
  std::shared_ptr<void> keep;
};
Workspace cutlass_workspace(size_t bytes, int device);

}  // namespace flux
