// What the fused GEMMs (csrc/ag_gemm/, csrc/gemm_rs/) share: their launch arguments, checked
// once by each op's dispatcher, the dtype variants they are built for, and (with FLUX_WITH_SM90)
// the CUTLASS 3.x sm90 GEMM type they are built from, which differ only in the source C, the
// epilogue wrapper and the tile scheduler. Which (config, dtype) instantiations exist is the
// table flux/fused_configs.py; setup.py generates their translation units and dispatch.
#pragma once

#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "common/check.h"
#if !defined(FLUX_KERNEL_UNIT)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#endif

namespace flux {

// out[m, n] = a[m, k] @ weight[n, k]^T (+ bias[n]) and the kernel's signalling.
struct FusedGemmLaunch {
  void* out = nullptr;
  const void* a = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;  // or nullptr
  const uint32_t* flags = nullptr;
  uint32_t* error_record = nullptr;  // host-mapped [2], or nullptr
  int m = 0, n = 0, k = 0;
  int raster = 1, swizzle = 1;  // tile order: 0 CUTLASS's heuristic, 1 along N, 2 along M; band of M tiles
  uint64_t timeout_ns = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
};

// The dtype variants, numbered as flux/fused_configs.py DTYPES: inputs -> output (fp32
// accumulation; the bias and a source C are in the output dtype).
enum FusedDtype : int { kBf16 = 0, kFp16 = 1, kBf16Fp32 = 2, kFp16Fp32 = 3 };
inline const char* fused_dtype_name(int d) {
  static const char* names[] = {"bf16", "fp16", "bf16_fp32", "fp16_fp32"};
  return d >= 0 && d < 4 ? names[d] : "unsupported";
}
// The instantiations compiled into flux._C, "op:config:dtype" separated by spaces (generated).
std::string fused_kernels_built();

// Whether the fused GEMMs are launched with programmatic dependent launch (process-wide,
// default on; torch.ops.flux.set_fused_pdl). Under PDL a fused kernel may start while the
// kernel before it in the stream finishes: its prologue (barrier and pipeline setup, TMA
// descriptor prefetch) overlaps that kernel's tail, and it executes griddepcontrol.wait before
// its first global memory access (CUTLASS's producer warps, the AG scheduler's flag reads).
// Only kernel -> kernel stream edges are relaxed; memsets, stream writes and event waits stay
// full dependencies. Without CUTLASS_ENABLE_GDC_FOR_SM90 (setup.py sets it) the kernels have
// no such wait, and the switch is ignored.
bool fused_pdl();
void set_fused_pdl(bool enabled);

#if !defined(FLUX_KERNEL_UNIT)  // the dispatchers' side (ag_gemm_fused.cpp, rs_fused.cpp)

// The variant of (input, output) dtypes, or -1 where none is defined.
inline int fused_dtype_of(at::ScalarType in, at::ScalarType out) {
  if (in == at::kBFloat16) return out == at::kBFloat16 ? kBf16 : out == at::kFloat ? kBf16Fp32 : -1;
  if (in == at::kHalf) return out == at::kHalf ? kFp16 : out == at::kFloat ? kFp16Fp32 : -1;
  return -1;
}

// Raises, naming the op, the configuration and the dtype variant, where the generated dispatch
// found no such instantiation (launched false).
inline void check_fused_built(bool launched, const char* op, int64_t config, int dtype) {
  FLUX_CHECK(launched, op, "configuration ", config, " for ", fused_dtype_name(dtype),
             " is not built into flux._C (built: ", fused_kernels_built(), "; FLUX_KERNELS selects them at build time)");
}

// The common part of the launch arguments, from tensors the dispatcher has checked.
inline FusedGemmLaunch fused_gemm_launch(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, const at::Tensor& flags,
                                         int64_t error_record, int64_t raster, int64_t swizzle, int64_t timeout_ms) {
  FusedGemmLaunch l;
  l.out = out.data_ptr();
  l.a = a.data_ptr();
  l.weight = weight.data_ptr();
  l.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  l.flags = reinterpret_cast<const uint32_t*>(flags.data_ptr());
  l.error_record = reinterpret_cast<uint32_t*>(error_record);
  l.m = (int)a.size(0);
  l.n = (int)weight.size(0);
  l.k = (int)a.size(1);
  l.raster = (int)raster;
  l.swizzle = (int)swizzle;
  l.timeout_ns = (uint64_t)timeout_ms * 1000000ull;
  l.device = a.get_device();
  l.stream = at::cuda::getCurrentCUDAStream();
  return l;
}

#endif  // !FLUX_KERNEL_UNIT

}  // namespace flux

#if defined(FLUX_WITH_SM90) && (defined(FLUX_AG_FUSED_IMPL) || defined(FLUX_RS_FUSED_IMPL))

#include "common/cutlass_run.cuh"
#include "common/split_k.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include <type_traits>

namespace flux {

template <class Epilogue>
using PlainEpilogue = Epilogue;

// A schedule `S` as given (kTagged false) or wrapped in the tag template `Tag` (kTagged true), and the
// CUTLASS schedule inside: how the kernel and epilogue schedule tags below are read.
template <template <class> class Tag, class S>
struct Untag {
  using type = S;
  static constexpr bool kTagged = false;
};
template <template <class> class Tag, class S>
struct Untag<Tag, Tag<S>> {
  using type = S;
  static constexpr bool kTagged = true;
};

// A kernel schedule tag: CUTLASS's `Schedule` with the mainloop below, whose producer issues each
// stage's multicast load before the other operand's (CUTLASS issues A, then B), as cuBLAS's kernels
// on the narrow layers do. The configurations whose `loads` is "multicast-first" (flux/fused_configs.py:
// AG 60 and 75, where it measured 1-6% faster; docs/performance.md §9) use it.
template <class Schedule>
struct MulticastFirst {};
template <class S>
using ScheduleOf = Untag<MulticastFirst, S>;

// An epilogue schedule tag: CUTLASS's `Schedule` with more of the source C (RS: the peer's partial)
// loaded ahead. The TMA epilogue with C and D of one type shares StagesC shared-memory buffers between
// C's loads and D's stores, and a buffer whose store may still be in flight (StagesD - 1 of them) is
// released only by the next tile's epilogue: the producer's load warp can fetch just
// StagesC - StagesD + 1 subtiles of the next tile's C during its mainloop and loads the rest while the
// consumers wait in the epilogue (RS 0 with EpiPick's StagesD: 2 of 8). With it, StagesD = 2 and as many
// C buffers as leave the mainloop its stages (RS 0: 3 of 8 ahead, 0.97x the time on an H100,
// docs/performance.md §9). The configurations whose `source` is "ahead" (flux/fused_configs.py) use it.
template <class Schedule>
struct SourceAhead {};
template <class S>
using EpilogueOf = Untag<SourceAhead, S>;

// CUTLASS's sm90 TMA warp-specialized mainloop `Base` with its producer's two loads per stage in
// the other order where only B is multicast (Base's own load otherwise); all else is Base's.
template <class Base>
struct MulticastFirstMainloop : Base {
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(typename Base::Params const& mainloop_params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    using Policy = typename Base::DispatchPolicy;
    if constexpr (!is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST> ||
                  is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      // A is multicast (or neither is): CUTLASS's order already issues the multicast load first.
      Base::load(mainloop_params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count,
                 thread_idx, block_rank_in_cluster, shared_tensors);
    } else {
      if (!cute::elect_one_sync()) return;
      Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
      Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
      constexpr uint32_t cluster_x = get<0>(typename Policy::ClusterShape());
      uint2 local = {block_rank_in_cluster % cluster_x, block_rank_in_cluster / cluster_x};
      auto block_tma_a = mainloop_params.tma_load_a.get_slice(local.y);
      auto block_tma_b = mainloop_params.tma_load_b.get_slice(local.x);
      auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
      Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
      Tensor tAsA = block_tma_a.partition_D(sA);
      Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
      Tensor tBsB = block_tma_b.partition_D(sB);
      uint16_t mcast_b = 0;  // the CTAs of this cluster column, which share B; A is not multicast
      auto block_layout = Layout<typename Policy::ClusterShape>{};
      for (int m = 0; m < size<0>(block_layout); ++m) mcast_b |= uint16_t(1) << block_layout(m, local.y, Int<0>{});
      CUTLASS_PRAGMA_NO_UNROLL
      for (; k_tile_count > 0; --k_tile_count) {
        pipeline.producer_acquire(smem_pipe_write);
        auto* bar = pipeline.producer_get_barrier(smem_pipe_write);
        const int stage = smem_pipe_write.index();
        copy(mainloop_params.tma_load_b.with(*bar, mcast_b), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
        copy(mainloop_params.tma_load_a.with(*bar, uint16_t(0)), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
        ++k_tile_iter;
        ++smem_pipe_write;
      }
    }
  }
};

// The CUTLASS element types of the dtype variants.
template <int Dtype>
struct FusedTypes;
template <>
struct FusedTypes<kBf16> { using In = cutlass::bfloat16_t; using Out = cutlass::bfloat16_t; };
template <>
struct FusedTypes<kFp16> { using In = cutlass::half_t; using Out = cutlass::half_t; };
template <>
struct FusedTypes<kBf16Fp32> { using In = cutlass::bfloat16_t; using Out = float; };
template <>
struct FusedTypes<kFp16Fp32> { using In = cutlass::half_t; using Out = float; };

// A [M, K] row-major, weight [N, K] (nn.Linear, K contiguous), both ElementIn (bf16 or fp16),
// D [M, N] row-major ElementOut (the input dtype or fp32), fp32 accumulation;
// D = acc (+ C, ElementOut, where HasSource) + bias per column (ElementOut), rounded once.
// Swapped: the same D computed as D^T = weight @ A^T, CUTLASS's problem (N, M, K) with weight as its A and
// A as its B (both K-major, so their layouts stay) and D^T column-major (D's own memory), the bias per row
// of D^T: the warpgroup MMA's 64-row side then runs along the layer's columns and its 8..256-wide side along
// A's rows, so a tile may hold 8..56 rows of A (TileShape_ and ClusterShape_ are CUTLASS's, (N, M)).
template <class ElementIn, class ElementOut, class TileShape_, class ClusterShape_, class KernelSchedule,
          class EpilogueScheduleTag, bool HasSource, template <class> class EpilogueWrap, class Scheduler,
          int StreamKMode = 0, bool Swapped = false>
struct Sm90FusedGemm {
  static constexpr bool kSwapped = Swapped;
  // 0: a persistent scheduler; 1: CUTLASS's stream-K scheduler, its heuristic deciding between
  // whole tiles, split-K and stream-K; 2: stream-K always (the heuristic keeps whole tiles where
  // the last wave is at least half full, e.g. 80 tiles on 132 SMs, leaving SMs idle).
  static constexpr int kStreamKMode = StreamKMode;
  using ElementA = ElementIn;
  using ElementB = ElementIn;
  using ElementC = std::conditional_t<HasSource, ElementOut, void>;  // void: no source
  using ElementD = ElementOut;
  using ElementAcc = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = std::conditional_t<Swapped, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlign = 16 / sizeof(ElementIn);    // TMA: 16-byte rows of A and B
  static constexpr int kAlignD = 16 / sizeof(ElementOut);  // and of C and D
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileRows = cute::size<Swapped ? 1 : 0>(TileShape{});  // rows of A (and D) per tile
  using EpilogueSchedule = typename EpilogueOf<EpilogueScheduleTag>::type;

  using Fusion = std::conditional_t<Swapped,
                                    cutlass::epilogue::fusion::LinCombPerRowBias<ElementD, float, ElementD, ElementD, float>,
                                    cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, ElementD, ElementD, float>>;
  // The mainloop's stages fill the shared memory that the epilogue `Epi` leaves.
  template <class Epi>
  using MainloopFor = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlign, ElementB, LayoutB, kAlign,
      ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueWrap<Epi>::SharedStorage))>,
      typename ScheduleOf<KernelSchedule>::type>::CollectiveOp;

  // The TMA epilogue stores a tile as subtiles (EpilogueTileAuto: 128 x 32 columns, or gcd(32, N), for the
  // cooperative schedule; 64 x 32 for ping-pong) through StagesD shared-memory buffers, and before refilling
  // a buffer it waits until the TMA store that last read it has finished. CUTLASS's choice, StagesD = 2,
  // makes every subtile wait for the store of the one before it (11 subtiles of 128 x 16 for a 128x176
  // tile). Here StagesD is the largest count up to the tile's subtiles (at most 8) that costs the
  // mainloop no stage: the shared memory left over by the stages' rounding (docs/performance.md §9:
  // 1-2% faster on average, most on RS).
  struct EpiPick {
    using EpiTile = decltype(cutlass::epilogue::collective::detail::sm90_compute_tile_shape_or_override<
                             ElementD, cutlass::epilogue::collective::EpilogueTileAuto, EpilogueSchedule, TileShape>());
    static constexpr int kSubtiles = cute::size(cute::shape_div(cute::take<0, 2>(TileShape{}), EpiTile{}));
    static constexpr int kFragment =
        cute::size(EpiTile{}) / (cutlass::epilogue::collective::detail::sm90_is_cooperative_v<EpilogueSchedule> ? 256 : 128);
    static constexpr bool kReuseC =
        cute::sizeof_bits_v<ElementC> == cute::sizeof_bits_v<ElementD> && cute::sizeof_bits_v<ElementD> > 8;
    static constexpr bool kDelayStore = cute::is_void_v<ElementC>;
    template <int StagesC, int StagesD>
    using AtCD = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
        TileShape, EpiTile, ElementAcc, float, ElementC, LayoutD, kAlignD, ElementD, LayoutD, kAlignD, Fusion,
        cutlass::epilogue::Sm90TmaWarpSpecialized<StagesC, StagesD, kFragment, kReuseC, kDelayStore>>::CollectiveOp;
    template <int StagesD>
    using At = AtCD<kReuseC ? cute::max(cute::min(kSubtiles, 4), StagesD + 1) : cute::min(kSubtiles, 4), StagesD>;
    // The mainloop's stages beside epilogue E: CUTLASS's count (its builder's, for MainloopFor), without
    // instantiating a mainloop that would have fewer than 2.
    template <class E>
    static constexpr int stages_beside() {
      return cutlass::gemm::collective::detail::compute_stage_count_or_override<
          cutlass::gemm::collective::detail::sm90_smem_capacity_bytes, ElementIn, ElementIn, TileShape>(
          cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueWrap<E>::SharedStorage))>{});
    }
    static constexpr int kDefault = cute::min(kSubtiles, 2);
    static constexpr int kStages = stages_beside<At<kDefault>>();
    template <int D, bool = (D <= kDefault)>
    struct Largest {
      static constexpr int value = stages_beside<At<D>>() == kStages ? D : Largest<D - 1>::value;
    };
    template <int D>
    struct Largest<D, true> {
      static constexpr int value = kDefault;
    };
    static constexpr int kStagesD = Largest<cute::min(kSubtiles, 8)>::value;
    static_assert(!EpilogueOf<EpilogueScheduleTag>::kTagged || (kReuseC && !cute::is_void_v<ElementC>),
                  "SourceAhead: for a source C of the output's type");
    // SourceAhead: StagesD = 2 and the most StagesC up to the tile's subtiles + 1 that keeps the
    // mainloop's kStages (at least 3).
    template <int C, bool = (C <= 3)>
    struct Keep {
      static constexpr int value = stages_beside<AtCD<C, 2>>() == kStages ? C : Keep<C - 1>::value;
    };
    template <int C>
    struct Keep<C, true> {
      static constexpr int value = 3;
    };
    template <bool Ahead, int = 0>
    struct Pick {
      using type = At<kStagesD>;
    };
    template <int Unused>
    struct Pick<true, Unused> {
      using type = AtCD<Keep<kSubtiles + 1>::value, 2>;
    };
    using type = typename Pick<EpilogueOf<EpilogueScheduleTag>::kTagged>::type;
  };
  using BaseEpilogue = typename EpiPick::type;
  using CollectiveEpilogue = EpilogueWrap<BaseEpilogue>;
  using CollectiveMainloop = std::conditional_t<ScheduleOf<KernelSchedule>::kTagged,
                                                MulticastFirstMainloop<MainloopFor<BaseEpilogue>>,
                                                MainloopFor<BaseEpilogue>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The GEMM's arguments for a launch: operands, packed strides, bias, hardware and tile order
// (the epilogue's source C, where there is one, and the scheduler's extra fields are the caller's).
template <class G>
typename G::Gemm::Arguments gemm_arguments(const FusedGemmLaunch& l) {
  using Kernel = typename G::Gemm::GemmKernel;
  // CUTLASS's (M, N): the layer's (rows, columns), or (columns, rows) with swapped operands.
  const int pm = G::kSwapped ? l.n : l.m, pn = G::kSwapped ? l.m : l.n;
  const void* pa = G::kSwapped ? l.weight : l.a;
  const void* pb = G::kSwapped ? l.a : l.weight;
  auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(pm, l.k, 1));
  auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(pn, l.k, 1));
  auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(pm, pn, 1));
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {pm, pn, l.k, 1};
  args.mainloop = {reinterpret_cast<const typename G::ElementA*>(pa), sa,
                   reinterpret_cast<const typename G::ElementB*>(pb), sb};
  args.epilogue.dC = sd;
  args.epilogue.ptr_D = reinterpret_cast<typename G::ElementD*>(l.out);
  args.epilogue.dD = sd;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.bias_ptr = reinterpret_cast<const typename G::ElementD*>(l.bias);
  args.hw_info = hardware_info(l.device);
  using Raster = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions;
  // l.raster names the layer's dimensions (1: along its columns, 2: along its rows); swapped, those are
  // CUTLASS's M and N.
  const int raster = G::kSwapped && l.raster != 0 ? 3 - l.raster : l.raster;
  args.scheduler.raster_order = raster == 0 ? Raster::Heuristic : raster == 2 ? Raster::AlongM : Raster::AlongN;
  args.scheduler.max_swizzle_size = l.swizzle;
  if constexpr (G::kStreamKMode == 2) {
    args.scheduler.decomposition_mode = cutlass::gemm::kernel::detail::DecompositionMode::StreamK;
  }
  return args;
}

// The split-K configurations' second pass (split_k.cuh): out = the `splits` partials summed
// (+ source) (+ bias) in the output type of dtype variant `dtype`; with `flags`, after the
// `segments` flags of the source rows are set.
inline void split_k_finish(const char* op, int dtype, const float* partials, const FusedGemmLaunch& l, int splits,
                           const void* source = nullptr, const uint32_t* flags = nullptr, int segments = 0,
                           int rank = 0, int peer = 0) {
  auto run = [&](auto tag) {
    using Out = decltype(tag);
    SplitKReduce<Out> p;
    p.partials = partials;
    p.source = static_cast<const Out*>(source);
    p.bias = static_cast<const Out*>(l.bias);
    p.out = static_cast<Out*>(l.out);
    p.m = l.m;
    p.n = l.n;
    p.splits = splits;
    p.flags = flags;
    p.segments = segments;
    p.rank = rank;
    p.peer = peer;
    p.timeout_ns = l.timeout_ns;
    p.error = l.error_record;
    launch_split_k_reduce<Out>(op, p, l.device, l.stream);
  };
  switch (dtype) {
    case kBf16: run(cutlass::bfloat16_t{}); break;
    case kFp16: run(cutlass::half_t{}); break;
    default: run(float{}); break;  // kBf16Fp32, kFp16Fp32
  }
}

// Split-K's checks and partials, shared by both ops' launchers: K must cut into `splits` slices
// whose rows stay 16-byte aligned for TMA.
inline Workspace split_k_partials(const char* op, const FusedGemmLaunch& l, int splits) {
  FLUX_CHECK(splits >= 2 && l.k % (8 * splits) == 0, op, "split-K into ", splits, " slices needs K a multiple of ",
             8 * splits, " (K=", l.k, ")");
  return cutlass_workspace(size_t(splits) * size_t(l.m) * size_t(l.n) * sizeof(float), l.device);
}

}  // namespace flux

#endif  // FLUX_WITH_SM90 && (FLUX_AG_FUSED_IMPL || FLUX_RS_FUSED_IMPL)
