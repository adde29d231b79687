// The order in which a persistent scheduler's clusters take their work, as integer arithmetic with no
// CUDA or CUTLASS dependency: the device code (csrc/ag_gemm/ag_tile_scheduler.hpp) and a host test
// (tests/test_fused_configs.py, compiled with the system C++ compiler) run the same functions.
//
// CUTLASS's sm90 persistent scheduler numbers the work of clusters u = 0, 1, ... (cluster c of a launch
// of W clusters takes u = c, c + W, c + 2W, ...) and decodes u into a cluster position along the
// raster's minor dimension (swizzle bands of 2^log_swizzle) and its major dimension (blocks_major
// clusters): raster_decode below; raster_encode is its inverse.
//
// interleave_work: within each wave [base, base + n) of n = min(W, units - base) indices, index
// base + c becomes base + (its place in the transpose of the wave into g rows): row c mod g, column
// c / g, rows 0..n mod g - 1 one longer than the rest. Clusters g apart in launch order then take
// consecutive work. A bijection on [0, units) for any W, g >= 1; forward = false is its inverse.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLUX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FLUX_HOST_DEVICE inline
#endif

namespace flux {

struct RasterPos {
  uint64_t minor, major;
};

FLUX_HOST_DEVICE RasterPos raster_decode(uint64_t u, int log_swizzle, uint64_t blocks_major) {
  const uint64_t band = uint64_t(1) << log_swizzle;
  const uint64_t extra = u >> log_swizzle;
  return {(extra / blocks_major) * band + (u & (band - 1)), extra % blocks_major};
}

FLUX_HOST_DEVICE uint64_t raster_encode(RasterPos p, int log_swizzle, uint64_t blocks_major) {
  const uint64_t band = uint64_t(1) << log_swizzle;
  return (((p.minor >> log_swizzle) * blocks_major + p.major) << log_swizzle) | (p.minor & (band - 1));
}

FLUX_HOST_DEVICE uint64_t interleave_work(uint64_t u, uint64_t units, uint64_t wave, uint64_t g, bool forward) {
  if (g <= 1 || wave == 0 || u >= units) return u;
  const uint64_t base = u / wave * wave;
  const uint64_t n = units - base < wave ? units - base : wave;
  if (g > n) g = n;
  const uint64_t q = n / g, rem = n % g, c = u - base;
  if (forward) {
    const uint64_t row = c % g;
    return base + row * q + (row < rem ? row : rem) + c / g;
  }
  const uint64_t head = rem * (q + 1);
  const uint64_t row = c < head ? c / (q + 1) : rem + (c - head) / q;
  const uint64_t col = c < head ? c % (q + 1) : (c - head) % q;
  return base + col * g + row;
}

}  // namespace flux
