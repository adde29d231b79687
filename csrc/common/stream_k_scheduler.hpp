// CUTLASS's sm90 stream-K tile scheduler as the fused GEMMs use it: directly in the GEMM+RS
// kernel (csrc/gemm_rs/rs_fused.cuh, tag StreamKSchedulerTag) and as the base of the AG kernel's
// waiting scheduler (csrc/ag_gemm/ag_tile_scheduler.hpp).
//
// Stream-K (cooperative kernel only) splits the K loops of the tiles of a problem with fewer
// tiles than CTAs among several CTAs; each CTA but a tile's last writes its fp32 partial
// accumulators to the workspace, the last one reduces them (fixup) and runs the tile's one
// epilogue. CUTLASS's heuristic chooses data-parallel (whole tiles, no workspace), split-K or
// stream-K from the tile count, the K depth and the SM count.
#pragma once

#include "cutlass/gemm/kernel/sm90_tile_scheduler_stream_k.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace flux {

struct StreamKSchedulerTag {};

template <class TileShape, class ClusterShape>
class StreamKTileScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape>;

 public:
  using Base::Base;
  using WorkTileInfo = typename Base::WorkTileInfo;

  // The cooperative kernel (with CUTLASS_ENABLE_GDC_FOR_SM90) asks whether a consumer's work is
  // its last, to let the next grid in the stream launch early; CUTLASS's own answer does not
  // compile in that kernel (a const method binding a member to a non-const reference). The answer
  // only times that hint: the dependent grid's griddepcontrol.wait still waits for this whole
  // grid, and "not yet" leaves the trigger to the grid's end, where it is implicit.
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo, uint32_t = 1) const { return false; }
};

}  // namespace flux

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<flux::StreamKSchedulerTag, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = flux::StreamKTileScheduler<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail
