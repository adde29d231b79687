// torch.ops.flux.gemm_rs_fused_: checks once, then launches one configuration of the fused
// GEMM+ReduceScatter own-block kernel (rs_fused.cuh, rs_fused_cfg*.cu).
#include "gemm_rs/rs_fused.cuh"

namespace flux {

void gemm_rs_fused_(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, const at::Tensor& source, const at::Tensor& flags,
                    int64_t rows_per_segment, int64_t rank, int64_t peer, int64_t timeout_ms, int64_t error_record,
                    int64_t raster, int64_t swizzle, int64_t config) {
  constexpr const char* op = "gemm_rs_fused_";
#if !defined(FLUX_WITH_SM90)
  FLUX_CHECK(false, op, "flux._C was built without an sm_90a target (FLUX_CUDA_ARCH)");
#endif
  FLUX_CHECK(config >= 0 && config < kRsFusedConfigs, op, "unknown configuration ", config, " (0..",
             kRsFusedConfigs - 1, ")");
  FLUX_CHECK(a.is_cuda() && weight.is_cuda() && out.is_cuda() && source.is_cuda() && flags.is_cuda(), op,
             "CUDA tensors expected");
  FLUX_CHECK(a.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                 out.scalar_type() == at::kBFloat16 && source.scalar_type() == at::kBFloat16,
             op, "bf16 only (got ", a.scalar_type(), ", ", weight.scalar_type(), ", ", out.scalar_type(), ", ",
             source.scalar_type(), ")");
  FLUX_CHECK(a.dim() == 2 && weight.dim() == 2 && out.dim() == 2 && source.dim() == 2, op,
             "2-D a, weight, source and out expected");
  FLUX_CHECK(a.is_contiguous() && weight.is_contiguous() && out.is_contiguous() && source.is_contiguous(), op,
             "contiguous tensors expected");
  const int64_t M = a.size(0), K = a.size(1), N = weight.size(0);
  FLUX_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N && source.size(0) == M &&
                 source.size(1) == N,
             op, "shape mismatch: a ", a.sizes(), ", weight ", weight.sizes(), ", source ", source.sizes(), ", out ",
             out.sizes());
  FLUX_CHECK(M >= 1 && K % 8 == 0 && N % 8 == 0, op, "M >= 1, K and N multiples of 8 expected");
  FLUX_CHECK(is_aligned(a.data_ptr(), 16) && is_aligned(weight.data_ptr(), 16) && is_aligned(out.data_ptr(), 16) &&
                 is_aligned(source.data_ptr(), 16),
             op, "16-byte aligned tensors expected (TMA)");
  FLUX_CHECK(rows_per_segment >= 1, op, "rows_per_segment must be positive");
  const int64_t segments = (M + rows_per_segment - 1) / rows_per_segment;
  FLUX_CHECK(flags.numel() >= segments && flags.element_size() == 4 && flags.is_contiguous(), op, "flags must hold ",
             segments, " 4-byte slots");
  FLUX_CHECK(swizzle >= 1 && raster >= 0 && raster <= 2, op, "bad raster ", raster, " / swizzle ", swizzle);
  if (bias.has_value()) {
    FLUX_CHECK(bias->is_cuda() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N &&
                   bias->is_contiguous() && is_aligned(bias->data_ptr(), 16),
               op, "bias must be a contiguous, 16-byte aligned bf16 CUDA tensor of N elements");
  }
  const c10::cuda::CUDAGuard guard(a.device());
  RsFusedArgs args;
  static_cast<FusedGemmLaunch&>(args) =
      fused_gemm_launch(out, a, weight, bias, flags, error_record, raster, swizzle, timeout_ms);
  args.source = source.data_ptr();
  args.rows_per_segment = (int)rows_per_segment;
  args.rank = (int)rank;
  args.peer = (int)peer;
  switch (config) {  // bounded dispatch: an unknown value failed above
    case 0: rs_fused_cfg0(args); break;
    case 1: rs_fused_cfg1(args); break;
    default: rs_fused_cfg2(args); break;
  }
}

}  // namespace flux
