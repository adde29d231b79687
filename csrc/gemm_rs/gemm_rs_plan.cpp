// The strategies of flux.gemm_rs as flux::Runtime enqueues them: out = reduce_scatter(input @ W) (+ bias).
// docs/design.md §5 draws each one's stream timeline; the comments here say what
// each step waits for and why.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "common/check.h"
#include "ops.h"
#include "runtime/runtime.h"

namespace flux {
namespace {

std::optional<at::Tensor> aligned16(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || is_aligned(t->data_ptr(), 16)) return t;
  return t->clone();
}

}  // namespace

at::Tensor Runtime::rs_sequential(const Plan& p, const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_arg) {
  at::Tensor a = input.view({-1, p.k});
  auto cur = at::cuda::getCurrentCUDAStream(device_.index()).stream();
  // Allocated before the barrier's signal (an allocation failure then leaves no signal half sent).
  at::Tensor partial = at::empty({world_ * p.rows, p.n}, a.options().dtype(p.out_dtype));
  at::Tensor out = output_or_empty(out_arg, p.rows, p.n, a, p.out_dtype);
  // The token check (see ag_sequential): a divergent call fails instead of meeting another
  // call's reduce-scatter. On the signal stream, launched before the GEMM (so it holds an SM
  // first) and waited for only by the reduce-scatter: its latency hides behind the GEMM.
  if (!ws_ptrs_.empty()) {
    join(signal_, cur);
    barrier(signal_, p.token, false);
  }
  gemm_into(partial, a, weight, std::nullopt, p.nk);
  if (!ws_ptrs_.empty()) join(cur, signal_);
  pg_reduce_scatter(*pg_, out, partial)->wait();  // the current stream waits for NCCL's
  if (bias.has_value()) out.add_(*bias);  // once, after the reduction
  return out.view(p.out_shape);
}

