// What lets the L2 request coalescer merge the TMA loads of CTAs that read the same tile rows?
// (docs/performance.md §9, "Same tile, more L2 reads".) Built and run by bench/probe_l2_coalescing.py.
//
// One wave of CTAs, each the A side of a GEMM's mainloop: a producer thread loads 64-row x 64-column
// bf16 boxes of A (one stage of a 64-row tile, 128-byte swizzle, as the fused kernels' A loads) along
// K into a ring of STAGES shared-memory stages; a consumer thread takes each stage, holds it `delay`
// cycles (the MMA time it stands for) and frees it. `group` consecutive CTAs read the same rows (the
// N tiles of one tile row of A); all CTAs start together (a grid-wide barrier, every CTA resident in
// one wave), and CTA j of a group runs its K loop rotated by j * `stagger` boxes, so that it reaches
// each box that many steps before CTA 0 (0: the group's CTAs load each box together). Each load carries the L2 cache-policy
// operand `policy` (0: none; CUTLASS's evict-normal 0x1000000000000000), and the tensor map the L2
// promotion `promotion` (0, 64, 128 or 256 bytes).
//
// Optional fields: `spread` 1 puts the CTAs sharing rows C/group apart in launch order (other SMs and
// GPCs) instead of consecutive; `barrier` 0 starts each CTA's K loop when it is dispatched instead of at
// the grid-wide barrier; `cluster` 2 launches clusters of 2 CTAs, the two reading different rows (as the
// two M tiles of a 2x1 cluster) and `group` then counting clusters: the CTA of rank r in cluster q reads
// row tile (q / group) * 2 + r (spread: (q mod Q/group) * 2 + r), so that the CTAs sharing rows are in
// different clusters, as in the fused kernels with a 2x1 cluster. `sched` (after cluster) is the launch's
// cluster scheduling policy: 0 the driver's default, 1 spread (as cuBLAS's launches ask), 2 load
// balancing. Each CTA records its SM and when it began its K loop.
//
//   probe_l2_coalescing [--reps N] [--once] group:stagger:delay:policy:promotion[:spread:barrier[:cluster[:sched]]] [...]
//
// Prints one JSON line per variant: its fields, CTAs, rows, K, and the median ms of `reps` timed
// launches (CUDA events, after warm-up). --once: one warm-up and one launch per variant, no timing
// (the launches an Nsight Compute run profiles). Every wait is bounded: past ~2 s of cycles the
// waiting thread records its CTA and what it waited for (a stage's barrier, or the start barrier
// where the CTAs do not fit in one wave) and traps.
#include <cuda.h>
#include <cuda_runtime.h>

#define PROBE_NAME "probe_l2_coalescing"
#include "probe_check.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kBoxRows = 64, kBoxK = 64;           // bf16: 64 rows of 128 bytes
constexpr int kStages = 10;
constexpr int kStageBytes = kBoxRows * kBoxK * 2;  // 8 KiB
constexpr unsigned long long kTimeoutCycles = 4000000000ull;

