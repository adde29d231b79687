// Tile schedulers of the fused AllGather+GEMM kernel (csrc/ag_gemm/ag_gemm_fused.cuh): CUTLASS's
// sm90 schedulers with changes to the work they hand out.
// AgTileScheduler (persistent, one CTA per tile and whole K):
//  1. Order. Tile m is served as (m + offset) mod tiles_m, offset = the first tile of this rank's
//     block rounded down to a whole band of cluster_m * swizzle tiles (clusters and swizzle bands
//     stay aligned): the first waves read only local rows while the peers' shards arrive. With
//     swapped operands (rows_on_n) the same on the N index, whose tiles cover A's rows.
//  2. Readiness. Before a tile is returned, the warps that load A wait until flags[src] != 0
//     (ld.acquire.sys) for every remote rank whose rows the tile covers. The flag is a stream write
//     after the copy-engine push of that shard (csrc/ag_gemm/ag_gemm_plan.cpp), whose fence makes
//     the shard visible to the TMA loads issued after the wait. The wait is bounded: past
//     timeout_ns the kernel records the missing rank in host-mapped memory and traps
//     (common/flag_wait.cuh). Under programmatic dependent launch the first flag read waits for
//     the preceding grids first (AgRowWait::wait_flag).
// AgStreamKTileScheduler (stream-K, cooperative kernel only): CUTLASS's stream-K scheduler
// (common/stream_k_scheduler.hpp), which splits the K loops of few tiles among more CTAs, with
// the readiness wait of 2. on every work unit it hands out (a unit covering several output tiles
// comes back through fetch_next_work for each next one). No order change: it serves problems of
// about one wave, whose tiles all start together. The wait guards every reader of A: a unit's
// mainloop loads (and so the partials that the tile's last unit reduces) follow the wait.
// The kernels ask for work through initial_work_tile_info, both fetch_next_work overloads and
// (ping-pong) get_current_work, so these pass through the changes above (AgHandOut); everything
// else is CUTLASS's.
#pragma once

#include "common/flag_wait.cuh"
#include "common/stream_k_scheduler.hpp"
#include "cutlass/arch/grid_dependency_control.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace flux {

struct AgSchedulerTag {};
struct AgStreamKSchedulerTag {};

// The launch's part of both schedulers' arguments: flags[src] != 0 once rows
// [src * rows_per_rank, (src + 1) * rows_per_rank) of A are in place.
struct AgWaitArguments {
  const uint32_t* flags = nullptr;  // [world]: this rank's "shard of rank src is here" flags
  int rank = 0;
  int world = 1;
  int rows_per_rank = 1;  // M of one shard
  int tile_m = 128;       // rows of A in one tile (the kernel's tile shape)
  // Swapped operands (out^T = weight @ a_full^T, csrc/common/fused_gemm.cuh): A's rows are CUTLASS's N, so
  // the order and the wait are on the tiles' N index; the diagnostics below (order, deal) are then off.
  bool rows_on_n = false;
  uint64_t timeout_ns = 0;
  uint32_t* error = nullptr;  // host-mapped [2]: (waiting rank + 1, missing rank) on timeout
  // A diagnostic (torch.ops.flux.set_fused_trace; nullptr, the default, records nothing): per CTA of
  // the grid (linear block index b), kTraceSlots uint64 at trace + b * kTraceSlots, AgTrace's fields.
  uint64_t* trace = nullptr;
  // A diagnostic (torch.ops.flux.set_fused_order; nullptr, the default, changes nothing): the
  // persistent scheduler's cluster tiles permuted. order[c] (c = cluster row * cluster columns + cluster
  // column, over ceil(tiles_m / cluster_m) x ceil(tiles_n / cluster_n) cluster tiles) is the cluster
  // tile served where c would have been, order[count + c] its inverse; used only where count is the
  // launch's number of cluster tiles. The tiles' order in time and the SMs they run on change, not
  // what is computed: an experiment on placement (bench/probe_pdl_trace.py --orders).
  const int32_t* order = nullptr;
  int order_count = 0;
  // A diagnostic (torch.ops.flux.set_fused_deal; nullptr, the default, changes nothing): the persistent
  // scheduler's cluster tiles dealt at run time by the GPC each 2-CTA cluster landed in, on launches of
  // one wave (one cluster tile per cluster). Slot s is the s-th cluster tile along the operand the
  // cluster does not multicast. The SMs' groups (GPCs, flux/autotune/placement.py) own runs of
  // consecutive slots, each as long as the clusters the group holds, scaled to the launch's tiles
  // where it has fewer than the groups hold (the hardware spreads clusters over the GPCs), so that a
  // group's clusters share that operand. A cluster's leader takes the next slot of its group's run
  // from the bottom; where the run is full (a misfit), the next free one of another run from its top.
  // Each run has one counter (bottom and top claims in one word), so no two clusters meet on a slot
  // and every slot is taken once, whatever the placement. The claims need no wait for the preceding
  // grids (AgDeal). deal_pos: deal_sms words, SM sm's group g | cap << 6 | base << 16 (its run's
  // first slot and length unscaled; -1 no group), then AgDealMaxGroups words, group g's base |
  // cap << 16, the last group (AgDealMaxGroups - 1) holding the slots beyond all runs from T, the
  // groups' total.
  const int32_t* deal_pos = nullptr;
  uint32_t* deal_state = nullptr;
  int deal_sms = 0;
};

