// The one place where flux's CUDA kernels are registered with the dispatcher.
// Schemas carry alias annotations: Tensor(a!) is written in place and returned as nothing.
// The public ops (flux::ag_gemm, flux::gemm_rs) are defined in Python (flux/ops/) so that
// they exist, with their reference implementations, also where this extension is not built.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(flux, m) {
  m.def("reduce_chunks_(Tensor(a!) out, Tensor partials, Tensor? bias) -> ()");
  // ptrs_dev: device address of the W ranks' symmetric buffer bases (csrc/reduce/reduce_partials.cu).
  m.def("reduce_peers_(Tensor(a!) out, int ptrs_dev, int world, int offset_bytes, Tensor? bias) -> ()");
  // Writes into symmetric-workspace memory given by address (not a tensor argument), and the rows
  // this rank keeps into local_out when given.
  m.def("moe_scatter_rows_(Tensor src, Tensor? src_rows, Tensor dst_ranks, Tensor dst_rows, Tensor? tags, "
        "int ptrs_dev, int world, int dst_offset_bytes, int tag_offset_bytes, Tensor(a!)? local_out=None, "
        "int rank=-1, int dst_rows_cap=-1) -> ()");
  // The bounded MoE exchange (csrc/moe/moe_bounded.cu): routing, rows and flags into the peers'
  // workspaces and signal pads (given by address), and the receive kernels that wait for the flags.
  m.def("moe_route_(Tensor topk_idx, int num_experts, int world, int rank, int capacity, int host_code, "
        "Tensor(a!) send_pairs, Tensor(b!) send_code, Tensor(c!) pair_pos, Tensor(d!) send_counts, "
        "Tensor(e!) code) -> ()");
  m.def("moe_send_(Tensor src, Tensor? order, int k, Tensor dst_code, bool tags, Tensor? counts, Tensor? code, "
        "Tensor(a!) done, int ptrs_dev, int pads_dev, int world, int rank, int local_experts, int rows_off, "
        "int tags_off, int counts_off, int channel, Tensor? topk_idx=None, int capacity=0, int tok_off=-1) -> ()");
  m.def("moe_recv_pack_(Tensor(a!) out, Tensor(b!)? recv_code, Tensor(c!)? counts_out, Tensor(d!)? verdict, "
        "Tensor? counts_in, Tensor(e!)? counts_save, Tensor(f!)? send_code, Tensor(g!)? send_pairs, "
        "Tensor(h!)? pair_pos, Tensor(i!) done, int ws_base, int pads_dev, int world, "
        "int rank, int local_experts, int capacity, int rows_off, int tags_off, int counts_off, int channel, "
        "int timeout_ms, bool zero_pad=True, int tok_off=-1) -> ()");
  m.def("moe_recv_sum_(Tensor(a!) out, Tensor? weights, Tensor pair_pos, int n_send, Tensor(b!) done, int ws_base, "
        "int pads_dev, int world, int rank, int rows_off, int channel, int timeout_ms) -> ()");
  // MoE at one rank, the `local` strategy (csrc/moe/moe_local.cu): layout + rows of a dispatch in
  // one entry, [recv, counts, verdict, pair_row, send_pairs, info] (capacity -2: unbounded, recv
  // [T * K, H], the worst case), the weighted combine (y in recv_x's layout, weights of any
  // floating dtype), and its backward.
  m.def("moe_local_dispatch(Tensor x, Tensor topk_idx, int num_experts, int capacity, int host_code, "
        "bool zero_pad) -> Tensor[]");
  m.def("moe_local_combine(Tensor y, Tensor? weights, Tensor pair_row, int k) -> Tensor");
  m.def("moe_local_combine_backward(Tensor grad_out, Tensor? weights, Tensor pair_row, Tensor send_pairs, "
        "Tensor? y, int k) -> Tensor[]");
  // SwiGLU of the experts' [R, 2F] GEMM output (csrc/moe/moe_swiglu.cu) and its backward; with
  // counts, only rows r with r % slab < counts[r / slab] (the others neither read nor written).
  m.def("moe_swiglu(Tensor h, Tensor? counts=None, int slab=0) -> Tensor");
  m.def("moe_swiglu_backward(Tensor grad, Tensor h, Tensor? counts=None, int slab=0) -> Tensor");
  // Grouped GEMM of the MoE experts (csrc/moe/grouped_gemm.cuh): kind 0 (nk) / 1 (kn): a [R, K],
  // b [E, N, K] / [E, K, N] -> [R, N]; kind 2 (wgrad): a [R, M], b [R, N] -> [E, M, N]; rows
  // grouped by offs (int32 cumulative row ends, one per expert), or with slab C > 0 in E slabs of C
  // rows (offs: int64 rows per expert; the rows past them neither read nor written); config:
  // flux/fused_configs.py GROUPED.
  m.def("grouped_mm_cutlass(Tensor a, Tensor b, Tensor offs, int kind, int config, int slab=0) -> Tensor");
  // The grouped GEMM instantiations compiled in: "gmm:config:kind" separated by spaces.
  m.def("grouped_kernels_built() -> str");
  // Fused AllGather+GEMM (csrc/ag_gemm/ag_gemm_fused.cpp): out = a_full @ weight^T (+ bias), tiles of
  // remote rows waiting on flags[src]; a_full is a symmetric workspace written by peers;
  // error_record: host-mapped address of 2 uint32 (waiting rank + 1, missing rank), or 0.
  m.def("ag_gemm_fused_(Tensor(a!) out, Tensor a_full, Tensor weight, Tensor? bias, Tensor flags, int rank, "
        "int world, int rows_per_rank, int timeout_ms, int error_record, int raster=1, int swizzle=8, "
        "int config=0) -> ()");
  m.def("ag_gemm_fused_supported() -> bool");
  // The fused GEMM instantiations compiled in: "op:config:dtype" separated by spaces (op ag or rs,
  // dtype bf16, fp16, bf16_fp32 or fp16_fp32; flux/fused_configs.py parse_built).
  m.def("fused_kernels_built() -> str");
  // Whether the fused GEMMs are launched with programmatic dependent launch (process-wide, default
  // on): their prologue overlaps the tail of the kernel before them in the stream.
  m.def("set_fused_pdl(bool enabled) -> ()");
  m.def("fused_pdl() -> bool");
  // A diagnostic: the device address of a buffer into which the next launches of the fused AG
  // kernels record, per CTA, 8 uint64 (SM, times, tiles: csrc/ag_gemm/ag_tile_scheduler.hpp AgTrace),
  // or 0 (the default) for none. Process-wide; bench/probe_pdl_trace.py --cta reads it.
  m.def("set_fused_trace(int address) -> ()");
  // A diagnostic: the device address of 2 x count int32, a permutation of the cluster tiles of the
  // next launches of the fused AG kernels and its inverse (csrc/ag_gemm/ag_tile_scheduler.hpp
  // AgWaitArguments::order), used by a launch whose cluster tiles are count; 0, 0 (the default): none.
  // Process-wide; bench/probe_pdl_trace.py --orders sets it.
  m.def("set_fused_order(int address, int count) -> ()");
  // A diagnostic: the device addresses of `sms` int32 places of the SMs in an order GPC by GPC and of a
  // zeroed int32 buffer of claims (csrc/ag_gemm/ag_tile_scheduler.hpp AgWaitArguments::deal_pos): the
  // next launches of the fused AG kernels of one wave of 2-CTA clusters deal their cluster tiles by
  // the GPC each cluster runs in; 0, 0, 0 (the default): none. Process-wide, not for concurrent launches;
  // bench/probe_pdl_trace.py --orders deal sets it.
  m.def("set_fused_deal(int pos, int state, int sms) -> ()");
  // The SMs that grids of `cluster`-CTA clusters ran on, one CTA per SM: [rounds, grid] int32, the CTAs
  // of a cluster consecutive (all in one GPC); flux/autotune/placement.py learns the GPCs from it.
  m.def("cluster_sms(int cluster, int rounds, int device) -> Tensor");
  // Fused GEMM+ReduceScatter own block (csrc/gemm_rs/rs_fused.cpp): out = a @ weight^T + source (+ bias);
  // source: this rank's workspace slot that the peer fills segment by segment, segment s announced
  // by flags[s] != 0; the epilogue of a tile waits (bounded, naming `peer`) for its segments.
  m.def("gemm_rs_fused_(Tensor(a!) out, Tensor a, Tensor weight, Tensor? bias, Tensor source, Tensor flags, "
        "int rows_per_segment, int rank, int peer, int timeout_ms, int error_record, int raster=1, int swizzle=1, "
        "int config=0) -> ()");
}

