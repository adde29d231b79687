// What does a kernel launch cost on the GPU, by the size of its parameters, its cluster and
// programmatic dependent launch, in a CUDA graph and in a loop? (docs/performance.md §9: at 256-1024
// rows the fused kernels pay a fixed cost per launch under graphs that cuBLAS's kernels do not; theirs
// take 1,904 bytes of parameters.) Built and run by bench/probe_launch.py.
//
// A kernel of `ctas` CTAs of 128 threads spins `spin` cycles and reads one byte of its by-value
// parameter block of BYTES bytes (64, 512, 1024, 2048 or 4096); launched with a cluster of 1 or 2 CTAs,
// with or without the programmatic-stream-serialization attribute (the kernel then waits for the grid
// before it, griddepcontrol.wait, as the fused kernels do).
//
//   probe_launch [--calls N] [--reps R] [--ctas C] bytes:cluster:pdl:spin [...]
//
// Prints one JSON line per variant: its fields and the median µs per call over R samples of N
// back-to-back calls, "graph" (the N calls captured once and replayed) and "loop" (enqueued eagerly).
#include <cuda_runtime.h>

#define PROBE_NAME "probe_launch"
#include "probe_check.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

template <int Bytes>
struct Blob {
  unsigned char b[Bytes];
};

template <int Bytes>
__global__ void __launch_bounds__(128) spin_kernel(const __grid_constant__ Blob<Bytes> blob, long long spin,
                                                   float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const long long t0 = clock64();
  while (clock64() - t0 < spin) {
  }
  if (threadIdx.x == 0) out[blockIdx.x] = blob.b[blockIdx.x % Bytes];
}

struct Variant {
  int bytes = 64, cluster = 1, pdl = 0;
  long long spin = 0;
};

template <int Bytes>
void launch(const Variant& v, int ctas, float* out, cudaStream_t s) {
  static Blob<Bytes> blob = [] {
    Blob<Bytes> b;
    for (int i = 0; i < Bytes; ++i) b.b[i] = static_cast<unsigned char>(i);
    return b;
  }();
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(128);
  cfg.stream = s;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (v.cluster > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = v.cluster;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (v.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = n;
  CHECK(cudaLaunchKernelEx(&cfg, spin_kernel<Bytes>, blob, v.spin, out));
}

void launch_any(const Variant& v, int ctas, float* out, cudaStream_t s) {
  switch (v.bytes) {
    case 64: launch<64>(v, ctas, out, s); break;
    case 512: launch<512>(v, ctas, out, s); break;
    case 1024: launch<1024>(v, ctas, out, s); break;
    case 2048: launch<2048>(v, ctas, out, s); break;
    default: launch<4096>(v, ctas, out, s); break;
  }
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 20, reps = 30, ctas = 132;
  std::vector<Variant> vs;
  for (int i = 1; i < argc; ++i) {
    if (int_flag(argc, argv, i, "--calls", &calls) || int_flag(argc, argv, i, "--reps", &reps) ||
        int_flag(argc, argv, i, "--ctas", &ctas)) {
      continue;
    }
    Variant v;
    if (std::sscanf(argv[i], "%d:%d:%d:%lld", &v.bytes, &v.cluster, &v.pdl, &v.spin) != 4 ||
        (v.bytes != 64 && v.bytes != 512 && v.bytes != 1024 && v.bytes != 2048 && v.bytes != 4096) ||
        (v.cluster != 1 && v.cluster != 2) || v.spin < 0) {
      std::fprintf(stderr, "probe_launch: bad variant %s (bytes:cluster:pdl:spin; bytes 64-4096, cluster 1|2)\n",
                   argv[i]);
      return 2;
    }
    vs.push_back(v);
  }
  if (vs.empty() || calls < 1 || reps < 1 || ctas < 2 || ctas % 2) {
    std::fprintf(stderr, "usage: probe_launch [--calls N] [--reps R] [--ctas C (even)] bytes:cluster:pdl:spin ...\n");
    return 2;
  }
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float* out;
  CHECK(cudaMalloc(&out, ctas * sizeof(float)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (const Variant& v : vs) {
    auto sample = [&](auto&& body) {
      CHECK(cudaEventRecord(e0, s));
      body();
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return 1000.0 * ms / calls;
    };
    auto loop = [&] {
      for (int c = 0; c < calls; ++c) launch_any(v, ctas, out, s);
    };
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    loop();
    CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t ge;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    auto replay = [&] { CHECK(cudaGraphLaunch(ge, s)); };
    for (int w = 0; w < 3; ++w) {
      loop();
      replay();
    }
    CHECK(cudaStreamSynchronize(s));
    std::vector<double> tg, tl;
    for (int r = 0; r < reps; ++r) {
      tg.push_back(sample(replay));
      tl.push_back(sample(loop));
    }
    std::printf("{\"bytes\": %d, \"cluster\": %d, \"pdl\": %d, \"spin\": %lld, \"ctas\": %d, \"calls\": %d, "
                "\"us\": {\"graph\": %.3f, \"loop\": %.3f}}\n",
                v.bytes, v.cluster, v.pdl, v.spin, ctas, calls, median(tg), median(tl));
    std::fflush(stdout);
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
  }
  return 0;
}