// deal_state's layout (zeroed once; 8-byte aligned), 64-bit words: [0] the epoch of the last launch
// that dealt (low half) and that launch's clusters dealt so far (high half); [1, 1 + AgDealMaxGroups)
// the groups' counters, each with its launch's claim (epoch + 1) in the top 32 bits: a claim first
// raises the tag (atomicMax, which also clears an older launch's counts) and then adds one to the
// bottom (bits 0-15) or top (16-31) count. Each cluster's leader reads the epoch as it starts, without
// waiting for the preceding grids, in the atomic that counts it: the launch's last moves the epoch on
// before its CTA goes on, and a dependent launch starts only after every CTA of this one has passed
// its construction of the scheduler (CUTLASS's launch_dependent_grids comes after).
struct AgDeal {
  CUTLASS_DEVICE static uint64_t* counter(uint32_t* state, int g) { return reinterpret_cast<uint64_t*>(state) + 1 + g; }
};

// The trace's slots per CTA, %globaltimer ns where a time: the SM, when the CTA's scheduler is built
// (after the kernel's barrier and pipeline setup), when its producer may first load (after the wait
// for the preceding grids), when the producer and the two consumer warp groups run out of tiles (the
// consumers' last epilogue issued), how many tiles the producer loaded, and its first tile (m << 32 | n).
enum AgTrace : int { kTraceSm, kTraceBuilt, kTraceGo, kTraceProducerEnd, kTraceConsumer0End, kTraceConsumer1End,
                     kTraceTiles, kTraceFirstTile, kTraceSlots };

// The readiness wait, on device: before a tile's rows of A are read, wait for the flag of every
// remote rank whose shard holds some of them.
struct AgRowWait : AgWaitArguments {
  int rows_total = 0;  // M of the whole (gathered) problem

  static AgRowWait of(AgWaitArguments const& args, int rows_total) {
    AgRowWait w;
    static_cast<AgWaitArguments&>(w) = args;
    w.rows_total = rows_total;
    return w;
  }

