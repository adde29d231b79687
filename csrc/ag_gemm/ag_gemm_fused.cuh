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
// Configurations (tile, cluster, schedule) x dtype variants (bf16 or fp16 inputs; output in the
// input dtype or fp32): the table flux/fused_configs.py, from which setup.py generates one
// translation unit per instantiation (they compile in parallel) and the dispatch
// (ag_fused_dispatch). A row-major, weight [N, K] (nn.Linear), fp32 accumulation, per-column
// bias in the epilogue; the autotuner chooses among them.
#pragma once

#include "common/check.h"
#include "common/fused_gemm.cuh"

namespace flux {

// Everything a launch needs, checked once by the dispatcher (ag_gemm_fused.cpp); `a` is a_full.
struct AgFusedArgs : FusedGemmLaunch {
  int rank = 0, world = 1, rows_per_rank = 1;  // flags[src]: rows [src * rows_per_rank, ...) are in place
  uint64_t* trace = nullptr;  // the diagnostic trace (fused_trace), or nullptr
  const int32_t* order = nullptr;  // the diagnostic tile permutation (fused_order), or nullptr
  int order_count = 0;
  const int32_t* deal_pos = nullptr;  // the diagnostic deal by GPC (fused_deal), or nullptr
  uint32_t* deal_state = nullptr;
  int deal_sms = 0;
};

// The diagnostic deal of the AG fused kernels' cluster tiles by GPC at run time, for their next launches
// (process-wide, default none; ag_tile_scheduler.hpp, AgWaitArguments::deal_pos): device addresses of
// the SMs' groups (sms + AgDealMaxGroups int32) and of the zeroed claims (AgDeal's layout,
// 2 * (1 + AgDealMaxGroups) int32, 8-byte aligned; flux.autotune.placement.deal_buffers makes both),
// or 0, 0, 0.
constexpr int AgDealMaxSms = 1024;
constexpr int AgDealMaxGroups = 64;
struct FusedDeal {
  int64_t pos = 0, state = 0, sms = 0;
};
FusedDeal fused_deal();
void set_fused_deal(int64_t pos, int64_t state, int64_t sms);

// The diagnostic trace buffer of the AG fused kernels' next launches (process-wide, default none):
// a device address of at least grid-size x 8 uint64 (ag_tile_scheduler.hpp, AgTrace), or 0.
int64_t fused_trace();
void set_fused_trace(int64_t address);

// The diagnostic permutation of the AG fused kernels' cluster tiles for their next launches (process-
// wide, default none): a device address of 2 x count int32 (ag_tile_scheduler.hpp,
// AgWaitArguments::order), used by the persistent scheduler where count is the launch's number of
// cluster tiles; 0 for none.
std::pair<int64_t, int64_t> fused_order();
void set_fused_order(int64_t address, int64_t count);

// Launches the instantiation (config, dtype variant) where it was built (false otherwise); the
// generated dispatch (setup.py, from flux/fused_configs.py).
bool ag_fused_dispatch(int config, int dtype, const AgFusedArgs& a);

}  // namespace flux

#if defined(FLUX_WITH_SM90) && defined(FLUX_AG_FUSED_IMPL)

#include "ag_gemm/ag_tile_scheduler.hpp"

namespace flux {

// StreamK (Sm90FusedGemm's StreamKMode): CUTLASS's stream-K scheduler with the same readiness wait
// (cooperative schedule only).
// Swapped: out^T = weight @ a_full^T (Sm90FusedGemm), the readiness wait and the order on CUTLASS's N tiles.
template <int Dtype, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          int StreamK = 0, bool Swapped = false>
using AgGemm = Sm90FusedGemm<typename FusedTypes<Dtype>::In, typename FusedTypes<Dtype>::Out, TileShape, ClusterShape,
                             KernelSchedule, EpilogueSchedule, false, PlainEpilogue,
                             std::conditional_t<StreamK != 0, AgStreamKSchedulerTag, AgSchedulerTag>, StreamK, Swapped>;

// The same GEMM with fp32 output, for split-K (common/split_k.cuh): InDtype kBf16 or kFp16.
template <int InDtype, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          bool Swapped = false>
using AgSplitGemm = AgGemm<InDtype == kBf16 ? kBf16Fp32 : kFp16Fp32, TileShape, ClusterShape, KernelSchedule,
                           EpilogueSchedule, 0, Swapped>;

template <class G>
void set_ag_wait(typename G::Gemm::Arguments& args, const AgFusedArgs& a) {
  // Along N inside bands of `swizzle` M tiles, the rotated M order (local rows first) is the
  // order in which tile rows are first touched (persistent scheduler; stream-K keeps CUTLASS's).
  args.scheduler.flags = a.flags;
  args.scheduler.rank = a.rank;
  args.scheduler.world = a.world;
  args.scheduler.rows_per_rank = a.rows_per_rank;
  args.scheduler.tile_m = G::kTileRows;
  args.scheduler.rows_on_n = G::kSwapped;
  args.scheduler.timeout_ns = a.timeout_ns;
  args.scheduler.error = a.error_record;
  args.scheduler.trace = a.trace;
  args.scheduler.order = a.order;
  args.scheduler.order_count = a.order_count;
  args.scheduler.deal_pos = a.deal_pos;  // read by the persistent scheduler only
  args.scheduler.deal_state = a.deal_state;
  args.scheduler.deal_sms = a.deal_sms;
}

template <class G>
void launch_ag_fused(const AgFusedArgs& a) {
  typename G::Gemm::Arguments args = gemm_arguments<G>(a);
  set_ag_wait<G>(args, a);
  run_cutlass_gemm<typename G::Gemm>("ag_gemm_fused_", args, a.device, a.stream, a.m, a.n, a.k);
}

// Split-K: every slice's tiles wait for their rows as above (a slice reads the same rows).
template <class G>
void launch_ag_split(const AgFusedArgs& a, int splits, int dtype) {
  constexpr const char* op = "ag_gemm_fused_";
  const Workspace partials = split_k_partials(op, a, splits);
  typename G::Gemm::Arguments args = gemm_arguments<G>(a);
  set_ag_wait<G>(args, a);
  set_split_k<G>(args, a.m, a.n, a.k, splits, static_cast<float*>(partials.ptr));
  run_cutlass_gemm<typename G::Gemm>(op, args, a.device, a.stream, a.m, a.n, a.k);
  split_k_finish(op, dtype, static_cast<const float*>(partials.ptr), a, splits);
}

}  // namespace flux

#endif  // FLUX_WITH_SM90 && FLUX_AG_FUSED_IMPL
