// Fused GEMM+ReduceScatter own-block kernel, configuration 0: 128x256x64 tile, cluster 2x1, cooperative.
#define FLUX_RS_FUSED_IMPL
#include "gemm_rs/rs_fused.cuh"

FLUX_RS_FUSED_CONFIG(0, 128, 256, 2, 1)
