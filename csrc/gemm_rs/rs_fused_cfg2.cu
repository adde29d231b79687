// Fused GEMM+ReduceScatter own-block kernel, configuration 2: 256x128x64 tile, cluster 1x2 (two CTAs
// of one M tile share its A rows by TMA multicast), cooperative: the shape of the kernel cuBLAS runs
// on these GEMMs on H200 (nvjet ..._256x128_64x4_1x2_..., bench/profile_ops.py).
#define FLUX_RS_FUSED_IMPL
#include "gemm_rs/rs_fused.cuh"

FLUX_RS_FUSED_CONFIG(2, 256, 128, 1, 2)
