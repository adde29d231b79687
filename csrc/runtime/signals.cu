// Stream-ordered signals between the ranks of a group, on the signal pads of a symmetric
// workspace (flux/runtime/symm.py lists the channels), launched by flux::Runtime (runtime.cpp).
// Each pad is a [channel][source rank] matrix of uint32 slots. A data slot is a one-shot,
// self-resetting flag: put (source) is a stream write of 1 (cuStreamWriteValue32, no SM;
// Runtime::write_slot); wait (destination) spins until slot == 1 with acquire semantics, then
// stores 0. The put's memory fence pairs with that acquire load: whatever the source's stream wrote
// before the put is visible to what the destination's stream runs after the wait. Nothing is reset
// between calls: every put of a call follows the call's entry barrier, which the destination
// reaches only after the wait that consumed the previous call's signal.
// The entry barrier carries the call's token (a non-zero hash of the problem) instead of 1: a rank
// that finds another token knows its peer made another call, records both in the host-mapped error
// record, prints them and traps. Every wait is bounded: past its timeout the kernel prints which
// rank it was waiting for and traps, so a missing peer is an error instead of a hang.
#include <ATen/cuda/CUDAContext.h>

#include "common/check.h"
#include "common/sync.cuh"
#include "runtime/runtime.h"

namespace flux {
namespace {

// The token's top two bits name the op (flux/ops/_plans.py): 1 ag_gemm, 2 gemm_rs, 3 the MoE ops
// (moe_dispatch / moe_combine and the tensor-parallel MoE ops; flux/ops/moe/symm.py: _token).
__device__ __forceinline__ const char* op_of(uint32_t token) {
  switch (token >> 30) {
    case 1: return "flux.ag_gemm";
    case 2: return "flux.gemm_rs";
    case 3: return "a flux MoE op";
    default: return "a flux op";
  }
}

// One thread per peer: our token into our slot on the peer's pad, then the peer's into ours.
// started (or null): a slot of this rank's own pad set to 1 as soon as the kernel runs, so
// that another stream can wait for the barrier to hold an SM (wait_kernel on that slot)
// instead of waiting for the whole barrier (docs/design.md, "the entry barrier").
__global__ void barrier_kernel(uint32_t** pads, int channel, int rank, int world, uint64_t timeout_ms,
                               uint32_t* started, uint32_t token, uint32_t* error) {
  const int peer = threadIdx.x;
  if (started != nullptr && peer == 0) {
    // The waiter's wait_kernel consumes this slot: wait until it consumed the last one.
    bounded_wait(started, 0u, true, timeout_ms, "barrier (started)", rank, rank, -1);
    st_relaxed_sys(started, 1u);
  }
  if (peer >= world || peer == rank) return;
  uint32_t* remote = pads[peer] + channel * world + rank;
  bounded_wait(remote, 0u, true, timeout_ms, "barrier (put)", rank, peer, channel);
  __threadfence_system();  // earlier kernels' stores (e.g. a GEMM into the workspace) before the token
  st_release_sys(remote, token);
  uint32_t* local = pads[rank] + channel * world + peer;
  const uint32_t theirs = bounded_wait(local, 0u, false, timeout_ms, "barrier (wait)", rank, peer, channel);
  st_relaxed_sys(local, 0u);
  if (theirs != token) {
    if (error != nullptr) {
      error[2] = 1u;  // kind: the ranks' calls differ
      error[3] = theirs;
      error[4] = token;
      error[1] = (uint32_t)peer;
      __threadfence_system();
      error[0] = (uint32_t)rank + 1u;
      __threadfence_system();
    }
    printf("flux: rank %d and rank %d made different flux calls (%s, problem %08x here; %s, problem %08x on "
           "rank %d): every rank of a group must make the same calls with the same shapes, dtypes and options\n",
           rank, peer, op_of(token), token, op_of(theirs), theirs, peer);
    __trap();
  }
}

__global__ void wait_kernel(uint32_t* local_slot, int channel, int rank, int peer, uint64_t timeout_ms) {
  bounded_wait(local_slot, 1u, true, timeout_ms, "signal wait", rank, peer, channel);
  st_relaxed_sys(local_slot, 0u);
}

}  // namespace

void launch_barrier(uint32_t** pads_dev, int channel, int rank, int world, uint64_t timeout_ms, uint32_t* started,
                    uint32_t token, uint32_t* error_record, cudaStream_t stream) {
  if (world == 1) return;
  const int threads = (world + 31) / 32 * 32;
  barrier_kernel<<<1, threads, 0, stream>>>(pads_dev, channel, rank, world, timeout_ms, started, token,
                                            error_record);
  FLUX_CHECK_LAUNCH();
}

void launch_wait(uint32_t* slot, int channel, int rank, int peer, uint64_t timeout_ms, cudaStream_t stream) {
  wait_kernel<<<1, 1, 0, stream>>>(slot, channel, rank, peer, timeout_ms);
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux
