// moe_scatter_rows_: the data movement of flux.moe_dispatch / flux.moe_combine over a symmetric
// workspace (flux/ops/moe/symm.py): rows of a local tensor written by SMs straight into the
// peers' workspaces over NVLink (and into this rank's own), each to a row index chosen by the
// caller, optionally with a 32-bit tag per row beside it.
//
//   for i in [0, n) with dst_ranks[i] >= 0 (a negative rank: the row goes nowhere):
//       copy src[src_rows[i]] (row_bytes)  ->  ptrs[dst_ranks[i]] + dst_offset + dst_rows[i] * row_bytes
//       (tags)  *(int32*)(ptrs[dst_ranks[i]] + tag_offset + dst_rows[i] * 4) = tags[i]
//
// With local_out, the rows for rank ``rank`` go to local_out + dst_rows[i] * row_bytes instead
// (an ordinary tensor: the rows this rank keeps skip the workspace; their tags still go there).
// The same call with every row's rank set to ``rank`` copies rows within this GPU in one pass.
//
// Bounds, checked on the device: src_rows[i] < src's rows, dst_rows[i] < local_out's rows for the
// rows that go there, and < dst_rows_cap (the rows each workspace region holds; -1: not checked)
// for the others. A row outside them writes nothing: the kernel prints the op, the row and the
// bound, and traps, as a device-side assertion does (the indices come from flux's own routing,
// so this is a bug in flux, never a user's input).
//
// Ordering: plain (weak) stores. The caller runs flux's entry barrier before (no peer still reads
// the destination rows of an earlier call) and after (the barrier kernel's system-scope fence
// before its release store orders these stores before the peer's acquire of the barrier slot).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"
#include "moe/launch.h"
#include "ops.h"

namespace flux {
namespace {

// One block per row at a time (grid-stride over rows); the row in vectors of V bytes.
__device__ __noinline__ void row_out_of_bounds(const char* what, int64_t i, int64_t row, int64_t bound) {
  printf("flux: moe_scatter_rows_: entry %lld has %s row %lld, outside [0, %lld)\n", (long long)i, what,
         (long long)row, (long long)bound);
  __trap();
}

template <typename Vec>
__global__ void scatter_rows_kernel(const char* __restrict__ src, const int64_t* __restrict__ src_rows,
                                    const int64_t* __restrict__ dst_ranks, const int64_t* __restrict__ dst_rows,
                                    const int32_t* __restrict__ tags, char* const* __restrict__ ptrs, int64_t n,
                                    int64_t row_bytes, int64_t dst_offset, int64_t tag_offset,
                                    char* __restrict__ local_out, int64_t rank, int64_t src_count,
                                    int64_t local_rows, int64_t dst_rows_cap) {
  const int64_t vecs = row_bytes / (int64_t)sizeof(Vec);
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t d = dst_ranks[i];
    if (d < 0) continue;  // uniform across the block: every thread skips the row
    const int64_t s = src_rows != nullptr ? src_rows[i] : i;
    const int64_t r = dst_rows[i];
    const bool local = local_out != nullptr && d == rank;
    const int64_t cap = local ? local_rows : dst_rows_cap;
    if (s < 0 || s >= src_count) row_out_of_bounds("source", i, s, src_count);
    if (r < 0 || (cap >= 0 && r >= cap)) row_out_of_bounds(local ? "local_out" : "destination", i, r, cap);
    char* base = ptrs[d];
    const Vec* from = reinterpret_cast<const Vec*>(src + s * row_bytes);
    Vec* to = reinterpret_cast<Vec*>(local ? local_out + r * row_bytes : base + dst_offset + r * row_bytes);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) to[v] = from[v];
    if (tags != nullptr && threadIdx.x == 0) {
      *reinterpret_cast<int32_t*>(base + tag_offset + r * 4) = tags[i];
    }
  }
}

}  // namespace

