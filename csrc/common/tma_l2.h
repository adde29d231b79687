// The L2 fetch size ("L2 promotion") of the TMA descriptors that CUTLASS builds for the GEMMs of
// flux._C (the fused GEMMs and the grouped GEMMs): on an L2 miss, how many bytes around the
// requested sectors the L2 fetches from memory (none, 64, 128 or 256 bytes). CUTLASS fixes 128;
// here it is a process-wide setting (torch.ops.flux.set_tma_l2_promotion, default 128), read each
// time a descriptor is made, i.e. at every launch (descriptors live in the kernel's parameters).
//
// How: CUTLASS's make_tma_copy_desc (cute/atom/copy_traits_sm90_tma.hpp) encodes a descriptor
// with cutlass::call_cuTensorMapEncodeTiled(...), a variadic template that forwards to the driver.
// The non-template overload below, declared before CUTLASS's headers with that call's exact
// argument types, is preferred over the template; it replaces only the promotion argument. Every
// translation unit that includes CUTLASS's headers includes this one first (common/cutlass_run.cuh),
// so no unit keeps CUTLASS's own copy of a make_tma_copy_desc instantiation.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flux {

int tma_l2_promotion();                    // bytes: 0, 64, 128 or 256 (ag_gemm/ag_gemm_fused.cpp)
void set_tma_l2_promotion(int64_t bytes);  // raises, naming the op, on another value
int64_t get_tma_l2_promotion();            // torch.ops.flux.tma_l2_promotion

inline CUtensorMapL2promotion tma_l2_promotion_enum(int bytes) {
  switch (bytes) {
    case 0: return CU_TENSOR_MAP_L2_PROMOTION_NONE;
    case 64: return CU_TENSOR_MAP_L2_PROMOTION_L2_64B;
    case 256: return CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
    default: return CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  }
}

}  // namespace flux

namespace cutlass {

using FluxEncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                       const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                       CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled (the runtime's entry-point query, as CUTLASS does: no -lcuda).
inline FluxEncodeTiledFn flux_encode_tiled_fn() {
  static const FluxEncodeTiledFn fn = [] {
    void* pfn = nullptr;
    cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pfn, 12000, cudaEnableDefault,
                                                       &status);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &pfn, cudaEnableDefault, &status);
#endif
    return (err == cudaSuccess && status == cudaDriverEntryPointSuccess) ? reinterpret_cast<FluxEncodeTiledFn>(pfn)
                                                                          : nullptr;
  }();
  return fn;
}

// The argument types of CUTLASS's call: &TmaDescriptor, the data type, `constexpr int tma_dim`,
// void*, cute::array<uint64_t, 5>::data() twice, cute::array<uint32_t, 5>::data() twice, enums.
inline CUresult call_cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, int rank, void* address,
                                            uint64_t* dims, uint64_t* strides, uint32_t* box, uint32_t* elem_strides,
                                            CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                            CUtensorMapL2promotion /*CUTLASS's 128 B*/, CUtensorMapFloatOOBfill fill) {
  const FluxEncodeTiledFn fn = flux_encode_tiled_fn();
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  return fn(map, type, static_cast<cuuint32_t>(rank), address, dims, strides, box, elem_strides, interleave, swizzle,
            flux::tma_l2_promotion_enum(flux::tma_l2_promotion()), fill);
}

}  // namespace cutlass