  // `seen`: the remote ranks (bit src, src < 32) whose flag this thread has already acquired in
  // this launch. Their rows were in place then and stay so for the rest of the kernel, and the
  // proxy fence after that acquire already orders every later TMA load of this thread: a tile
  // whose ranks are all seen needs neither a flag load nor a fence.
  CUTLASS_DEVICE void wait_for_tile_rows(int m_idx, uint32_t& seen) const {
    // Only the producer warp group's mainloop warps (CUTLASS's ProducerWarpRole Mainloop, warp 0,
    // and MainloopAux, warp 3) read A, by TMA; the consumers read the shared memory those loads
    // fill (ordered by the pipeline's barriers) and the epilogue never reads A, so their waits
    // would only add a flag load and a proxy fence to every tile's critical path.
    if ((threadIdx.x >> 5) != 0 && (threadIdx.x >> 5) != 3) return;
    const int row0 = m_idx * tile_m;
    if (row0 >= rows_total) return;  // padding tile: no rows, nothing to wait for
    const int row1 = min(row0 + tile_m, rows_total) - 1;
    bool waited = false;
    for (int src = row0 / rows_per_rank; src <= row1 / rows_per_rank && src < world; ++src) {
      if (src == rank) continue;
      const uint32_t bit = src < 32 ? (1u << src) : 0u;
      if (seen & bit) continue;
      wait_flag(src);
      seen |= bit;
      waited = true;
    }
    // The rows are then read by TMA (the async proxy): order the acquire above before it.
    if (waited) fence_proxy_async_global();
  }

  CUTLASS_DEVICE uint64_t* trace_slots() const {
    const uint32_t b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    return trace + size_t(b) * kTraceSlots;
  }

  // At the scheduler's construction (every thread): the SM and the time, by thread 0.
  CUTLASS_DEVICE void trace_built() const {
    if (trace == nullptr || threadIdx.x != 0) return;
    uint64_t* t = trace_slots();
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    t[kTraceSm] = sm;
    t[kTraceBuilt] = globaltimer_ns();
    t[kTraceTiles] = 0;
  }

  // At every hand-out of a tile (m, n) or of the end (valid false): the producer's first tile (after
  // the preceding grids, as its loads), its count and end, and each consumer warp group's end.
  CUTLASS_DEVICE void trace_handed_out(bool valid, int m, int n) const {
    if (trace == nullptr) return;
    uint64_t* t = trace_slots();
    if (threadIdx.x == 0) {
      if (valid) {
        if (t[kTraceTiles] == 0) {
          cutlass::arch::wait_on_dependent_grids();
          t[kTraceGo] = globaltimer_ns();
          t[kTraceFirstTile] = (uint64_t(uint32_t(m)) << 32) | uint32_t(n);
        }
        t[kTraceTiles] += 1;
      } else {
        t[kTraceProducerEnd] = globaltimer_ns();
      }
    } else if (!valid && (threadIdx.x == 128 || threadIdx.x == 256)) {
      t[threadIdx.x == 128 ? kTraceConsumer0End : kTraceConsumer1End] = globaltimer_ns();
    }
  }

  CUTLASS_DEVICE void wait_flag(int src) const {
    // The kernels ask for their first tile before their own griddepcontrol.wait (and the
    // cooperative kernel's consumer warps never execute one): under programmatic dependent
    // launch a flag read here could see the value of a previous call before the kernels ahead
    // of this one in the stream have finished. Waiting for them first is idempotent, and a
    // no-op without PDL.
    cutlass::arch::wait_on_dependent_grids();
    wait_flag_bounded(flags + src, timeout_ns, error, rank, src);
  }
};

// The work requests of the cooperative and ping-pong kernels, on a CUTLASS scheduler Base:
// what Base hands out passes through Derived::handed_out (rotation, wait), and a tile handed
// back to Base first through Derived::taken_back (the inverse rotation).
template <class Derived, class Base>
class AgHandOut : public Base {
 public:
  using Base::Base;
  using WorkTileInfo = typename Base::WorkTileInfo;

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape cluster_shape) {
    return self().handed_out(Base::initial_work_tile_info(cluster_shape));
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info) {
    auto [next, increment] = Base::fetch_next_work(self().taken_back(work_tile_info));
    return cute::make_tuple(self().handed_out(next), increment);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  CUTLASS_DEVICE Derived const& self() const { return static_cast<Derived const&>(*this); }
};