struct Params {
  int k_blocks;
  int group;
  int stagger;
  int delay;
  unsigned long long policy;
  unsigned int* error;  // [3]: 1 + CTA, stage, which barrier (0 full, 1 empty, 2 the start)
  unsigned int* arrived;  // the start barrier's count, never reset: this launch waits for `target`
  unsigned int target;
  int spread;   // 1: CTAs i, i + C/group, ... share rows (row tile i mod C/group) instead of consecutive ones
  int barrier;  // 1: all CTAs start their K loops together; 0: each as it is dispatched
  int cluster;  // CTAs per cluster (1 or 2): `group` and `spread` then apply to clusters
  float* sink;
  unsigned int* smid;            // [C]: the SM each CTA ran on
  unsigned long long* start_ns;  // [C]: %globaltimer when each CTA began its K loop
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void timed_out(const Params& p, int stage, int which) {
  if (atomicCAS(p.error, 0u, 1u + blockIdx.x) == 0u) {
    p.error[1] = stage;
    p.error[2] = which;
    __threadfence_system();
  }
  __trap();
}

__device__ __forceinline__ void bounded_wait(uint64_t* bar, uint32_t parity, const Params& p, int stage, int which) {
  const uint32_t a = smem_addr(bar);
  const unsigned long long t0 = clock64();
  while (true) {
    uint32_t done;
    asm volatile(
        "{\n .reg .pred r;\n mbarrier.try_wait.parity.shared::cta.b64 r, [%1], %2;\n selp.u32 %0, 1, 0, r;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
    if (done) return;
    if (clock64() - t0 > kTimeoutCycles) timed_out(p, stage, which);
  }
}

__global__ void __launch_bounds__(64) probe_kernel(const __grid_constant__ CUtensorMap tmap, Params p) {
  extern __shared__ unsigned char raw[];
  // The 128-byte swizzle wants 1024-byte aligned stages.
  unsigned char* stages = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&empty[s])));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    // The start barrier: every CTA of the launch arrives, then all begin their K loops together.
    atomicAdd(p.arrived, 1u);
    const unsigned long long t0 = clock64();
    while (p.barrier && atomicAdd(p.arrived, 0u) < p.target) {
      if (clock64() - t0 > kTimeoutCycles) timed_out(p, 0, 2);
    }
    unsigned int sm;
    unsigned long long ns;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    p.smid[blockIdx.x] = sm;
    p.start_ns[blockIdx.x] = ns;
  }
  __syncthreads();
  // Unit u (a CTA, or a cluster of p.cluster CTAs whose rank r reads its own rows) shares its rows with
  // the units of its group.
  const int units = gridDim.x / p.cluster, u = blockIdx.x / p.cluster, r = blockIdx.x % p.cluster;
  const int row_groups = (units + p.group - 1) / p.group;
  const int row0 = ((p.spread ? u % row_groups : u / p.group) * p.cluster + r) * kBoxRows;
  const int shift = (p.spread ? u / row_groups : u % p.group) * p.stagger;
  if (threadIdx.x == 0) {  // producer
    for (int i = 0; i < p.k_blocks; ++i) {
      const int s = i % kStages;
      const uint32_t use = i / kStages;
      if (use > 0) bounded_wait(&empty[s], (use - 1) & 1, p, s, 1);
      const uint32_t bar = smem_addr(&full[s]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kStageBytes) : "memory");
      const int k0 = ((i + shift) % p.k_blocks) * kBoxK;
      const uint32_t dst = smem_addr(stages + s * kStageBytes);
      if (p.policy) {
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
            "l"(&tmap), "r"(k0), "r"(row0), "r"(bar), "l"(p.policy)
            : "memory");
      } else {
        asm volatile(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
            "l"(&tmap), "r"(k0), "r"(row0), "r"(bar)
            : "memory");
      }
    }
  } else if (threadIdx.x == 32) {  // consumer
    float acc = 0.f;
    for (int i = 0; i < p.k_blocks; ++i) {
      const int s = i % kStages;
      bounded_wait(&full[s], (i / kStages) & 1, p, s, 0);
      acc += static_cast<float>(stages[s * kStageBytes + (i * 129) % kStageBytes]);
      const unsigned long long t = clock64();
      while (clock64() - t < static_cast<unsigned long long>(p.delay)) {
      }
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(&empty[s])) : "memory");
    }
    p.sink[blockIdx.x] = acc;
  }
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

CUtensorMap make_map(void* a, int rows, int k, int promotion) {
  static EncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !fn) {
      std::fprintf(stderr, "probe_l2_coalescing: no cuTensorMapEncodeTiled in the driver\n");
      std::exit(2);
    }
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  CUtensorMapL2promotion promo = promotion == 0    ? CU_TENSOR_MAP_L2_PROMOTION_NONE
                                 : promotion == 64 ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                                 : promotion == 256 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                                    : CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k) * 2};
  const cuuint32_t box[2] = {kBoxK, kBoxRows};
  const cuuint32_t elem[2] = {1, 1};
  CUresult r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, a, dims, strides, box, elem,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "probe_l2_coalescing: cuTensorMapEncodeTiled failed (%d)\n", int(r));
    std::exit(2);
  }
  return m;
}

struct Variant {
  int group = 8, stagger = 0, delay = 0, promotion = 128, spread = 0, barrier = 1, cluster = 1, sched = 0;
  unsigned long long policy = 0;
};

