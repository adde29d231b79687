// Launch-configuration checks for the MoE kernels. A launch asking more of an SM than it has
// (threads x registers over the register file, shared memory over the 48 KB a block gets without
// an opt-in, a grid dimension of 0 or over 2^31 - 1) fails with cudaErrorLaunchOutOfResources or
// an invalid-configuration error that names no op; these checks run before such a launch and
// raise naming the op and the kernel. Every kernel in csrc/moe/ carries __launch_bounds__(its
// largest block), so ptxas keeps its registers within what that block may use.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "common/check.h"

namespace flux {
namespace moe_launch {

// Dynamic shared memory a block may use without cudaFuncSetAttribute.
constexpr size_t kDefaultSmemPerBlock = 48 * 1024;
constexpr int64_t kMaxGridX = 2147483647;

// The kernel's compiled attributes (registers, static shared memory, the largest block its
// registers allow) on the current device, queried once per (device, kernel).
inline cudaFuncAttributes attributes(const void* fn) {
  static std::mutex mu;
  static std::unordered_map<const void*, cudaFuncAttributes> cache[64];
  int dev = 0;
  FLUX_CUDA(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto& per_dev = cache[dev & 63];
  auto it = per_dev.find(fn);
  if (it == per_dev.end()) {
    cudaFuncAttributes attr{};
    FLUX_CUDA(cudaFuncGetAttributes(&attr, fn));
    it = per_dev.emplace(fn, attr).first;
  }
  return it->second;
}

// Raises (naming op and kernel) unless <<<grid, threads, dyn_smem>>> is a valid launch of fn.
template <typename... Args>
void check(const char* op, const char* kernel, void (*fn)(Args...), int64_t grid, int64_t threads,
           size_t dyn_smem) {
  const cudaFuncAttributes attr = attributes(reinterpret_cast<const void*>(fn));
  const size_t smem_cap =
      std::min<size_t>(kDefaultSmemPerBlock, at::cuda::getCurrentDeviceProperties()->sharedMemPerBlock);
  FLUX_CHECK(grid >= 1 && grid <= kMaxGridX, op, "internal launch error: ", kernel, " grid ", grid,
             " outside [1, 2^31 - 1]");
  FLUX_CHECK(threads >= 1 && threads <= attr.maxThreadsPerBlock, op, "internal launch error: ", kernel, " with ",
             threads, " threads per block, but its ", attr.numRegs, " registers per thread allow at most ",
             attr.maxThreadsPerBlock);
  FLUX_CHECK(attr.sharedSizeBytes + dyn_smem <= smem_cap, op, "internal launch error: ", kernel, " needs ",
             attr.sharedSizeBytes, " + ", dyn_smem, " bytes of shared memory per block, over ", smem_cap);
}

// Calls launch(V{}) with the widest of int4, int32_t and char that divides the row size and
// every address in addrs (the row kernels move V-sized pieces of each row).
template <typename F>
void by_vector(int64_t row_bytes, std::initializer_list<uintptr_t> addrs, F&& launch) {
  auto ok = [&](uintptr_t a) {
    if (row_bytes % a != 0) return false;
    for (auto x : addrs) {
      if (x % a != 0) return false;
    }
    return true;
  };
  if (ok(16)) {
    launch(int4{});
  } else if (ok(4)) {
    launch(int32_t{});
  } else {
    launch(char{});
  }
}

}  // namespace moe_launch
}  // namespace flux
