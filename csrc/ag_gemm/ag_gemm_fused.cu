// Fused AllGather+GEMM: one persistent CUTLASS sm90 warp-specialized GEMM over the gathered
// rows, whose tiles wait for their shard's arrival (csrc/ag_gemm/ag_tile_scheduler.hpp).
//
//   out[M, N] = a_full[M, K] @ weight[N, K]^T (+ bias[N]),   M = world * rows_per_rank
//
// a_full is this rank's symmetric workspace: its own rows are in place before the launch
// (stream order), the peers' rows are pushed by the copy engine while the kernel runs, each
// shard announced by flags[src] = 1 (flux/ops/ag_gemm.py, strategy "fused"). Tiles of this
// rank's rows run first, so the transfers hide behind them.
//
// One configuration, the one that matched cuBLAS on the public shapes on H200: bf16,
// A row-major, weight [N, K] (nn.Linear), fp32 accumulation, tile 128x256x64, cluster 2x1,
// cooperative TMA warp-specialized mainloop and epilogue, per-column bias in the epilogue.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"

#if defined(FLUX_WITH_SM90)

#include "ag_gemm/ag_tile_scheduler.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace flux {
namespace {

using namespace cute;

struct AgGemmBf16 {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // a_full [M, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // weight [N, K]: K contiguous
  using LayoutD = cutlass::layout::RowMajor;     // out [M, N]
  static constexpr int kAlign = 8;               // 16 bytes of bf16
  using TileShape = Shape<_128, _256, _64>;
  using ClusterShape = Shape<_2, _1, _1>;
  static constexpr int kTileM = 128;

  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, ElementD, ElementD, float>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlign, ElementD, LayoutD,
      kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB, LayoutB, kAlign,
      ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, AgSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

int sm_count(int device) {
  static int counts[64] = {0};
  if (device < 64 && counts[device] == 0)
    counts[device] = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  return device < 64 ? counts[device] : cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
}

}  // namespace

bool ag_gemm_fused_supported() { return true; }

void ag_gemm_fused_(at::Tensor& out, const at::Tensor& a_full, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, const at::Tensor& flags, int64_t rank, int64_t world,
                    int64_t rows_per_rank, int64_t timeout_ms, int64_t error_record, int64_t raster,
                    int64_t swizzle) {
  constexpr const char* op = "ag_gemm_fused_";
  using G = AgGemmBf16;
  FLUX_CHECK(a_full.is_cuda() && weight.is_cuda() && out.is_cuda() && flags.is_cuda(), op, "CUDA tensors expected");
  FLUX_CHECK(a_full.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
                 out.scalar_type() == at::kBFloat16,
             op, "bf16 only (got ", a_full.scalar_type(), ", ", weight.scalar_type(), ", ", out.scalar_type(), ")");
  FLUX_CHECK(a_full.dim() == 2 && weight.dim() == 2 && out.dim() == 2, op, "2-D a_full, weight and out expected");
  FLUX_CHECK(a_full.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), op, "contiguous tensors expected");
  const int64_t M = a_full.size(0), K = a_full.size(1), N = weight.size(0);
  FLUX_CHECK(weight.size(1) == K && out.size(0) == M && out.size(1) == N, op, "shape mismatch: a_full ",
             a_full.sizes(), ", weight ", weight.sizes(), ", out ", out.sizes());
  FLUX_CHECK(K % G::kAlign == 0 && N % G::kAlign == 0, op, "K and N must be multiples of ", G::kAlign);
  FLUX_CHECK(world >= 1 && rank >= 0 && rank < world && rows_per_rank * world == M, op, "bad rank/world/rows");
  FLUX_CHECK(flags.numel() >= world && flags.element_size() == 4, op, "flags must hold world 4-byte slots");
  if (bias.has_value()) {
    FLUX_CHECK(bias->is_cuda() && bias->scalar_type() == at::kBFloat16 && bias->numel() == N &&
                   bias->is_contiguous(),
               op, "bias must be a contiguous bf16 CUDA tensor of N elements");
  }
  const c10::cuda::CUDAGuard guard(a_full.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  using StrideA = typename G::Gemm::GemmKernel::StrideA;
  using StrideB = typename G::Gemm::GemmKernel::StrideB;
  using StrideD = typename G::Gemm::GemmKernel::StrideD;
  const int m = (int)M, n = (int)N, k = (int)K;
  StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1));
  StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
  StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1));

  cutlass::KernelHardwareInfo hw;
  hw.device_id = a_full.get_device();
  hw.sm_count = sm_count(hw.device_id);

  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {reinterpret_cast<const G::ElementA*>(a_full.data_ptr()), sa,
       reinterpret_cast<const G::ElementB*>(weight.data_ptr()), sb},
      {{}, nullptr, sd, reinterpret_cast<G::ElementD*>(out.data_ptr()), sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.bias_ptr =
      bias.has_value() ? reinterpret_cast<const G::ElementD*>(bias->data_ptr()) : nullptr;
  // N fastest inside bands of `swizzle` M tiles: the rotated M order (local rows first) is
  // then the order in which tile rows are first touched.
  // raster: 0 CUTLASS's heuristic, 1 along N (default), 2 along M; swizzle: max swizzle size.
  using Raster = AgTileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = raster == 0 ? Raster::Heuristic : raster == 2 ? Raster::AlongM : Raster::AlongN;
  args.scheduler.max_swizzle_size = (int)swizzle;
  args.scheduler.flags = reinterpret_cast<const uint32_t*>(flags.data_ptr());
  args.scheduler.rank = (int)rank;
  args.scheduler.world = (int)world;
  args.scheduler.rows_per_rank = (int)rows_per_rank;
  args.scheduler.tile_m = G::kTileM;
  args.scheduler.timeout_ns = (uint64_t)timeout_ms * 1000000ull;
  args.scheduler.error = reinterpret_cast<uint32_t*>(error_record);

  typename G::Gemm gemm;
  FLUX_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, op, "CUTLASS cannot run this problem (M=", M,
             " N=", N, " K=", K, ")");
  const size_t ws_bytes = G::Gemm::get_workspace_size(args);
  at::Tensor ws;
  if (ws_bytes > 0) ws = at::empty({(int64_t)ws_bytes}, a_full.options().dtype(at::kByte));
  FLUX_CHECK(gemm.initialize(args, ws_bytes ? ws.data_ptr() : nullptr, stream) == cutlass::Status::kSuccess, op,
             "CUTLASS initialize failed");
  FLUX_CHECK(gemm.run(stream) == cutlass::Status::kSuccess, op, "CUTLASS launch failed");
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux

#else  // built without an sm90a target

namespace flux {
bool ag_gemm_fused_supported() { return false; }
void ag_gemm_fused_(at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                    const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "flux.ag_gemm_fused_: flux._C was built without an sm_90a target (FLUX_CUDA_ARCH)");
}
}  // namespace flux

#endif
