// Device-side pieces of flux's signals, shared by the signal kernels (csrc/runtime/signals.cu)
// and the MoE kernels (csrc/moe/moe_bounded.cu): system-scope acquire loads and release stores on
// uint32 slots of the symmetric signal pads, and the one bounded wait. Past its timeout a wait
// prints which rank it was waiting for and traps, so a missing peer becomes an error on the
// waiting rank instead of a hang.
#pragma once

#include <cstdint>
#include <cstdio>

namespace flux {

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

__device__ __noinline__ inline void timed_out(const char* what, int rank, int peer, int channel, uint64_t timeout_ms) {
  printf("flux: rank %d timed out after %llu ms in %s waiting for rank %d (channel %d); "
         "rank %d did not make the same flux call\n",
         rank, (unsigned long long)timeout_ms, what, peer, channel, peer);
  __trap();
}

// Spin until (*slot == want) == equal, acquire, bounded by timeout_ms (0: no bound). Returns the
// value seen.
__device__ __forceinline__ uint32_t bounded_wait(const uint32_t* slot, uint32_t want, bool equal,
                                                 uint64_t timeout_ms, const char* what, int rank, int peer,
                                                 int channel) {
  const uint64_t start = globaltimer_ns();
  uint32_t spins = 0;
  while (true) {
    const uint32_t v = ld_acquire_sys(slot);
    if ((v == want) == equal) return v;
    if (++spins % 1024 == 0 && timeout_ms != 0 && globaltimer_ns() - start > timeout_ms * 1000000ull) {
      timed_out(what, rank, peer, channel, timeout_ms);
    }
  }
}

}  // namespace flux
