// Fused GEMM+ReduceScatter, the own block's GEMM with the peer's partial folded into its
// epilogue: a persistent CUTLASS sm90 warp-specialized GEMM
//
//   out[rows, N] = a[rows, K] @ weight[N, K]^T + source[rows, N] (+ bias[N])
//
// where `source` is this rank's symmetric workspace slot into which the peer pushes its
// partial of these rows (its GEMM of them), segment by segment, each segment announced by
// flags[s] = 1 (flux/ops/gemm_rs.py, strategy "fused"). The wait is in the epilogue's
// producer load warp, right before it loads a tile's rows of `source` (SegmentWaitEpilogue
// below), not in the tile scheduler: a CTA computes its first tile's mainloop before its
// epilogue needs those rows, so the first segments' transfer hides behind the first wave's
// mainloops (a missing segment does stall the CTA at that tile's epilogue, since the consumer
// warps finish tile t before tile t+1's mainloop). The decomposed strategy's separate
// reduction pass disappears.
//
// Configurations x dtype variants: the table flux/fused_configs.py, from which setup.py
// generates one translation unit per instantiation and the dispatch (rs_fused_dispatch).
// A row-major, weight [N, K] (nn.Linear), bf16 or fp16, fp32 accumulation, D = acc + C + bias
// rounded once to the output dtype (the inputs' or fp32), in which C (the peer's partial) and
// the bias are too.
#pragma once

#include "common/check.h"
#include "common/fused_gemm.cuh"

namespace flux {

// Everything a launch needs, checked once by the dispatcher (rs_fused.cpp): out = a @ weight^T
// + source + bias; flags[s]: rows [s * rows_per_segment, ...) of `source` are in place.
struct RsFusedArgs : FusedGemmLaunch {
  const void* source = nullptr;  // [m, n], the peer's partial of these rows
  int rows_per_segment = 1, rank = 0, peer = 0;
};

// Launches the instantiation (config, dtype variant) where it was built (false otherwise); the
// generated dispatch (setup.py, from flux/fused_configs.py).
bool rs_fused_dispatch(int config, int dtype, const RsFusedArgs& a);

}  // namespace flux

#if defined(FLUX_WITH_SM90) && defined(FLUX_RS_FUSED_IMPL)

#include "common/flag_wait.cuh"
#include "common/stream_k_scheduler.hpp"

namespace flux {

// Where a tile's source rows come from and how long to wait for them.
struct SegmentWait {
  const uint32_t* flags = nullptr;  // [segments]: segment s of the source rows is in place
  int rows = 0;                     // rows of the source (and of the output)
  int rows_per_segment = 1;
  int rank = 0;                     // this rank (recorded on timeout)
  int peer = 0;                     // the rank that pushes the source (recorded on timeout)
  uint64_t timeout_ns = 0;
  uint32_t* error = nullptr;        // host-mapped [2]: (waiting rank + 1, missing rank)
};

// CUTLASS's sm90 TMA warp-specialized epilogue whose producer load warp, before it loads
// a tile's rows of the source C, waits (bounded) for the flags of the segments holding them.
// The GEMM kernel names this type as its CollectiveEpilogue, so its calls of load() and
// to_underlying_arguments() resolve here; everything else is the base's.
// Under the stream-K scheduler (several CTAs share a tile's K loop), the cooperative kernel
// (CUTLASS sm90_gemm_tma_warpspecialized_cooperative.hpp) calls load() only where
// compute_epilogue() holds: for the unit that holds the tile's last K tiles (or, with separate
// reduction, the reduction unit of one epilogue subtile, which loads only that subtile's C), so
// the wait and the source read happen once per tile (subtile), in the CTA that stores it. Its
// consumers first fold the other units' partial accumulators into their own (fixup(), through
// the workspace) and then run store(), which adds beta * C once to the reduced sum; the other
// units only write partials to the workspace and never read C.
template <class Base>
class SegmentWaitEpilogue : public Base {
 public:
  struct Arguments : Base::Arguments, SegmentWait {};
  struct Params : Base::Params, SegmentWait {};

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shape, static_cast<typename Base::Arguments const&>(args), workspace);
    static_cast<SegmentWait&>(p) = static_cast<SegmentWait const&>(args);
    return p;
  }

  CUTLASS_HOST_DEVICE
  SegmentWaitEpilogue(Params const& params, typename Base::TensorStorage& shared)
      : Base(params, shared), wait_(static_cast<SegmentWait const&>(params)) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma>
  CUTLASS_DEVICE auto load(typename Base::LoadPipeline load_pipeline,
                           typename Base::LoadPipelineState load_pipe_producer_state,
                           ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                           TileCoordMNKL tile_coord_mnkl, TiledMma tiled_mma, int thread_idx,
                           typename Base::TensorStorage& shared_tensors, int subtile_idx = -1) {
    // The source's rows: CUTLASS's M, or its N where D^T is stored column-major (swapped operands).
    constexpr bool kSwapped =
        cute::is_same_v<cute::remove_cvref_t<decltype(cute::get<0>(typename Base::StrideD{}))>, cute::Int<1>>;
    constexpr int kTileRows = cute::size<kSwapped ? 1 : 0>(typename Base::CtaTileMNK{});
    const int row0 = static_cast<int>(cute::get<kSwapped ? 1 : 0>(tile_coord_mnkl)) * kTileRows;
    if (row0 < wait_.rows) {  // a padding tile has no rows to wait for
      const int row1 = min(row0 + kTileRows, wait_.rows) - 1;
      for (int s = row0 / wait_.rows_per_segment; s <= row1 / wait_.rows_per_segment; ++s) {
        wait_flag_bounded(wait_.flags + s, wait_.timeout_ns, wait_.error, wait_.rank, wait_.peer);
      }
      fence_proxy_async_global();  // the source rows are then read by TMA
    }
    return Base::load(load_pipeline, load_pipe_producer_state, problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl,
                      tiled_mma, thread_idx, shared_tensors, subtile_idx);
  }

 private:
  SegmentWait wait_;
};

// StreamK (Sm90FusedGemm's StreamKMode): CUTLASS's stream-K scheduler (cooperative schedule only);
// the wait stays in load(), see SegmentWaitEpilogue.
// Swapped: out^T = weight @ a^T + source^T (Sm90FusedGemm), the source waited for by CUTLASS's N tiles.
template <int Dtype, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          int StreamK = 0, bool Swapped = false>
using RsFoldGemm =
    Sm90FusedGemm<typename FusedTypes<Dtype>::In, typename FusedTypes<Dtype>::Out, TileShape, ClusterShape,
                  KernelSchedule, EpilogueSchedule, true, SegmentWaitEpilogue,
                  std::conditional_t<StreamK != 0, StreamKSchedulerTag, cutlass::gemm::PersistentScheduler>, StreamK,
                  Swapped>;

// Split-K (common/split_k.cuh): a plain GEMM with fp32 output (InDtype kBf16 or kFp16) writes the
// slices' partials; the source is waited for and added by the reduction instead of the epilogue.
template <int InDtype, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          bool Swapped = false>
using RsSplitGemm = Sm90FusedGemm<typename FusedTypes<InDtype>::In, float, TileShape, ClusterShape, KernelSchedule,
                                  EpilogueSchedule, false, PlainEpilogue, cutlass::gemm::PersistentScheduler, 0,
                                  Swapped>;

template <class G>
void launch_rs_split(const RsFusedArgs& a, int splits, int dtype) {
  constexpr const char* op = "gemm_rs_fused_";
  const Workspace partials = split_k_partials(op, a, splits);
  typename G::Gemm::Arguments args = gemm_arguments<G>(a);
  set_split_k<G>(args, a.m, a.n, a.k, splits, static_cast<float*>(partials.ptr));
  run_cutlass_gemm<typename G::Gemm>(op, args, a.device, a.stream, a.m, a.n, a.k);
  const int segments = (a.m + a.rows_per_segment - 1) / a.rows_per_segment;
  split_k_finish(op, dtype, static_cast<const float*>(partials.ptr), a, splits, a.source, a.flags, segments, a.rank,
                 a.peer);
}

template <class G>
void launch_rs_fused(const RsFusedArgs& a) {
  constexpr const char* op = "gemm_rs_fused_";
  typename G::Gemm::Arguments args = gemm_arguments<G>(a);
  // D = acc + 1 * C + bias: C = the peer's partial of these rows, waited for segment by segment.
  args.epilogue.ptr_C = reinterpret_cast<const typename G::ElementC*>(a.source);
  args.epilogue.thread.beta = 1.0f;
  args.epilogue.flags = a.flags;
  args.epilogue.rows = a.m;
  args.epilogue.rows_per_segment = a.rows_per_segment;
  args.epilogue.rank = a.rank;
  args.epilogue.peer = a.peer;
  args.epilogue.timeout_ns = a.timeout_ns;
  args.epilogue.error = a.error_record;
  run_cutlass_gemm<typename G::Gemm>(op, args, a.device, a.stream, a.m, a.n, a.k);
}

}  // namespace flux

#endif  // FLUX_WITH_SM90 && FLUX_RS_FUSED_IMPL

