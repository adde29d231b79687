// Fused GEMM+ReduceScatter own-block kernel, configuration 1: 256x128x64 tile, cluster 2x1, cooperative.
#define FLUX_RS_FUSED_IMPL
#include "gemm_rs/rs_fused.cuh"

FLUX_RS_FUSED_CONFIG(1, 256, 128, 2, 1)