class AgTileScheduler
    : public AgHandOut<AgTileScheduler, cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using HandOut = AgHandOut<AgTileScheduler, Base>;
  friend HandOut;
  using BaseParams = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params;
  using BaseArguments = Base::Arguments;

 public:
  struct Arguments : BaseArguments, AgWaitArguments {};

  struct Params : BaseParams, AgRowWait {
    int tiles_m = 1;  // tiles along A's rows (M, or N where rows_on_n), padded to whole bands of the raster
    int offset_tiles = 0;
    // The diagnostic permutation (AgWaitArguments::order) over cluster_rows x cluster_cols cluster
    // tiles of cluster_m x cluster_n tiles; order is nullptr where none applies to this launch.
    int cluster_m = 1, cluster_n = 1, cluster_rows = 0, cluster_cols = 0;
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
    const int rows_total = static_cast<int>(args.rows_on_n ? cute::get<1>(problem_shape_mnkl)
                                                            : cute::get<0>(problem_shape_mnkl));
    const int tiles = (rows_total + args.tile_m - 1) / args.tile_m;
    // Along N, the base scheduler serves M tiles in bands of (cluster_m << log_swizzle) and pads
    // its M extent to whole bands: rotate over that same extent (a bijection on the indices it
    // hands out; padding tiles are recognised by their rows below) and by whole bands, so that
    // bands stay intact. (Rounding the offset to two bands, as before, left it at 0 on rank 1
    // whenever a rank's rows were one band: that rank then started on its peer's rows.) Both extents
    // are padded so: with A's rows on N, the same over N tiles and bands of cluster_n tiles.
    const int band = (args.rows_on_n ? int(cute::size<1>(cluster_shape)) : cluster_m) << p.log_swizzle_size_;
    p.tiles_m = (tiles + band - 1) / band * band;
    int first = args.rank * args.rows_per_rank / args.tile_m;
    first = first / band * band;
    p.offset_tiles = first % p.tiles_m;
    static_cast<AgRowWait&>(p) = AgRowWait::of(args, rows_total);
    const int tile_n = cute::size<1>(tile_shape);
    const int tiles_n = (static_cast<int>(cute::get<1>(problem_shape_mnkl)) + tile_n - 1) / tile_n;
    p.cluster_m = cluster_m;
    p.cluster_n = cute::size<1>(cluster_shape);
    p.cluster_rows = (tiles + cluster_m - 1) / cluster_m;
    p.cluster_cols = (tiles_n + p.cluster_n - 1) / p.cluster_n;
    if (p.order_count != p.cluster_rows * p.cluster_cols || p.rows_on_n) p.order = nullptr;
    if (p.rows_on_n) p.deal_state = nullptr;
    return p;
  }

  CUTLASS_HOST_DEVICE AgTileScheduler() {}
  CUTLASS_DEVICE explicit AgTileScheduler(Params const& params) : HandOut(params), ag_(params) {
    ag_.trace_built();
    if (ag_.deal_state != nullptr) dealt_ = deal();
  }

  // The ping-pong kernel moves on with advance_to_next_work(); get_current_work(): that path
  // must rotate and wait too. (The base's own fetch_next_work / initial_work_tile_info call
  // the base's get_current_work, not this one, so nothing is rotated twice.)
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return handed_out(Base::get_current_work()); }

 private:
  Params ag_;
  mutable uint32_t seen_ = 0;  // AgRowWait::wait_for_tile_rows
  // The diagnostic deal (AgWaitArguments::deal_pos): the cluster tile this cluster claimed (-1: none,
  // the static order), the one it was launched for (after the rotation).
  int dealt_ = -1;
  mutable int launched_ = -1;

  // A claim on group g's counter (AgDeal), for launch `claim`: the slot it got, or -1 (the run full).
  // Bottom and top claims add to one word, so they are ordered: the k-th claim of the launch is good
  // while k < fit, a bottom one then taking base + (bottom count), a top one base + fit - 1 - (top
  // count); no two good claims get one slot (whichever came later counted the other).
  CUTLASS_DEVICE static int claim_run(uint64_t* counter, uint32_t claim, int base, int fit, bool top) {
    const uint64_t tag = uint64_t(claim) << 32;
    atomicMax(reinterpret_cast<unsigned long long*>(counter), tag);  // same address: ordered before the add
    const uint64_t old = atomicAdd(reinterpret_cast<unsigned long long*>(counter), top ? 0x10000ull : 1ull);
    if ((old >> 32) != claim) return -1;  // cannot happen: the counter carries this launch's tag
    const int bottom = int(old & 0xFFFF), topped = int((old >> 16) & 0xFFFF);
    if (bottom + topped >= fit) return -1;
    return top ? base + fit - 1 - topped : base + bottom;
  }

  // A group's run for a launch of `count` cluster tiles (`total`: the groups' slots): scaled to the
  // tiles where there are fewer (the runs then cover [0, count) exactly), else as given (the last
  // group's run then covers [total, count)); `base` becomes its first slot, the length is returned.
  CUTLASS_DEVICE static int run_of(int& base, int cap, int count, int total) {
    int end = base + cap;
    if (count <= total && total > 0) {
      base = base * count / total;
      end = end * count / total;
    }
    return cute::max(cute::min(end, count) - base, 0);
  }

  // Group g's run for the launch from its table word (deal_pos's groups): `base` its first slot, the
  // length returned (run_of).
  CUTLASS_DEVICE static int group_run(const int32_t* groups, int g, int& base, int count, int total) {
    const int word = groups[g];
    base = word & 0xFFFF;
    return run_of(base, word >> 16, count, total);
  }

  // Every thread of the CTA, at the scheduler's construction, between the kernel's cluster arrive and
  // wait (before the roles split), with no wait for the preceding grids (AgDeal). The decision to deal
  // is the same in every CTA (2-CTA clusters, one wave of exactly the cluster tiles). The leader CTA's
  // first warp claims; its first lane posts the slot into both CTAs' shared memory (the last word of
  // the kernel's, in its tile buffers, which no load writes before the kernel's cluster wait), between
  // cluster barriers: the kernel's arrive, a wait (every CTA of the cluster has started), the post,
  // an arrive and wait, every thread's read, and an arrive for the kernel's wait.
  CUTLASS_DEVICE int deal() {
    const int count = ag_.cluster_rows * ag_.cluster_cols;
    const int csize = ag_.cluster_m * ag_.cluster_n;
    const int ctas = int(gridDim.x * gridDim.y * gridDim.z);
    if (csize != 2 || ctas != 2 * count || ag_.deal_sms <= 0 || ag_.deal_sms > AgDealMaxSms ||
        count > ag_.deal_sms) {
      return -1;
    }
    uint32_t* state = ag_.deal_state;
    const bool leader = cute::block_rank_in_cluster() == 0;
    int got = -1;
    if (leader && threadIdx.x < 32) {
      const int lane = int(threadIdx.x);
      uint32_t sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      const int32_t* groups = ag_.deal_pos + ag_.deal_sms;
      const int packed = lane == 0 && int(sm) < ag_.deal_sms ? ag_.deal_pos[sm] : -1;
      const int total = groups[AgDealMaxGroups - 1] & 0xFFFF;
      uint32_t claim = 0;
      if (lane == 0) {
        unsigned long long* word = reinterpret_cast<unsigned long long*>(state);
        const unsigned long long old = atomicAdd(word, 1ull << 32);
        claim = uint32_t(old) + 1;
        if (int(old >> 32) == count - 1) {  // the launch's last cluster: every other has read the epoch
          atomicExch(word, static_cast<unsigned long long>(claim));
          __threadfence();
        }
        if (packed >= 0) {
          int base = packed >> 16;
          const int fit = run_of(base, (packed >> 6) & 1023, count, total);
          if (fit > 0) got = claim_run(AgDeal::counter(state, packed & 63), claim, base, fit, false);
        }
      }
      claim = __shfl_sync(0xffffffffu, claim, 0);
      got = __shfl_sync(0xffffffffu, got, 0);
      // A misfit: a group whose run had room when read, the first from a start spread by the SM
      // number; a failed claim means that run filled meanwhile. As many clusters as slots, and the
      // runs cover them all: this ends.
      for (int round = 0; got < 0 && round <= count + AgDealMaxGroups; ++round) {
        uint64_t room = 0;
        for (int j = 0; j < AgDealMaxGroups / 32; ++j) {
          const int g = lane + 32 * j;
          int base;
          const int fit = group_run(groups, g, base, count, total);
          bool free_slot = false;
          if (fit > 0) {
            const uint64_t c = *reinterpret_cast<volatile uint64_t*>(AgDeal::counter(state, g));
            free_slot = (c >> 32) != claim || int(c & 0xFFFF) + int((c >> 16) & 0xFFFF) < fit;
          }
          room |= uint64_t(__ballot_sync(0xffffffffu, free_slot)) << (32 * j);
        }
        if (room == 0) continue;
        const int start = int(sm + uint32_t(round)) % AgDealMaxGroups;
        const uint64_t turned = start == 0 ? room : (room >> start) | (room << (AgDealMaxGroups - start));
        const int g = (start + __ffsll(static_cast<long long>(turned)) - 1) % AgDealMaxGroups;
        if (lane == 0) {
          int base;
          const int fit = group_run(groups, g, base, count, total);
          got = claim_run(AgDeal::counter(state, g), claim, base, fit, true);
        }
        got = __shfl_sync(0xffffffffu, got, 0);
      }
      if (got < 0) __trap();  // cannot happen (above)
    }
    extern __shared__ char ag_deal_smem[];
    uint32_t smem_bytes;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
    const uint32_t post = cute::cast_smem_ptr_to_uint(ag_deal_smem) + smem_bytes - 4;
    cute::cluster_wait();  // the kernel's arrive: the other CTA has started
    if (leader && threadIdx.x == 0) {
      uint32_t remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(post), "r"(1));
      asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(uint32_t(got)) : "memory");
      asm volatile("st.shared.u32 [%0], %1;" ::"r"(post), "r"(uint32_t(got)) : "memory");
    }
    cute::cluster_arrive();  // release: the posts
    cute::cluster_wait();
    uint32_t slot;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(slot) : "r"(post) : "memory");
    cute::cluster_arrive_relaxed();  // the kernel's cluster wait pairs with this
    // The slot as a cluster tile: along N where the cluster multicasts the weight (2x1: the group's
    // clusters share rows of A), along M where it multicasts A (1x2).
    if (ag_.cluster_m == 2) return int(slot);
    return int(slot % ag_.cluster_rows) * ag_.cluster_cols + int(slot / ag_.cluster_rows);
  }

  // The cluster tile holding w's tile replaced: the launched one (after the rotation) by the dealt one
  // (to_dealt), or back (from_dealt); the tile keeps its place inside the cluster tile.
  CUTLASS_DEVICE void redeal(WorkTileInfo& w, bool to_dealt) const {
    const int cm = w.M_idx / ag_.cluster_m, cn = w.N_idx / ag_.cluster_n;
    if (cm >= ag_.cluster_rows || cn >= ag_.cluster_cols) return;
    const int c = cm * ag_.cluster_cols + cn;
    if (to_dealt) launched_ = c;
    const int to = to_dealt ? dealt_ : (c == dealt_ ? launched_ : c);
    w.M_idx = to / ag_.cluster_cols * ag_.cluster_m + w.M_idx % ag_.cluster_m;
    w.N_idx = to % ag_.cluster_cols * ag_.cluster_n + w.N_idx % ag_.cluster_n;
  }

  // The diagnostic permutation (or its inverse, `table` = order + count) of the cluster tile holding
  // w's tile; the tile keeps its place inside the cluster tile. Tiles of the band padding beyond the
  // cluster tiles stay: a bijection on every tile handed out.
  CUTLASS_DEVICE void permute(WorkTileInfo& w, const int32_t* table) const {
    const int cm = w.M_idx / ag_.cluster_m, cn = w.N_idx / ag_.cluster_n;
    if (cm >= ag_.cluster_rows || cn >= ag_.cluster_cols) return;
    const int c = table[cm * ag_.cluster_cols + cn];
    w.M_idx = c / ag_.cluster_cols * ag_.cluster_m + w.M_idx % ag_.cluster_m;
    w.N_idx = c % ag_.cluster_cols * ag_.cluster_n + w.N_idx % ag_.cluster_n;
  }

  // The index of w's tile along A's rows.
  CUTLASS_DEVICE static int& rows_idx(WorkTileInfo& w, bool on_n) { return on_n ? w.N_idx : w.M_idx; }

  // The static scheduler never continues a tile (no split-K): a tile handed back only advances.
  CUTLASS_DEVICE WorkTileInfo taken_back(WorkTileInfo w) const {
    if (!w.is_valid()) return w;
    if (dealt_ >= 0) redeal(w, false);
    else if (ag_.order != nullptr) permute(w, ag_.order + ag_.order_count);
    int& r = rows_idx(w, ag_.rows_on_n);
    r = (r - ag_.offset_tiles + ag_.tiles_m) % ag_.tiles_m;
    return w;
  }

  CUTLASS_DEVICE WorkTileInfo handed_out(WorkTileInfo w) const {
    if (!w.is_valid()) {
      ag_.trace_handed_out(false, 0, 0);
      return w;
    }
    int& r = rows_idx(w, ag_.rows_on_n);
    r = (r + ag_.offset_tiles) % ag_.tiles_m;
    if (dealt_ >= 0) redeal(w, true);
    else if (ag_.order != nullptr) permute(w, ag_.order);
    ag_.wait_for_tile_rows(ag_.rows_on_n ? w.N_idx : w.M_idx, seen_);
    ag_.trace_handed_out(true, w.M_idx, w.N_idx);
    return w;
  }
};

template <class TileShape, class ClusterShape>
class AgStreamKTileScheduler
    : public AgHandOut<AgStreamKTileScheduler<TileShape, ClusterShape>, StreamKTileScheduler<TileShape, ClusterShape>> {
  using Base = StreamKTileScheduler<TileShape, ClusterShape>;
  using HandOut = AgHandOut<AgStreamKTileScheduler, Base>;
  friend HandOut;
  using BaseArguments = typename Base::Arguments;
  using BaseParams = typename Base::Params;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  struct Arguments : BaseArguments, AgWaitArguments {};
  struct Params : BaseParams, AgRowWait {};

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shape, TileShape tile_shape, ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
                                        void* workspace, const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<BaseParams&>(p) =
        Base::to_underlying_arguments(problem_shape, tile_shape, cluster_shape, hw_info,
                                      static_cast<BaseArguments const&>(args), workspace, epilogue_subtile,
                                      ktile_start_alignment_count);
    static_cast<AgRowWait&>(p) = AgRowWait::of(
        args, static_cast<int>(args.rows_on_n ? cute::get<1>(problem_shape) : cute::get<0>(problem_shape)));
    return p;
  }

  CUTLASS_HOST_DEVICE AgStreamKTileScheduler() {}
  CUTLASS_DEVICE explicit AgStreamKTileScheduler(Params const& params) : HandOut(params), ag_(params) {
    ag_.trace_built();
  }

 private:
  AgRowWait ag_;
  mutable uint32_t seen_ = 0;  // AgRowWait::wait_for_tile_rows

  CUTLASS_DEVICE WorkTileInfo taken_back(WorkTileInfo w) const { return w; }

  // A separate-reduction unit (no K tiles) reads no A; waiting for its rows anyway costs at most
  // one flag load per loading warp (none for a rank this thread has seen).
  CUTLASS_DEVICE WorkTileInfo handed_out(WorkTileInfo w) const {
    if (w.is_valid()) ag_.wait_for_tile_rows(ag_.rows_on_n ? w.N_idx : w.M_idx, seen_);
    ag_.trace_handed_out(w.is_valid(), w.M_idx, w.N_idx);
    return w;
  }
};

}  // namespace flux

// Route flux's tags to the schedulers above in CUTLASS's kernel-level selector.
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<flux::AgSchedulerTag, ArchTag, TileShape, ClusterShape, SchedulerPipelineStageCount> {
  using Scheduler = flux::AgTileScheduler;
};
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<flux::AgStreamKSchedulerTag, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = flux::AgStreamKTileScheduler<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail
