// Fused AllGather+GEMM, configuration 3: 256x128x64 tile, cluster 1x2 (two CTAs of one M tile share
// its A rows by TMA multicast), cooperative: the shape of the kernel cuBLAS runs on these GEMMs on
// H200 (nvjet ..._256x128_64x4_1x2_..., bench/profile_ops.py).
#define FLUX_AG_FUSED_IMPL
#include "ag_gemm/ag_gemm_fused.cuh"

namespace flux {

void ag_gemm_fused_cfg3(const AgFusedArgs& a) {
#if defined(FLUX_WITH_SM90)
  launch_ag_fused<AgGemmBf16<cute::Shape<cute::_256, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative>>(a);
#else
  TORCH_CHECK(false, "flux.ag_gemm_fused_: flux._C was built without an sm_90a target (FLUX_CUDA_ARCH)");
#endif
}

}  // namespace flux
