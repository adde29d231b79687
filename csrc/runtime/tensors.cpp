// Tensors made without the dispatcher (views of contiguous tensors, a few host microseconds
// cheaper than narrow()/view()), and the GEMM every strategy runs on them.
#include <ATen/ATen.h>

#include "runtime/runtime.h"

#include <c10/util/strides.h>

#include "common/check.h"

namespace flux {

at::Tensor strided_view(const at::Tensor& t, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(),
                                                   t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset() + offset);
  // Writes through the view count as writes to ``t`` (as through a narrow()).
  impl->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
  return at::Tensor(std::move(impl));
}

at::Tensor output_or_empty(const std::optional<at::Tensor>& out, int64_t rows, int64_t n, const at::Tensor& like,
                           at::ScalarType dtype) {
  return out.has_value() ? out->view({rows, n}) : at::empty({rows, n}, like.options().dtype(dtype));
}

at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t count) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  const int64_t row = t.numel() / std::max<int64_t>(1, sizes[0]);
  FLUX_CHECK(t.is_contiguous() && first >= 0 && count >= 0 && first + count <= sizes[0], "runtime", "rows ", first, "..",
             first + count, " of a tensor of ", sizes[0], " rows");
  sizes[0] = count;
  return strided_view(t, sizes, c10::contiguous_strides(sizes), first * row);
}

void gemm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               bool nk) {
  // W^T as a [K, N] view of the [N, K] weight (column-major), as weight.t() makes it.
  const at::Tensor w_kn =
      nk ? strided_view(weight, {weight.size(1), weight.size(0)}, {1, weight.size(1)}, 0) : weight;
  if (out.scalar_type() != a.scalar_type()) {
    // A wider output (fp32 from bf16/fp16): the tensor cores multiply the inputs' dtype and
    // write fp32 (aten::mm.dtype_out); the bias (fp32) is added after.
    at::mm_out(out, a, w_kn, out.scalar_type());
    if (bias.has_value()) out.add_(*bias);
    return;
  }
  if (bias.has_value()) {
    at::addmm_out(out, *bias, a, w_kn);
  } else {
    at::mm_out(out, a, w_kn);
  }
}

}  // namespace flux
