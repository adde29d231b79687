// A bounded wait on a level flag inside a fused GEMM kernel (csrc/ag_gemm/ag_tile_scheduler.hpp,
// csrc/gemm_rs/rs_fused.cuh).
//
// The flag is set by a peer's stream after a copy-engine transfer completed
// (cuStreamWriteValue32, flux::Runtime::write_slot), so the
// acquire load that sees it non-zero orders the transferred data before whatever this thread
// reads next. Data read afterwards by TMA (the async proxy) additionally needs
// fence.proxy.async, which the callers issue.
//
// On timeout there is no printf: a function call in a wgmma kernel serializes its pipeline
// (ptxas C7510). The waiting and the missing rank go to host-mapped memory instead, which
// the host can still read once the trap has failed the context
// (flux.runtime.symm.timeout_report()).
#pragma once

#include <cstdint>

#include "common/sync.cuh"  // ld_acquire_sys, globaltimer_ns (its printing timed_out is not called here)

namespace flux {

__device__ __forceinline__ void wait_flag_bounded(const uint32_t* flag, uint64_t timeout_ns, uint32_t* error,
                                                  int waiting_rank, int missing_rank) {
  if (ld_acquire_sys(flag) != 0) return;
  const uint64_t start = globaltimer_ns();
  while (true) {
    __nanosleep(64);
    if (ld_acquire_sys(flag) != 0) return;
    const uint64_t now = globaltimer_ns();
    if (timeout_ns != 0 && now - start > timeout_ns) {
      if (error != nullptr) {
        error[1] = (uint32_t)missing_rank;
        __threadfence_system();
        error[0] = (uint32_t)waiting_rank + 1u;
        __threadfence_system();
      }
      __trap();
    }
  }
}

// After the acquire loads above, before TMA reads the data they announced.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

}  // namespace flux
