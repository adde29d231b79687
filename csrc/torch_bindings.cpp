// The one place where flux's CUDA kernels are registered with the dispatcher.
// Schemas carry alias annotations: Tensor(a!) is written in place and returned as nothing.
// The public ops (flux::ag_gemm, flux::gemm_rs) are defined in Python (flux/ops/) so that
// they exist, with their reference implementations, also where this extension is not built.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(flux, m) {
  m.def("reduce_chunks_(Tensor(a!) out, Tensor partials, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(flux, CUDA, m) {
  m.impl("reduce_chunks_", &flux::reduce_chunks_);
}
