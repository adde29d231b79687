// What the CUDA probes (bench/probe_*.cu) share. CHECK: a runtime call's check: on error, the probe's name, the call
// and CUDA's message on stderr, exit 2. Each probe defines PROBE_NAME before including this.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s: %s: %s\n", PROBE_NAME, #x, cudaGetErrorString(e_));    \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

// Whether argv[i] is `flag` with a value after it; if so the value is parsed into *out and i moves past it.
inline bool int_flag(int argc, char** argv, int& i, const char* flag, int* out) {
  if (std::strcmp(argv[i], flag) != 0 || i + 1 >= argc) return false;
  *out = std::atoi(argv[++i]);
  return true;
}