at::Tensor Runtime::rs_decomposed(const Plan& p, const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_arg,
                                  bool p2p) {
  check_workspace(p, p2p ? "gemm_rs decomposed_p2p" : "gemm_rs decomposed");
  const int64_t W = world_, r = rank_, rows = p.rows, n = p.n;
  at::Tensor a = input.view({-1, p.k});
  // Partials in the output dtype: a wider out_dtype (fp32 from bf16/fp16) is computed, moved and
  // summed in fp32 (the GEMMs multiply on the tensor cores in the input dtype).
  const at::ScalarType pdt = p.out_dtype;
  const size_t es = c10::elementSize(pdt), block_bytes = rows * n * es;
  at::Tensor slots = view(buffer(r), {W, rows, n}, pdt);  // [s]: rank s's partial of our rows
  // The output is allocated before the first signal, so that an allocation failure cannot leave
  // a signal half sent. The peers' blocks are staged in this rank's workspace after the slots
  // (only this rank writes there; the next call's GEMMs into it follow the copies that read it,
  // in stream order, and a peer's writes into it in a later call follow that call's barrier).
  at::Tensor out = output_or_empty(out_arg, rows, n, a, p.out_dtype);
  at::Tensor staging = p2p ? at::Tensor() : view(buffer(r) + W * block_bytes, {(W - 1) * rows, n}, pdt);
  const int64_t chunks = std::max<int64_t>(1, std::min(p.chunks, rows));
  // One peer, one chunk: its wait follows this rank's push on the communication stream itself,
  // where the signal stream would start it (after the push, the only one), so that one event tells
  // the current stream both that the peer's partial is in and that this rank's copy is done (no
  // hand-off to the signal stream, no closing join: four CUDA calls fewer). With more chunks the
  // waits stay on the signal stream, from the first push on, so that only the last is left when
  // the last chunk lands (on the comm stream they would all start after this rank's last push).
  const bool one_peer = W == 2 && chunks == 1;
  cudaStream_t cur = at::cuda::getCurrentCUDAStream(device_.index()).stream();
  cudaEvent_t after_barrier = nullptr, first_pushed = nullptr;
  if (p2p) {
    barrier(cur, p.token, false);  // the first GEMM already writes into a peer's workspace
  } else {
    join(comm_, cur);
    barrier(comm_, p.token, /*started=*/true);
    after_barrier = event();
    record(after_barrier, comm_);
    first_pushed = one_peer ? nullptr : event();
    wait_started(cur);  // the first GEMM may not take every SM before the barrier kernel runs
  }
  // The peers' blocks first, rank + 1's first, each pushed while the next one computes.
  for (int64_t step = 1; step < W; ++step) {
    const int64_t peer = (r + step) % W;
    char* dest = buffer(peer) + r * block_bytes;  // slot r of the peer's workspace
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = rows * c / chunks, r1 = rows * (c + 1) / chunks;
      at::Tensor block = rows_of(a, peer * rows + r0, r1 - r0);
      if (p2p) {
        gemm_into(view(dest + r0 * n * es, {r1 - r0, n}, pdt), block, weight, std::nullopt, p.nk);
        put(cur, peer, kDataChannel + (int)c);  // stores over NVLink, then the signal
      } else {
        at::Tensor staged = rows_of(staging, (step - 1) * rows + r0, r1 - r0);
        gemm_into(staged, block, weight, std::nullopt, p.nk);
        join(comm_, cur);
        copy(dest + r0 * n * es, staged.data_ptr(), (r1 - r0) * n * es, comm_);  // copy engine, over NVLink
        put(comm_, peer, kDataChannel + (int)c);
        if (step == 1 && c == 0 && !one_peer) record(first_pushed, comm_);
      }
    }
  }
  // The waits for the peers' partials on the signal stream, from the end of the first push (as in
  // ag_gemm's decomposed; one peer: on the communication stream after the pushes), so the
  // reduction follows the last GEMM through an event.
  cudaEvent_t arrived = nullptr;
  if (!p2p) {
    cudaStream_t waits = one_peer ? comm_ : signal_;
    if (!one_peer) wait_event(signal_, first_pushed);
    for (int64_t step = 1; step < W; ++step) {
      for (int64_t c = 0; c < chunks; ++c) wait_signal(waits, (r - step + W) % W, kDataChannel + (int)c);
    }
    arrived = event();
    record(arrived, waits);
    wait_event(cur, after_barrier);  // long passed: a peer may read this workspace until then
  }
  gemm_into(view(buffer(r) + r * block_bytes, {rows, n}, pdt), rows_of(a, r * rows, rows), weight, std::nullopt,
            p.nk);  // own block, into own slot
  if (!p2p) {
    wait_event(cur, arrived);
  } else {
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t step = 1; step < W; ++step) wait_signal(cur, (r - step + W) % W, kDataChannel + (int)c);
    }
  }
  reduce_chunks_(out, slots, bias);  // fp32, rank order, bias once, one rounding
  if (!p2p && !one_peer) join(cur, comm_);  // one peer: `arrived` ended the communication stream's work
  return out.view(p.out_shape);
}

at::Tensor Runtime::rs_oneshot(const Plan& p, const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_arg) {
  check_workspace(p, "gemm_rs oneshot");
  const int64_t W = world_, r = rank_, rows = p.rows, n = p.n;
  at::Tensor a = input.view({-1, p.k});
  cudaStream_t cur = at::cuda::getCurrentCUDAStream(device_.index()).stream();
  at::Tensor out = output_or_empty(out_arg, rows, n, a, p.out_dtype);  // before the first signal
  // The entry barrier keeps this rank from overwriting its partial while a peer may still read
  // the previous call's; the second announces the partials.
  barrier(cur, p.token, false);
  gemm_into(view(buffer(r), {W * rows, n}, p.out_dtype), a, weight, std::nullopt, p.nk);  // partials in out's dtype
  barrier(cur, p.token, false);
  reduce_peers_(out, buffers_dev_, W, base_offset_ + r * rows * n * (int64_t)c10::elementSize(p.out_dtype), bias);
  return out.view(p.out_shape);
}

at::Tensor Runtime::rs_fused(const Plan& p, const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out_arg) {
  constexpr const char* op = "gemm_rs fused";
  check_workspace(p, op);
  const int64_t W = world_, r = rank_, rows = p.rows, n = p.n;
  const int64_t prev = (r - 1 + W) % W, nxt = (r + 1) % W;
  at::Tensor a = input.view({-1, p.k});
  // The partial sums passed around the ring (inbox, staging) are in the output dtype: fp32 sums
  // stay fp32 until the end.
  const size_t es = c10::elementSize(p.out_dtype);
  // Segments of at least one tile of rows (a tile's epilogue waits for every segment it reads, so
  // a thinner segment lands no earlier for it and only adds a copy and a flag to enqueue).
  constexpr int64_t kMinSegmentRows = 128;
  const int64_t want = std::max<int64_t>(1, std::min(p.segments, rows));
  const int64_t seg_rows = std::min(rows, std::max((rows + want - 1) / want, kMinSegmentRows));
  const int64_t nseg = (rows + seg_rows - 1) / seg_rows;
  FLUX_CHECK((W - 1) * nseg <= pad_words_ - kSegmentChannel * W, op, (W - 1) * nseg,
             " segment flags needed, the signal pads hold ", pad_words_ - kSegmentChannel * W);
  // The ring (flux/ops/gemm_rs.py ring_steps): at step s this rank computes block b_s = r - s - 1,
  // its GEMM adding (s >= 1) the sum so far of that block from rank - 1 (inbox slot s - 1), and
  // passes the result to rank + 1 (its inbox slot s); the last block is this rank's own.
  at::Tensor inbox = view(buffer(r), {(W - 1) * rows, n}, p.out_dtype);
  char* outbox = buffer(nxt);
  at::Tensor flags = own_pad_slots(kSegmentChannel * W, (W - 1) * nseg);  // [(s-1) nseg + j]: segment j in
  // Everything is allocated, and operands at odd offsets copied to 16-byte aligned buffers (TMA),
  // before the first signal, so that nothing can fail after the pushes began.
  const bool out_aligned = out_arg.has_value() && is_aligned(out_arg->data_ptr(), 16);
  at::Tensor res = out_aligned ? out_arg->view({rows, n}) : at::empty({rows, n}, a.options().dtype(p.out_dtype));
  std::vector<at::Tensor> a_blocks;
  for (int64_t s = 1; s < W; ++s) {
    const int64_t b = ((r - s - 1) % W + W) % W;
    a_blocks.push_back(*aligned16(rows_of(a, b * rows, rows)));
  }
  const at::Tensor w = *aligned16(weight);
  std::optional<at::Tensor> bias_out = bias;  // the kernel's bias is in the output dtype
  if (bias_out.has_value() && bias_out->scalar_type() != p.out_dtype) bias_out = bias_out->to(p.out_dtype);
  const std::optional<at::Tensor> bias16 = aligned16(bias_out);
  // The sums this rank passes on are staged in its workspace after the inbox (only this rank
  // writes there; see rs_decomposed), at addresses fixed with the workspace, as the push graphs
  // need.
  at::Tensor staging = view(buffer(r) + (W - 1) * rows * n * es, {(W - 1) * rows, n}, p.out_dtype);
  char* const staged = static_cast<char*>(staging.data_ptr());
  auto segments = [&](int64_t step, cudaStream_t s) {  // step's result to rank + 1's inbox slot `step`
    for (int64_t j = 0; j < nseg; ++j) {
      const int64_t r0 = j * seg_rows, r1 = std::min(rows, (j + 1) * seg_rows);
      copy(outbox + (step * rows + r0) * n * es, staged + (step * rows + r0) * n * es, (r1 - r0) * n * es, s);
      write_slot(s, nxt, kSegmentChannel * W + step * nseg + j, 1u);  // no SM: the GEMM holds them
    }
  };
  // An eager call pushes each step through the plan's graph of its segments (one CUDA call, not two
  // per segment), made here, before the first signal, on the plan's first eager call on this
  // workspace; a call being captured enqueues the segments into the caller's graph instead.
  if (!capturing_ && !drop_transfers_) {
    if (p.push_graphs_ws != ws_generation_) {  // made on another workspace: its addresses are stale
      for (cudaGraphExec_t& g : p.push_graphs) {
        if (g != nullptr) FLUX_CUDA(cudaGraphExecDestroy(g));
      }
      p.push_graphs.assign(W - 1, nullptr);
      p.push_graphs_ws = ws_generation_;
    }
    for (int64_t step = 0; step < W - 1; ++step) {
      if (p.push_graphs[step] == nullptr) p.push_graphs[step] = graph_of([&](cudaStream_t s) { segments(step, s); });
    }
  }
  cudaStream_t cur = at::cuda::getCurrentCUDAStream(device_.index()).stream();
  // Zeroed after this rank's previous fused GEMMs (the flags' only readers) and before the
  // barrier, which rank - 1 passes before it sets any of them for this call.
  FLUX_CUDA(cudaMemsetAsync(flags.data_ptr(), 0, flags.nbytes(), cur));
  join(comm_, cur);
  barrier(comm_, p.token, /*started=*/true);  // rank + 1's previous GEMMs no longer read its inbox
  wait_started(cur);
  auto push = [&](int64_t step) {
    join(comm_, cur);
    if (drop_transfers_) return;
    if (capturing_) {
      segments(step, comm_);
    } else {
      FLUX_CUDA(cudaGraphLaunch(p.push_graphs[step], comm_));
    }
  };
  const int64_t b0 = (r - 1 + W) % W;
  gemm_into(rows_of(staging, 0, rows), rows_of(a, b0 * rows, rows), weight, std::nullopt, p.nk);
  push(0);
  for (int64_t step = 1; step < W; ++step) {
    const bool last = step == W - 1;
    at::Tensor dst = last ? res : rows_of(staging, step * rows, rows);
    // Ranks sharing a GPU (FLUX_GLOO_CUDA, tests): the ring's neighbour may be on this GPU, where
    // the push is a copy that needs SMs, and this kernel would hold them all while it waits for
    // the neighbour's push, which waits the same way: the pushes go before the kernel.
    if (push_before_fused_) join(cur, comm_);
    // Launched with programmatic dependent launch where fused_pdl: the kernel before it on `cur`
    // is the previous block's GEMM (cuBLAS, or the previous step's fused kernel, whose output
    // rows the push reads after an event) and may still be finishing when this one starts; the
    // kernel waits for it (griddepcontrol.wait) in its producer warps before any load, the
    // epilogue's segment-flag waits come after that wait (SegmentWaitEpilogue::load), and its
    // stores follow its loads. The flags' memset and the event waits are no kernels: PDL does
    // not relax them.
    gemm_rs_fused_(dst, a_blocks[step - 1], w, last ? bias16 : std::nullopt, rows_of(inbox, (step - 1) * rows, rows),
                   rows_of(flags, (step - 1) * nseg, nseg), seg_rows, r, prev, timeout_ms_,
                   reinterpret_cast<int64_t>(error_record_), p.raster, p.swizzle > 0 ? p.swizzle : 1, p.config);
    if (!last) push(step);
  }
  join(cur, comm_);  // later calls write the staging (and free the inputs) after the pushes
  at::Tensor out = res;
  if (out_arg.has_value() && !out_aligned) {
    out = out_arg->view({rows, n});
    out.copy_(res);
  }
  return out.view(p.out_shape);
}

}  // namespace flux
