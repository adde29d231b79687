// Declarations of the kernels behind torch.ops.flux.* (see torch_bindings.cpp).
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>  // declarations only: the .cu files include the ops they call

namespace flux {

// out[r, c] = bias[c] + sum_w partials[w, r, c], fp32 accumulation in rank order.
void reduce_chunks_(at::Tensor& out, const at::Tensor& partials, const std::optional<at::Tensor>& bias);
// out[r, c] = bias[c] + sum_w partial_w[r, c], partial_w at ptrs[w] + offset_bytes (symmetric buffers).
void reduce_peers_(at::Tensor& out, int64_t ptrs_dev, int64_t world, int64_t offset_bytes,
                   const std::optional<at::Tensor>& bias);

// Fused AllGather+GEMM over a symmetric workspace (csrc/ag_gemm/ag_gemm_fused.cpp).
bool ag_gemm_fused_supported();
void ag_gemm_fused_(at::Tensor& out, const at::Tensor& a_full, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, const at::Tensor& flags, int64_t rank, int64_t world,
                    int64_t rows_per_rank, int64_t timeout_ms, int64_t error_record, int64_t raster,
                    int64_t swizzle, int64_t config);

// The fused GEMM instantiations built ("ag:0:bf16 rs:3:fp16 ...", flux/fused_configs.py).
std::string fused_kernels_built();
// Programmatic dependent launch of the fused GEMMs, process-wide (default on; common/fused_gemm.cuh).
bool fused_pdl();
void set_fused_pdl(bool enabled);
// The fused AG kernels' diagnostic trace buffer, process-wide (csrc/ag_gemm/ag_gemm_fused.cuh).
void set_fused_trace(int64_t address);
// The fused AG kernels' diagnostic cluster-tile permutation, process-wide (ag_gemm_fused.cuh).
void set_fused_order(int64_t address, int64_t count);
// The fused AG kernels' diagnostic deal of cluster tiles by GPC, process-wide (ag_gemm_fused.cuh).
void set_fused_deal(int64_t pos, int64_t state, int64_t sms);
// Per launch of `rounds` grids of clusters of `cluster` CTAs, one CTA per SM, each CTA's SM
// ([rounds, grid] int32, clusters consecutive; csrc/common/cluster_sms.cu).
at::Tensor cluster_sms(int64_t cluster, int64_t rounds, int64_t device);

// Fused GEMM+ReduceScatter own block (csrc/gemm_rs/rs_fused.cpp): out = a @ weight^T + source (+ bias),
// the epilogue of each tile waiting for the flags of the source segments it reads.
void gemm_rs_fused_(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                    const std::optional<at::Tensor>& bias, const at::Tensor& source, const at::Tensor& flags,
                    int64_t rows_per_segment, int64_t rank, int64_t peer, int64_t timeout_ms, int64_t error_record,
                    int64_t raster, int64_t swizzle, int64_t config);

// MoE row movement over a symmetric workspace (csrc/moe/moe_rows.cu): src[src_rows[i]] (or src[i])
// to rank dst_ranks[i]'s buffer (nowhere when dst_ranks[i] < 0) at dst_offset_bytes +
// dst_rows[i] * row_bytes, and tags[i] (if given) as int32 at tag_offset_bytes + dst_rows[i] * 4;
// ptrs_dev: the W buffer bases. Row indices are bounds-checked on the device (dst_rows_cap: rows
// per workspace region, -1 unchecked).
void moe_scatter_rows_(const at::Tensor& src, const std::optional<at::Tensor>& src_rows, const at::Tensor& dst_ranks,
                       const at::Tensor& dst_rows, const std::optional<at::Tensor>& tags, int64_t ptrs_dev,
                       int64_t world, int64_t dst_offset_bytes, int64_t tag_offset_bytes,
                       const std::optional<at::Tensor>& local_out, int64_t rank, int64_t dst_rows_cap);

// The bounded MoE exchange (csrc/moe/moe_bounded.cu; flux/ops/_moe_symm.py, _Bounded).
void moe_route_(const at::Tensor& topk_idx, int64_t num_experts, int64_t world, int64_t rank, int64_t capacity,
                int64_t host_code, at::Tensor& send_pairs, at::Tensor& send_code, at::Tensor& pair_pos,
                at::Tensor& send_counts, at::Tensor& code);
void moe_send_(const at::Tensor& src, const std::optional<at::Tensor>& order, int64_t k, const at::Tensor& dst_code,
               bool tags, const std::optional<at::Tensor>& counts, const std::optional<at::Tensor>& code,
               at::Tensor& done, int64_t ptrs_dev, int64_t pads_dev, int64_t world, int64_t rank, int64_t local_experts,
               int64_t rows_off, int64_t tags_off, int64_t counts_off, int64_t channel,
               const std::optional<at::Tensor>& topk_idx, int64_t capacity, int64_t tok_off);
void moe_recv_pack_(at::Tensor& out, const std::optional<at::Tensor>& recv_code,
                    const std::optional<at::Tensor>& counts_out, const std::optional<at::Tensor>& verdict,
                    const std::optional<at::Tensor>& counts_in, const std::optional<at::Tensor>& counts_save,
                    const std::optional<at::Tensor>& send_code, const std::optional<at::Tensor>& send_pairs,
                    const std::optional<at::Tensor>& pair_pos, at::Tensor& done, int64_t ws_base, int64_t pads_dev, int64_t world, int64_t rank,
                    int64_t local_experts, int64_t capacity, int64_t rows_off, int64_t tags_off, int64_t counts_off,
                    int64_t channel, int64_t timeout_ms, bool zero_pad, int64_t tok_off);
void moe_recv_sum_(at::Tensor& out, const std::optional<at::Tensor>& weights, const at::Tensor& pair_pos,
                   int64_t n_send, at::Tensor& done, int64_t ws_base, int64_t pads_dev, int64_t world, int64_t rank,
                   int64_t rows_off, int64_t channel, int64_t timeout_ms);

// MoE at one rank (csrc/moe/moe_local.cu; flux/ops/moe/local.py): the dispatch's layout and
// rows ({recv, counts [E], verdict [1], pair_row [T * K], send_pairs, info [E + 1]}), the
// weighted combine and its backward ({dy, dw}).
std::vector<at::Tensor> moe_local_dispatch(const at::Tensor& x, const at::Tensor& topk_idx, int64_t num_experts,
                                           int64_t capacity, int64_t host_code, bool zero_pad);
at::Tensor moe_local_combine(const at::Tensor& y, const std::optional<at::Tensor>& weights, const at::Tensor& pair_row,
                             int64_t k);
std::vector<at::Tensor> moe_local_combine_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& weights,
                                                   const at::Tensor& pair_row, const at::Tensor& send_pairs,
                                                   const std::optional<at::Tensor>& y, int64_t k);

// SwiGLU of [R, 2F] (gate, up) -> [R, F], and its backward -> [R, 2F] (csrc/moe/moe_swiglu.cu);
// with counts, only the rows below counts[e] of each slab of `slab` rows.
at::Tensor moe_swiglu(const at::Tensor& h, const std::optional<at::Tensor>& counts, int64_t slab);
at::Tensor moe_swiglu_backward(const at::Tensor& grad, const at::Tensor& h, const std::optional<at::Tensor>& counts,
                               int64_t slab);

// Grouped GEMM of the MoE experts (csrc/moe/grouped_gemm.cuh, grouped_gemm.cpp) and what was built.
at::Tensor grouped_mm_cutlass(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offs, int64_t kind,
                              int64_t config, int64_t slab);
std::string grouped_kernels_built();

}  // namespace flux
