// Where the CTAs of clustered launches run: the data from which flux/autotune/placement.py learns
// which SMs share a GPC. The CTAs of one thread-block cluster always run in one GPC, so grids of
// clusters of one CTA per SM (each CTA asks for all the shared memory an SM has), each CTA writing
// its %smid, group the SMs by GPC as far as the clusters reach. A cluster of 16 (where the GPU allows
// that size) covers most of a GPC at once; smaller ones join what is left.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"

namespace flux {
namespace {

__global__ void record_sm_kernel(int32_t* out) {
  if (threadIdx.x == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    out[blockIdx.x] = static_cast<int32_t>(sm);
  }
}

}  // namespace

at::Tensor cluster_sms(int64_t cluster, int64_t rounds, int64_t device) {
  constexpr const char* op = "cluster_sms";
  FLUX_CHECK(cluster >= 1 && cluster <= 16, op, "the cluster size must be 1 to 16 CTAs, got ", cluster);
  FLUX_CHECK(rounds >= 1 && rounds <= 64, op, "rounds must be 1 to 64, got ", rounds);
  FLUX_CHECK(device >= 0 && device < at::cuda::device_count(), op, "no CUDA device ", device);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int dev = static_cast<int>(device);
  FLUX_CHECK(device_major(dev) >= 9, op, "thread-block clusters need compute capability 9.0 or later (device ",
             dev, " is ", device_major(dev), ".x)");
  int smem = 0;
  FLUX_CUDA(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  FLUX_CUDA(cudaFuncSetAttribute(record_sm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // A size this GPU cannot launch (above 8 where non-portable sizes are not allowed) reads as no
  // cluster fitting: the error is cleared here, not left for the next launch check to find.
  cudaError_t err = cudaSuccess;
  if (cluster > 8) err = cudaFuncSetAttribute(record_sm_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(cluster));
  cfg.blockDim = dim3(32);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = at::cuda::getCurrentCUDAStream(dev).stream();
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveClusters(&clusters, record_sm_kernel, &cfg);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
  FLUX_CHECK(clusters > 0, op, "no cluster of ", cluster, " CTAs of one SM each fits device ", dev);
  const int64_t grid = int64_t(clusters) * cluster;
  at::Tensor out = at::full({rounds, grid}, -1, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, dev));
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  for (int64_t r = 0; r < rounds; ++r) {
    FLUX_CUDA(cudaLaunchKernelEx(&cfg, record_sm_kernel, out.data_ptr<int32_t>() + r * grid));
  }
  FLUX_CHECK_LAUNCH();
  return out;
}

}  // namespace flux