TORCH_LIBRARY_IMPL(flux, CompositeExplicitAutograd, m) {
  m.impl("ag_gemm_fused_supported", &flux::ag_gemm_fused_supported);
  m.impl("fused_kernels_built", &flux::fused_kernels_built);
  m.impl("grouped_kernels_built", &flux::grouped_kernels_built);
  m.impl("set_fused_pdl", &flux::set_fused_pdl);
  m.impl("fused_pdl", &flux::fused_pdl);
  m.impl("set_fused_trace", &flux::set_fused_trace);
  m.impl("set_fused_order", &flux::set_fused_order);
  m.impl("set_fused_deal", &flux::set_fused_deal);
  m.impl("cluster_sms", &flux::cluster_sms);
}

TORCH_LIBRARY_IMPL(flux, CUDA, m) {
  m.impl("reduce_chunks_", &flux::reduce_chunks_);
  m.impl("reduce_peers_", &flux::reduce_peers_);
  m.impl("moe_scatter_rows_", &flux::moe_scatter_rows_);
  m.impl("moe_route_", &flux::moe_route_);
  m.impl("moe_send_", &flux::moe_send_);
  m.impl("moe_recv_pack_", &flux::moe_recv_pack_);
  m.impl("moe_recv_sum_", &flux::moe_recv_sum_);
  m.impl("moe_local_dispatch", &flux::moe_local_dispatch);
  m.impl("moe_local_combine", &flux::moe_local_combine);
  m.impl("moe_local_combine_backward", &flux::moe_local_combine_backward);
  m.impl("moe_swiglu", &flux::moe_swiglu);
  m.impl("moe_swiglu_backward", &flux::moe_swiglu_backward);
  m.impl("grouped_mm_cutlass", &flux::grouped_mm_cutlass);
  m.impl("ag_gemm_fused_", &flux::ag_gemm_fused_);
  m.impl("gemm_rs_fused_", &flux::gemm_rs_fused_);
}
