// Tile scheduler of the fused AllGather+GEMM kernel (csrc/ag_gemm/ag_gemm_fused.cuh): CUTLASS's
// persistent sm90 scheduler, with two changes to the tiles it hands out.
//  1. Order. Tile m is served as (m + offset) mod tiles_m, offset = the first tile of this rank's
//     block rounded down to a whole band of cluster_m * swizzle tiles (clusters and swizzle bands
//     stay aligned): the first waves read only local rows while the peers' shards arrive.
//  2. Readiness. Before a tile is returned, every warp that asks for it waits until flags[src] != 0
//     (ld.acquire.sys) for every remote rank whose rows the tile covers. The flag is a stream write
//     after the copy-engine push of that shard (csrc/ag_gemm/ag_gemm_plan.cpp), whose fence makes
//     the shard visible to the TMA loads issued after the wait. The wait is bounded: past
//     timeout_ns the kernel records the missing rank in host-mapped memory and traps
//     (common/flag_wait.cuh). Under programmatic dependent launch the first flag read waits for
//     the preceding grids first (wait_flag).
// The kernels call initial_work_tile_info, both fetch_next_work overloads and (ping-pong)
// get_current_work on this type, so all of them are overridden; everything else is CUTLASS's.
#pragma once

#include "common/flag_wait.cuh"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace flux {

struct AgSchedulerTag {};

class AgTileScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using BaseParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
  using BaseArguments = Base::Arguments;

 public:
  struct Arguments : BaseArguments {
    const uint32_t* flags = nullptr;  // [world]: this rank's "shard of rank src is here" flags
    int rank = 0;
    int world = 1;
    int rows_per_rank = 1;  // M of one shard
    int tile_m = 128;       // rows of one tile (the kernel's tile shape)
    uint64_t timeout_ns = 0;
    uint32_t* error = nullptr;  // host-mapped [2]: (waiting rank + 1, missing rank) on timeout
  };

  struct Params : BaseParams {
    const uint32_t* flags = nullptr;
    int rank = 0, world = 1, rows_per_rank = 1, tile_m = 128, rows_total = 0;
    int tiles_m = 1;      // tile rows, padded to whole bands of the raster (cluster_m << log_swizzle)
    int offset_tiles = 0;
    uint64_t timeout_ns = 0;
    uint32_t* error = nullptr;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    BaseParams& base_params = p;
    BaseArguments const& base_args = args;
    base_params = Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info, base_args,
                                                workspace, epilogue_subtile, ktile_start_alignment_count);
    const int cluster_m = cute::size<0>(cluster_shape);
    const int rows_total = static_cast<int>(cute::get<0>(problem_shape_mnkl));
    const int tiles = (rows_total + args.tile_m - 1) / args.tile_m;
    // Along N, the base scheduler serves M tiles in bands of (cluster_m << log_swizzle) and pads
    // its M extent to whole bands: rotate over that same extent (a bijection on the indices it
    // hands out; padding tiles are recognised by their rows below) and by whole bands, so that
    // bands stay intact. (Rounding the offset to two bands, as before, left it at 0 on rank 1
    // whenever a rank's rows were one band: that rank then started on its peer's rows.)
    const int band = cluster_m << p.log_swizzle_size_;
    p.tiles_m = (tiles + band - 1) / band * band;
    int first = args.rank * args.rows_per_rank / args.tile_m;
    first = first / band * band;
    p.offset_tiles = first % p.tiles_m;
    p.flags = args.flags;
    p.rank = args.rank;
    p.world = args.world;
    p.rows_per_rank = args.rows_per_rank;
    p.tile_m = args.tile_m;
    p.rows_total = rows_total;
    p.timeout_ns = args.timeout_ns;
    p.error = args.error;
    return p;
  }

  CUTLASS_HOST_DEVICE AgTileScheduler() {}
  CUTLASS_DEVICE explicit AgTileScheduler(Params const& params) : Base(params), ag_(params) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape cluster_shape) {
    return rotate_and_wait(Base::initial_work_tile_info(cluster_shape));
  }

  // The ping-pong kernel moves on with advance_to_next_work(); get_current_work(): that path
  // must rotate and wait too. (The base's own fetch_next_work / initial_work_tile_info call
  // the base's get_current_work, not this one, so nothing is rotated twice.)
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return rotate_and_wait(Base::get_current_work()); }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info) {
    // The static scheduler never continues a tile (no split-K), so the base only advances.
    auto [next, increment] = Base::fetch_next_work(unrotate(work_tile_info));
    return cute::make_tuple(rotate_and_wait(next), increment);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  Params ag_;

  CUTLASS_DEVICE WorkTileInfo unrotate(WorkTileInfo w) const {
    if (w.is_valid()) w.M_idx = (w.M_idx - ag_.offset_tiles + ag_.tiles_m) % ag_.tiles_m;
    return w;
  }

  CUTLASS_DEVICE WorkTileInfo rotate_and_wait(WorkTileInfo w) const {
    if (!w.is_valid()) return w;
    w.M_idx = (w.M_idx + ag_.offset_tiles) % ag_.tiles_m;
    const int row0 = w.M_idx * ag_.tile_m;
    if (row0 >= ag_.rows_total) return w;  // padding tile: no rows, nothing to wait for
    const int row1 = min(row0 + ag_.tile_m, ag_.rows_total) - 1;
    bool waited = false;
    for (int src = row0 / ag_.rows_per_rank; src <= row1 / ag_.rows_per_rank && src < ag_.world; ++src) {
      if (src != ag_.rank) {
        wait_flag(src);
        waited = true;
      }
    }
    // The rows are then read by TMA (the async proxy): order the acquire above before it.
    if (waited) fence_proxy_async_global();
    return w;
  }

  CUTLASS_DEVICE void wait_flag(int src) const {
    // The kernels ask for their first tile before their own griddepcontrol.wait (and the
    // cooperative kernel's consumer warps never execute one): under programmatic dependent
    // launch a flag read here could see the value of a previous call before the kernels ahead
    // of this one in the stream have finished. Waiting for them first is idempotent, and a
    // no-op without PDL.
    cutlass::arch::wait_on_dependent_grids();
    wait_flag_bounded(ag_.flags + src, ag_.timeout_ns, ag_.error, ag_.rank, src);
  }
};

}  // namespace flux

// Route flux::AgSchedulerTag to the scheduler above in CUTLASS's kernel-level selector.
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<flux::AgSchedulerTag, ArchTag, TileShape, ClusterShape, SchedulerPipelineStageCount> {
  using Scheduler = flux::AgTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
