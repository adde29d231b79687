// Fused AllGather+GEMM kernels: a persistent CUTLASS sm90 warp-specialized GEMM over the
// gathered rows whose tiles wait for their shard's arrival (ag_tile_scheduler.hpp).
//
//   out[M, N] = a_full[M, K] @ weight[N, K]^T (+ bias[N]),   M = world * rows_per_rank
//
// a_full is this rank's symmetric workspace: its own rows are in place before the launch
// (stream order), the peers' rows are pushed by the copy engine while the kernel runs, each
// shard announced by flags[src] = 1 (flux/ops/ag_gemm.py, strategy "fused"). Tiles of this
// rank's rows run first, so the transfers hide behind them.
//
// A few configurations (ag_gemm_fused_cfg*.cu, one translation unit each so that they
// compile in parallel), all bf16, A row-major, weight [N, K] (nn.Linear), fp32 accumulation,
// per-column bias in the epilogue; the autotuner chooses among them.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"

namespace flux {

// Everything a launch needs, checked once by the dispatcher (ag_gemm_fused.cu).
struct AgFusedArgs {
  void* out;
  const void* a_full;
  const void* weight;
  const void* bias;  // or nullptr
  const uint32_t* flags;
  uint32_t* error_record;
  int m, n, k, rank, world, rows_per_rank;
  int raster, swizzle;
  uint64_t timeout_ns;
  int device;
  cudaStream_t stream;
  at::TensorOptions byte_options;  // for a CUTLASS workspace, if one is needed
};

// Launchers, one per configuration (defined in ag_gemm_fused_cfg<N>.cu).
void ag_gemm_fused_cfg0(const AgFusedArgs& a);  // 128x256x64 tile, cluster 2x1, cooperative
void ag_gemm_fused_cfg1(const AgFusedArgs& a);  // 256x128x64 tile, cluster 2x1, cooperative
void ag_gemm_fused_cfg2(const AgFusedArgs& a);  // 128x128x64 tile, cluster 2x1, ping-pong
constexpr int kAgFusedConfigs = 3;

}  // namespace flux

#if defined(FLUX_WITH_SM90) && defined(FLUX_AG_FUSED_IMPL)

#include "ag_gemm/ag_tile_scheduler.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace flux {

template <class TileShape_, class ClusterShape_, class KernelSchedule, class EpilogueSchedule>
struct AgGemmBf16 {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;     // a_full [M, K]
  using LayoutB = cutlass::layout::ColumnMajor;  // weight [N, K]: K contiguous
  using LayoutD = cutlass::layout::RowMajor;     // out [M, N]
  static constexpr int kAlign = 8;               // 16 bytes of bf16
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  static constexpr int kTileM = cute::size<0>(TileShape{});

  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, ElementD, ElementD, float>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD, kAlign, ElementD, LayoutD,
      kAlign, EpilogueSchedule, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB, LayoutB, kAlign,
      ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, AgSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class G>
void launch_ag_fused(const AgFusedArgs& a) {
  constexpr const char* op = "ag_gemm_fused_";
  using StrideA = typename G::Gemm::GemmKernel::StrideA;
  using StrideB = typename G::Gemm::GemmKernel::StrideB;
  using StrideD = typename G::Gemm::GemmKernel::StrideD;
  StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(a.m, a.k, 1));
  StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, cute::make_shape(a.n, a.k, 1));
  StrideD sd = cutlass::make_cute_packed_stride(StrideD{}, cute::make_shape(a.m, a.n, 1));

  cutlass::KernelHardwareInfo hw;
  hw.device_id = a.device;
  hw.sm_count = at::cuda::getDeviceProperties(a.device)->multiProcessorCount;

  typename G::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {a.m, a.n, a.k, 1},
      {reinterpret_cast<const typename G::ElementA*>(a.a_full), sa,
       reinterpret_cast<const typename G::ElementB*>(a.weight), sb},
      {{}, nullptr, sd, reinterpret_cast<typename G::ElementD*>(a.out), sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.bias_ptr = reinterpret_cast<const typename G::ElementD*>(a.bias);
  // raster: 0 CUTLASS's heuristic, 1 along N, 2 along M; swizzle: the largest band of tiles.
  // Along N inside bands of `swizzle` M tiles, the rotated M order (local rows first) is the
  // order in which tile rows are first touched.
  using Raster = AgTileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = a.raster == 0 ? Raster::Heuristic : a.raster == 2 ? Raster::AlongM : Raster::AlongN;
  args.scheduler.max_swizzle_size = a.swizzle;
  args.scheduler.flags = a.flags;
  args.scheduler.rank = a.rank;
  args.scheduler.world = a.world;
  args.scheduler.rows_per_rank = a.rows_per_rank;
  args.scheduler.tile_m = G::kTileM;
  args.scheduler.timeout_ns = a.timeout_ns;
  args.scheduler.error = a.error_record;

  typename G::Gemm gemm;
  FLUX_CHECK(gemm.can_implement(args) == cutlass::Status::kSuccess, op, "CUTLASS cannot run this problem (M=", a.m,
             " N=", a.n, " K=", a.k, ")");
  const size_t ws_bytes = G::Gemm::get_workspace_size(args);
  at::Tensor ws;
  if (ws_bytes > 0) ws = at::empty({(int64_t)ws_bytes}, a.byte_options);
  FLUX_CHECK(gemm.initialize(args, ws_bytes ? ws.data_ptr() : nullptr, a.stream) == cutlass::Status::kSuccess, op,
             "CUTLASS initialize failed");
  FLUX_CHECK(gemm.run(a.stream) == cutlass::Status::kSuccess, op, "CUTLASS launch failed");
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux

#endif  // FLUX_WITH_SM90 && FLUX_AG_FUSED_IMPL