void moe_scatter_rows_(const at::Tensor& src, const std::optional<at::Tensor>& src_rows, const at::Tensor& dst_ranks,
                       const at::Tensor& dst_rows, const std::optional<at::Tensor>& tags, int64_t ptrs_dev,
                       int64_t world, int64_t dst_offset_bytes, int64_t tag_offset_bytes,
                       const std::optional<at::Tensor>& local_out, int64_t rank, int64_t dst_rows_cap) {
  constexpr const char* op = "moe_scatter_rows_";
  FLUX_CHECK(src.is_cuda() && src.is_contiguous() && src.dim() >= 1, op, "src must be a contiguous CUDA tensor");
  const int64_t n = dst_rows.numel();
  auto idx_ok = [&](const at::Tensor& t) {
    return t.is_cuda() && t.is_contiguous() && t.scalar_type() == at::kLong && t.numel() == n &&
           t.device() == src.device();
  };
  FLUX_CHECK(idx_ok(dst_rows) && idx_ok(dst_ranks), op, "dst_rows and dst_ranks must be int64 CUDA tensors of ", n,
             " elements");
  FLUX_CHECK(!src_rows.has_value() || idx_ok(*src_rows), op, "src_rows must be an int64 CUDA tensor of ", n,
             " elements");
  FLUX_CHECK(!src_rows.has_value() ? src.size(0) >= n : true, op, "src has ", src.size(0), " rows, ", n, " to send");
  FLUX_CHECK(!tags.has_value() || (tags->is_cuda() && tags->is_contiguous() && tags->scalar_type() == at::kInt &&
                                   tags->numel() == n),
             op, "tags must be an int32 CUDA tensor of ", n, " elements");
  FLUX_CHECK(world >= 1 && world <= 1024 && ptrs_dev != 0, op, "bad workspace (world ", world, ")");
  FLUX_CHECK(dst_offset_bytes >= 0 && tag_offset_bytes >= 0 && tag_offset_bytes % 4 == 0, op, "bad offsets");
  FLUX_CHECK(dst_rows_cap >= -1, op, "dst_rows_cap must be -1 (unchecked) or a row count, got ", dst_rows_cap);
  const int64_t row_bytes = src.size(0) ? src.numel() / src.size(0) * (int64_t)src.element_size() : 0;
  char* lo = nullptr;
  int64_t local_rows = 0;
  if (local_out.has_value()) {
    const auto& o = *local_out;
    FLUX_CHECK(o.is_cuda() && o.is_contiguous() && o.device() == src.device() && o.dim() >= 1 &&
                   (src.size(0) == 0 || o.size(0) == 0 || o.numel() / o.size(0) * (int64_t)o.element_size() == row_bytes),
               op, "local_out must be a contiguous CUDA tensor of src's rows on its device");
    FLUX_CHECK(rank >= 0 && rank < world, op, "rank ", rank, " outside the group of ", world);
    lo = static_cast<char*>(local_out->data_ptr());
    local_rows = o.size(0);
  }
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Enough blocks to keep NVLink busy from every SM, no more than there are rows.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = (int)std::min<int64_t>(n, (int64_t)sms * 8);
  const char* s = static_cast<const char*>(src.data_ptr());
  const int64_t* sr = src_rows.has_value() ? src_rows->data_ptr<int64_t>() : nullptr;
  const int32_t* tg = tags.has_value() ? tags->data_ptr<int32_t>() : nullptr;
  auto ptrs = reinterpret_cast<char* const*>(ptrs_dev);
  // Widest vector that the row size and every address allow (workspace bases are
  // allocation-granularity aligned, so the offsets decide).
  moe_launch::by_vector(row_bytes, {(uintptr_t)dst_offset_bytes, reinterpret_cast<uintptr_t>(s),
                                    reinterpret_cast<uintptr_t>(lo)},
                        [&](auto vec) {
                          using Vec = decltype(vec);
                          scatter_rows_kernel<Vec><<<blocks, 256, 0, stream>>>(
                              s, sr, dst_ranks.data_ptr<int64_t>(), dst_rows.data_ptr<int64_t>(), tg, ptrs, n,
                              row_bytes, dst_offset_bytes, tag_offset_bytes, lo, rank, src.size(0), local_rows,
                              dst_rows_cap);
                        });
  FLUX_CHECK_LAUNCH();
}

}  // namespace flux