bool parse(const char* s, Variant& v) {
  const int n = std::sscanf(s, "%d:%d:%d:%llx:%d:%d:%d:%d:%d", &v.group, &v.stagger, &v.delay, &v.policy,
                            &v.promotion, &v.spread, &v.barrier, &v.cluster, &v.sched);
  return (n == 5 || n == 7 || n == 8 || n == 9) && v.group >= 1 && (v.cluster == 1 || v.cluster == 2) &&
         v.sched >= 0 && v.sched <= 2 && v.stagger >= 0 &&
         v.delay >= 0 && (v.spread | v.barrier) <= 1 &&
         v.spread >= 0 && v.barrier >= 0 &&
         (v.promotion == 0 || v.promotion == 64 || v.promotion == 128 || v.promotion == 256);
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 50, ctas = 128, k = 4096;
  bool once = false;
  std::vector<Variant> vs;
  for (int i = 1; i < argc; ++i) {
    if (int_flag(argc, argv, i, "--reps", &reps) || int_flag(argc, argv, i, "--ctas", &ctas) ||
        int_flag(argc, argv, i, "--k", &k)) {
      continue;
    }
    if (!std::strcmp(argv[i], "--once")) {
      once = true;
    } else {
      Variant v;
      if (!parse(argv[i], v)) {
        std::fprintf(stderr, "probe_l2_coalescing: bad variant %s (group:stagger:delay:policy_hex:promotion[:spread:barrier[:cluster[:sched]]])\n", argv[i]);
        return 2;
      }
      vs.push_back(v);
    }
  }
  if (vs.empty() || k % kBoxK || reps < 1 || ctas < 1) {
    std::fprintf(stderr, "usage: probe_l2_coalescing [--reps N] [--ctas C] [--k K] [--once] g:s:d:policy:promo[:spread:barrier[:cluster[:sched]]] ...\n");
    return 2;
  }
  const int smem = kStages * kStageBytes + 1024;
  CHECK(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  unsigned int* error;
  CHECK(cudaHostAlloc(&error, 3 * sizeof(unsigned int), cudaHostAllocMapped));
  float* sink;
  CHECK(cudaMalloc(&sink, ctas * sizeof(float)));
  unsigned int* smid;
  CHECK(cudaMalloc(&smid, ctas * sizeof(unsigned int)));
  unsigned long long* start_ns;
  CHECK(cudaMalloc(&start_ns, ctas * sizeof(unsigned long long)));
  std::vector<unsigned int> smid_h(ctas);
  std::vector<unsigned long long> start_h(ctas);
  unsigned int* arrived;
  CHECK(cudaMalloc(&arrived, sizeof(unsigned int)));
  CHECK(cudaMemset(arrived, 0, sizeof(unsigned int)));
  unsigned int launches = 0;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  // A failed wait traps: the sticky error then surfaces at the next synchronisation, reported here
  // with what the CTA waited for.
  auto synced = [&](cudaError_t err) {
    if (err == cudaSuccess) return;
    const char* what[] = {"its full barrier", "its empty barrier", "the start barrier (not one wave?)"};
    std::fprintf(stderr, "probe_l2_coalescing: %s; CTA %d timed out at stage %u waiting on %s\n",
                 cudaGetErrorString(err), int(error[0]) - 1, error[1], error[0] ? what[error[2] % 3] : "nothing");
    std::exit(3);
  };
  for (const Variant& v : vs) {
    if (ctas % v.cluster) {
      std::fprintf(stderr, "probe_l2_coalescing: --ctas %d is not whole clusters of %d\n", ctas, v.cluster);
      return 2;
    }
    const int rows = (ctas / v.cluster + v.group - 1) / v.group * v.cluster * kBoxRows;
    void* a;
    CHECK(cudaMalloc(&a, size_t(rows) * k * 2));
    CHECK(cudaMemset(a, 0x3c, size_t(rows) * k * 2));
    const CUtensorMap map = make_map(a, rows, k, v.promotion);
    std::memset(error, 0, 3 * sizeof(unsigned int));
    unsigned int* error_dev;
    CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev), error, 0));
    Params p{k / kBoxK, v.group, v.stagger, v.delay, v.policy, error_dev, arrived, 0u, v.spread, v.barrier,
             v.cluster, sink, smid, start_ns};
    auto launch = [&] {
      p.target = ++launches * unsigned(ctas);
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(ctas);
      cfg.blockDim = dim3(64);
      cfg.dynamicSmemBytes = smem;
      cudaLaunchAttribute attr[2];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = v.cluster;
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      attr[1].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
      attr[1].val.clusterSchedulingPolicyPreference =
          v.sched == 1 ? cudaClusterSchedulingPolicySpread
                       : v.sched == 2 ? cudaClusterSchedulingPolicyLoadBalancing : cudaClusterSchedulingPolicyDefault;
      cfg.attrs = attr;
      cfg.numAttrs = v.sched ? 2 : 1;
      CHECK(cudaLaunchKernelEx(&cfg, probe_kernel, map, p));
    };
    std::vector<float> ms;
    for (int w = 0; w < (once ? 1 : 5); ++w) launch();
    synced(cudaDeviceSynchronize());
    if (once) {
      launch();
    } else {
      for (int r = 0; r < reps; ++r) {
        CHECK(cudaEventRecord(e0));
        launch();
        CHECK(cudaEventRecord(e1));
        synced(cudaEventSynchronize(e1));
        float t;
        CHECK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
    }
    synced(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(smid_h.data(), smid, ctas * sizeof(unsigned int), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(start_h.data(), start_ns, ctas * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    const unsigned long long t_first = *std::min_element(start_h.begin(), start_h.end());
    std::string sms, starts;
    for (int c = 0; c < ctas; ++c) {
      sms += (c ? ", " : "") + std::to_string(smid_h[c]);
      starts += (c ? ", " : "") + std::to_string(start_h[c] - t_first);
    }
    std::sort(ms.begin(), ms.end());
    // smid / start_ns: the last launch's SM and K-loop start (ns after the first CTA's) per CTA.
    std::printf(
        "{\"group\": %d, \"stagger\": %d, \"delay\": %d, \"policy\": \"0x%llx\", \"promotion\": %d, \"spread\": %d, "
        "\"barrier\": %d, \"cluster\": %d, \"sched\": %d, \"ctas\": %d, \"rows\": %d, \"k\": %d, \"ms\": %s, \"smid\": [%s], "
        "\"start_ns\": [%s]}\n",
        v.group, v.stagger, v.delay, v.policy, v.promotion, v.spread, v.barrier, v.cluster, v.sched, ctas, rows, k,
        ms.empty() ? "null" : std::to_string(ms[ms.size() / 2]).c_str(), sms.c_str(), starts.c_str());
    std::fflush(stdout);
    CHECK(cudaFree(a));
  }
  return 0;
}
