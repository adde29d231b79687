// The one place where flux's CUDA kernels are registered with the dispatcher.
// Schemas carry alias annotations: Tensor(a!) is written in place and returned as nothing.
// The public ops (flux::ag_gemm, flux::gemm_rs) are defined in Python (flux/ops/) so that
// they exist, with their reference implementations, also where this extension is not built.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(flux, m) {
  m.def("reduce_chunks_(Tensor(a!) out, Tensor partials, Tensor? bias) -> ()");
  // ptrs_dev: device address of the W ranks' symmetric buffer bases (csrc/reduce/reduce_chunks.cu).
  m.def("reduce_peers_(Tensor(a!) out, int ptrs_dev, int world, int offset_bytes, Tensor? bias) -> ()");
  // Signals on symmetric-workspace signal pads (csrc/runtime/signals.cu). The pads are
  // written by peers, so they are marked as mutated.
  m.def("signal_barrier_(Tensor(a!) own_pad, int pads_dev, int channel, int rank, int world, int timeout_ms) -> ()");
  m.def("signal_put_(Tensor(a!) peer_pad, int channel, int rank, int peer, int world, int timeout_ms) -> ()");
  m.def("signal_wait_(Tensor(a!) own_pad, int channel, int rank, int peer, int world, int timeout_ms) -> ()");
}

TORCH_LIBRARY_IMPL(flux, CUDA, m) {
  m.impl("reduce_chunks_", &flux::reduce_chunks_);
  m.impl("reduce_peers_", &flux::reduce_peers_);
  m.impl("signal_barrier_", &flux::signal_barrier_);
  m.impl("signal_put_", &flux::signal_put_);
  m.impl("signal_wait_", &flux::signal_wait_);
}
