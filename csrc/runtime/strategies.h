// Generated from flux/strategies.py by `python -m flux.strategies > csrc/runtime/strategies.h`:
// do not edit (tests/test_strategies.py checks that it is current).
#pragma once
#include <cstdint>

namespace flux {

enum class OpKind : int64_t { AgGemm = 0, GemmRs = 1 };
enum class StrategyKind : int64_t { Sequential = 0, Decomposed = 1, Oneshot = 2, Fused = 3, DecomposedP2P = 4 };
constexpr int64_t kNumOps = 2;
constexpr int64_t kNumStrategies = 5;
constexpr const char* kOpNames[] = {"ag_gemm", "gemm_rs"};
constexpr const char* kStrategyNames[] = {"sequential", "decomposed", "oneshot", "fused", "decomposed_p2p"};
// The parameter vector of Runtime::make_plan, in this order, with these defaults.
constexpr int64_t kNumPlanParams = 6;
constexpr const char* kPlanParamNames[] = {"first8", "chunks", "segments", "config", "swizzle", "raster"};
constexpr int64_t kPlanParamDefaults[] = {8, 1, 8, 0, 0, 1};
// Signal pad channels (flux/runtime/symm.py sizes the pads from the last one).
constexpr int kBarrierChannel = 0;
constexpr int kDataChannel = 1;
constexpr int kFlagChannel = 8;
constexpr int kStartedChannel = 9;
constexpr int kSegmentChannel = 10;
constexpr int kMaxDataChannels = kFlagChannel - kDataChannel;

}  // namespace flux

// X(op, strategy, member): Runtime::member runs the plans of that op and strategy.
#define FLUX_PLAN_STRATEGIES(X) \
  X(AgGemm, Sequential, ag_sequential) \
  X(AgGemm, Decomposed, ag_decomposed) \
  X(AgGemm, Oneshot, ag_oneshot) \
  X(AgGemm, Fused, ag_fused) \
  X(GemmRs, Sequential, rs_sequential) \
  X(GemmRs, Oneshot, rs_oneshot) \
  X(GemmRs, Decomposed, rs_decomposed) \
  X(GemmRs, DecomposedP2P, rs_decomposed_p2p) \
  X(GemmRs, Fused, rs_fused)
