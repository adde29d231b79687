// The shared-memory split of the fused GEMMs between the mainloop's stages and the TMA epilogue's store
// buffers (csrc/common/fused_gemm.cuh EpiPick), per configuration and output dtype: a compile-time fact,
// printed on the host, no GPU needed (docs/performance.md, "Not yet measured": fp32 output).
//
// Built and run (CUTLASS and torch headers from the pip packages, as setup.py finds them; about a minute):
//   SP=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
//   nvcc -std=c++20 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -Icsrc \
//     -isystem $SP/cutlass_library/source/include -isystem $SP/cutlass_library/source/tools/util/include \
//     -isystem $SP/torch/include -isystem $SP/torch/include/torch/csrc/api/include \
//     -isystem $SP/nvidia/cu13/include bench/probe_epilogue_stages.cu -o /tmp/probe_epilogue_stages \
//     -L$SP/torch/lib -lc10 -ltorch_cpu -Xlinker -rpath=$SP/torch/lib && /tmp/probe_epilogue_stages
#define FLUX_WITH_SM90 1
#define FLUX_AG_FUSED_IMPL 1
#define FLUX_RS_FUSED_IMPL 1
#include <cstdio>

#include "ag_gemm/ag_gemm_fused.cuh"
#include "gemm_rs/rs_fused.cuh"

using namespace flux;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CoopE = cutlass::epilogue::TmaWarpSpecializedCooperative;
using PP = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PPE = cutlass::epilogue::TmaWarpSpecialized;

template <class G>
void show(const char* name) {
  using P = typename G::EpiPick;
  std::printf("%-30s subtiles %2d  store buffers %d  mainloop stages %d  epilogue smem %6zu B\n", name, P::kSubtiles,
              P::kStagesD, static_cast<int>(G::CollectiveMainloop::DispatchPolicy::Stages),
              sizeof(typename G::CollectiveEpilogue::SharedStorage));
}

#define TILE(tm, tn) cute::Shape<cute::_##tm, cute::_##tn, cute::_64>
#define CLUSTER(a, b) cute::Shape<cute::_##a, cute::_##b, cute::_1>
int main() {
  // AG configurations built with fp32 output (flux/fused_configs.py), in both output dtypes.
  show<AgGemm<kBf16, TILE(128, 256), CLUSTER(2, 1), Coop, CoopE>>("AG 0  128x256 coop 2x1 bf16");
  show<AgGemm<kBf16Fp32, TILE(128, 256), CLUSTER(2, 1), Coop, CoopE>>("AG 0  128x256 coop 2x1 fp32");
  show<AgGemm<kBf16, TILE(128, 128), CLUSTER(2, 1), PP, PPE>>("AG 2  128x128 pp 2x1 bf16");
  show<AgGemm<kBf16Fp32, TILE(128, 128), CLUSTER(2, 1), PP, PPE>>("AG 2  128x128 pp 2x1 fp32");
  show<AgGemm<kBf16, TILE(128, 160), CLUSTER(2, 1), Coop, CoopE>>("AG 25 128x160 coop 2x1 bf16");
  show<AgGemm<kBf16Fp32, TILE(128, 160), CLUSTER(2, 1), Coop, CoopE>>("AG 25 128x160 coop 2x1 fp32");
  show<AgGemm<kBf16, TILE(128, 96), CLUSTER(2, 1), Coop, CoopE>>("AG 29 128x96 coop 2x1 bf16");
  show<AgGemm<kBf16Fp32, TILE(128, 96), CLUSTER(2, 1), Coop, CoopE>>("AG 29 128x96 coop 2x1 fp32");
  // RS 3, the RS configuration built with fp32 output (its source, the peer's partial, in the output dtype).
  show<RsFoldGemm<kBf16, TILE(128, 128), CLUSTER(1, 1), Coop, CoopE>>("RS 3  128x128 coop 1x1 bf16");
  show<RsFoldGemm<kBf16Fp32, TILE(128, 128), CLUSTER(1, 1), Coop, CoopE>>("RS 3  128x128 coop 1x1 fp32");
  return 0;
}
