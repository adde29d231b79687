// Declarations of the kernels behind torch.ops.flux.* (see torch_bindings.cpp).
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace flux {

// out[r, c] = bias[c] + sum_w partials[w, r, c], fp32 accumulation in rank order.
void reduce_chunks_(at::Tensor& out, const at::Tensor& partials, const std::optional<at::Tensor>& bias);

}  // namespace flux
