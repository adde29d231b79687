// Stream-ordered signals between the ranks of a group, on the signal pads of a symmetric
// workspace (flux/runtime/symm.py). Every wait is bounded: past its timeout the kernel
// prints which rank it was waiting for and traps, so a missing peer becomes an error on
// the waiting rank instead of a hang.
//
// Each pad is a [channel][source rank] matrix of uint32 slots. A slot is a one-shot,
// self-resetting flag:
//
//   put  (on the source):      store 1. The strategies put with a stream write
//                              (cuStreamWriteValue32, whose memory fence orders the stream's
//                              earlier writes first; flux/runtime/symm.py), which needs no SM;
//                              put_kernel below is the former put, kept for the ablation: it
//                              first waits until slot == 0 (the previous signal was consumed),
//                              then stores 1 with release semantics at system scope;
//   wait (on the destination): wait until slot == 1 with acquire semantics, then store 0.
//
// Nothing has to be reset between calls, so signals are race-free across back-to-back
// calls, changes of shape and CUDA-graph replays: every put of a call follows the call's
// entry barrier, which the destination reaches only after the wait that consumed the previous
// call's signal. The put's release (fence) pairs with the acquire load in wait: everything the
// source's stream wrote before the put (a copy-engine transfer finished earlier in stream
// order, a kernel's stores) is visible to whatever the destination's stream runs after the wait.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"

namespace flux {
namespace {

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *slot == want (acquire), bounded by timeout_ms; 0 means no bound.
__device__ __forceinline__ void bounded_wait(const uint32_t* slot, uint32_t want, uint64_t timeout_ms,
                                             const char* what, int rank, int peer, int channel) {
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (ld_acquire_sys(slot) != want) {
    if (++spins % 1024 == 0 && timeout_ms != 0 && globaltimer_ns() - start > timeout_ms * 1000000ull) {
      printf("flux: rank %d timed out after %llu ms in %s waiting for rank %d (channel %d); "
             "rank %d did not make the same flux call\n",
             rank, (unsigned long long)timeout_ms, what, peer, channel, peer);
      __trap();
    }
  }
}

// One thread per peer. put: our slot on the peer's pad; wait: the peer's slot on our pad.
// started (or null): a slot of this rank's own pad set to 1 as soon as the kernel runs, so
// that another stream can wait for the barrier to hold an SM (signal_wait_ on that slot)
// instead of waiting for the whole barrier (docs/design.md, "the entry barrier").
__global__ void barrier_kernel(uint32_t** pads, int channel, int rank, int world, uint64_t timeout_ms,
                               uint32_t* started) {
  const int peer = threadIdx.x;
  if (started != nullptr && peer == 0) {
    // The waiter's wait_kernel polls this slot, put-style: wait until it consumed the last one.
    bounded_wait(started, 0u, timeout_ms, "barrier (started)", rank, rank, -1);
    st_relaxed_sys(started, 1u);
  }
  if (peer >= world || peer == rank) return;
  uint32_t* remote = pads[peer] + channel * world + rank;
  bounded_wait(remote, 0u, timeout_ms, "barrier (put)", rank, peer, channel);
  __threadfence_system();  // earlier kernels' stores (e.g. a GEMM into the workspace) before the flag
  st_release_sys(remote, 1u);
  uint32_t* local = pads[rank] + channel * world + peer;
  bounded_wait(local, 1u, timeout_ms, "barrier (wait)", rank, peer, channel);
  st_relaxed_sys(local, 0u);
}

__global__ void put_kernel(uint32_t* remote_slot, int channel, int rank, int peer, uint64_t timeout_ms) {
  bounded_wait(remote_slot, 0u, timeout_ms, "signal put", rank, peer, channel);
  // Make the writes of this stream's earlier work (kernels) visible system-wide first;
  // copy-engine transfers earlier in the stream have completed before this kernel began.
  __threadfence_system();
  st_release_sys(remote_slot, 1u);
}

__global__ void wait_kernel(uint32_t* local_slot, int channel, int rank, int peer, uint64_t timeout_ms) {
  bounded_wait(local_slot, 1u, timeout_ms, "signal wait", rank, peer, channel);
  st_relaxed_sys(local_slot, 0u);
}

void check_pad(const at::Tensor& pad, const char* op) {
  FLUX_CHECK(pad.is_cuda() && pad.element_size() == 4 && pad.is_contiguous(), op,
             "the signal pad must be a contiguous CUDA tensor of 4-byte elements");
}

}  // namespace

// pads_dev: device address of a uint32_t*[world] array of every rank's signal pad;
// own_pad: this rank's pad (it fixes the device and stream).
// started_channel >= 0: also set this rank's own slot of that channel once the kernel runs.
void signal_barrier_(at::Tensor& own_pad, int64_t pads_dev, int64_t channel, int64_t rank, int64_t world,
                     int64_t timeout_ms, int64_t started_channel) {
  constexpr const char* op = "signal_barrier_";
  check_pad(own_pad, op);
  FLUX_CHECK(world >= 1 && world <= 1024 && rank >= 0 && rank < world, op, "bad rank ", rank, " / world ", world);
  FLUX_CHECK((channel + 1) * world <= own_pad.numel(), op, "channel ", channel, " out of range");
  FLUX_CHECK(started_channel < 0 || (started_channel != channel && (started_channel + 1) * world <= own_pad.numel()),
             op, "started channel ", started_channel, " out of range");
  if (world == 1) return;
  uint32_t* started = started_channel < 0 ? nullptr
                                          : reinterpret_cast<uint32_t*>(own_pad.data_ptr()) + started_channel * world + rank;
  const c10::cuda::CUDAGuard guard(own_pad.device());
  const int threads = ((int)world + 31) / 32 * 32;
  barrier_kernel<<<1, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<uint32_t**>(pads_dev), (int)channel, (int)rank, (int)world, (uint64_t)timeout_ms, started);
  FLUX_CHECK_LAUNCH();
}

// peer_pad: the destination's pad as mapped on this device; slot = channel * world + rank.
void signal_put_(at::Tensor& peer_pad, int64_t channel, int64_t rank, int64_t peer, int64_t world,
                 int64_t timeout_ms) {
  constexpr const char* op = "signal_put_";
  check_pad(peer_pad, op);
  FLUX_CHECK((channel + 1) * world <= peer_pad.numel() && rank < world && peer < world, op, "slot out of range");
  const c10::cuda::CUDAGuard guard(peer_pad.device());
  auto* slot = reinterpret_cast<uint32_t*>(peer_pad.data_ptr()) + channel * world + rank;
  put_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(slot, (int)channel, (int)rank, (int)peer,
                                                            (uint64_t)timeout_ms);
  FLUX_CHECK_LAUNCH();
}

// own_pad: this rank's pad; waits on slot channel * world + peer.
void signal_wait_(at::Tensor& own_pad, int64_t channel, int64_t rank, int64_t peer, int64_t world,
                  int64_t timeout_ms) {
  constexpr const char* op = "signal_wait_";
  check_pad(own_pad, op);
  FLUX_CHECK((channel + 1) * world <= own_pad.numel() && rank < world && peer < world, op, "slot out of range");
  const c10::cuda::CUDAGuard guard(own_pad.device());
  auto* slot = reinterpret_cast<uint32_t*>(own_pad.data_ptr()) + channel * world + peer;
  wait_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(slot, (int)channel, (int)rank, (int)peer,
                                                             (uint64_t)timeout_ms);
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux
