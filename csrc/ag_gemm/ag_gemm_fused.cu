// torch.ops.flux.ag_gemm_fused_: checks once, then launches one configuration of the fused
// AllGather+GEMM kernel (ag_gemm_fused.cuh, ag_gemm_fused_cfg*.cu).
#include "ag_gemm/ag_gemm_fused.cuh"

namespace flux {

bool ag_gemm_fused_supported() {
#if defined(FLUX_WITH_SM90)
  return true;
#else
  return false;
#endif
}

void ag_gemm_fused_(at::Tensor& out, const at::Tensor& a_full, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, const at::Tensor& flags, int64_t rank, int64_t world,
                    int64_t rows_per_rank, int64_t timeout_ms, int64_t error_record, int64_t raster,
                    int64_t swizzle, int64_t config) {
  constexpr const char* op = "ag_gemm_fused_";
  FLUX_CHECK(ag_gemm_fused_supported(), op, "flux._C was built without an sm_90a target (FLUX_CUDA_ARCH)");
  FLUX_CHECK(config >= 0 && config < kAgFusedConfigs, op, "unknown configuration ", config, " (0..",
             kAgFusedConfigs - 1, ")");
  FLUX_CHECK(a_full.is_cuda() && weight.is_cuda() && out.is_cuda() && flags.is_cuda(), op, "CUDA tensors expected");
  FLUX_CHECK(a_full.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                 out.scalar_type() == at::kBFloat16,
             op, "bf16 only (got ", a_full.scalar_type(), ", ", weight.scalar_type(), ", ", out.scalar_type(), ")");
  FLUX_CHECK(a_full.dim() == 2 && weight.dim() == 2 && out.dim() == 2, op, "2-D a_full, weight and out expected");
  FLUX_CHECK(a_full.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), op, "contiguous tensors expected");
  const int64_t M = a_full.size(0), K = a_full.size(1), N = weight.size(0);
  FLUX_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N, op, "shape mismatch: a_full ",
             a_full.sizes(), ", weight ", weight.sizes(), ", out ", out.sizes());
  FLUX_CHECK(K % 8 == 0 && N % 8 == 0, op, "K and N must be multiples of 8");
  FLUX_CHECK(world >= 1 && rank >= 0 && rank < world && rows_per_rank * world == M, op, "bad rank/world/rows");
  FLUX_CHECK(flags.numel() >= world && flags.element_size() == 4, op, "flags must hold world 4-byte slots");
  FLUX_CHECK(swizzle >= 1 && raster >= 0 && raster <= 2, op, "bad raster ", raster, " / swizzle ", swizzle);
  if (bias.has_value()) {
    FLUX_CHECK(bias->is_cuda() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N &&
                   bias->is_contiguous(),
               op, "bias must be a contiguous bf16 CUDA tensor of N elements");
  }
  const c10::cuda::CUDAGuard guard(a_full.device());
  AgFusedArgs a;
  static_cast<FusedGemmLaunch&>(a) =
      fused_gemm_launch(out, a_full, weight, bias, flags, error_record, raster, swizzle, timeout_ms);
  a.rank = (int)rank;
  a.world = (int)world;
  a.rows_per_rank = (int)rows_per_rank;
  switch (config) {  // bounded dispatch: an unknown value failed above
    case 0: ag_gemm_fused_cfg0(a); break;
    case 1: ag_gemm_fused_cfg1(a); break;
    case 2: ag_gemm_fused_cfg2(a); break;
    default: ag_gemm_fused_cfg3(a); break;
  }
}

}  // namespace flux
