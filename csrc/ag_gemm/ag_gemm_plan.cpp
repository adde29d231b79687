// The strategies of flux.ag_gemm as flux::Runtime enqueues them: out = all_gather(input) @ W (+ bias).
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

int64_t lead_rows(const Plan& p, int64_t world) {
  // decomposed(first8=f), world size 2: the first GEMM takes f eighths of the local rows (the
  // slow path checked that this leaves both GEMMs rows).
  if (p.first8 >= 8 || world != 2) return p.rows;
  const int64_t lead = p.rows * p.first8 / 8;
  return lead > 0 && lead < p.rows ? lead : p.rows;
}

int64_t fused_swizzle(int64_t m, int64_t n) {
  // Tile order of the fused kernel (N fastest inside bands of `swizzle` M tiles), from the kernel
  // alone on H200: bands of 8 pay when both dimensions are large (8192x8192x14336: 2.50 ms against
  // 2.74 with bands of 1) and cost up to 2x when there are few M tiles (the grid pads to whole
  // bands) or few N tiles (8192x8192x5120: 1.18 against 0.90 ms).
  return m >= 4096 && n >= 12288 ? 8 : 1;
}

}  // namespace

void Runtime::push_shard(const at::Tensor& a, size_t bytes, int channel, cudaEvent_t first) {
  for (int64_t step = 1; step < (drop_transfers_ ? 1 : world_); ++step) {
    const int64_t peer = (rank_ + step) % world_;
    copy(buffer(peer) + rank_ * bytes, a.data_ptr(), bytes, comm_);  // copy engine, over NVLink
    put(comm_, peer, channel);
    if (step == 1 && first != nullptr) record(first, comm_);
  }
  if (drop_transfers_ && first != nullptr) record(first, comm_);
}

void Runtime::gather_into_workspace(const Plan& p, const at::Tensor& a, size_t bytes, int channel, cudaStream_t cur) {
  join(comm_, cur);
  barrier(comm_, p.token, false);
  cudaEvent_t after_barrier = event();
  record(after_barrier, comm_);
  push_shard(a, bytes, channel, nullptr);
  // The own rows land only after the barrier: a peer may still read this region of the workspace
  // for an earlier call (gemm_rs oneshot reads it over NVLink).
  wait_event(cur, after_barrier);
  copy(buffer(rank_) + rank_ * bytes, a.data_ptr(), bytes, cur);
}

Runtime::AgOperands Runtime::ag_operands(const Plan& p, const at::Tensor& input, const char* op) const {
  check_workspace(p, op);
  AgOperands o;
  o.a = input.view({-1, p.k});
  o.shard = p.rows * p.k * o.a.element_size();
  o.slots = view(buffer(rank_), {world_ * p.rows, p.k}, o.a.scalar_type());
  o.cur = at::cuda::getCurrentCUDAStream(device_.index()).stream();
  return o;
}

std::tuple<at::Tensor, at::Tensor> Runtime::ag_sequential(const Plan& p, const at::Tensor& input,
                                                          const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          const std::optional<at::Tensor>& out_arg) {
  at::Tensor a = input.view({-1, p.k});
  at::Tensor gathered = at::empty({world_ * p.rows, p.k}, a.options());
  auto cur = at::cuda::getCurrentCUDAStream(device_.index()).stream();
  at::Tensor out = output_or_empty(out_arg, world_ * p.rows, p.n, a, p.out_dtype);  // before the signal
  // The token check costs one small kernel; it keeps a divergent call from being paired with
  // another call's all-gather (a mismatched NCCL call hangs or mixes data).
  if (!ws_ptrs_.empty()) barrier(cur, p.token, false);
  pg_all_gather(*pg_, gathered, a)->wait();  // the current stream waits for NCCL's
  gemm_into(out, gathered, weight, bias, p.nk);
  return {out.view(p.out_shape), p.gathered ? gathered.view(p.gathered_shape) : at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor> Runtime::ag_decomposed(const Plan& p, const at::Tensor& input,
                                                          const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          const std::optional<at::Tensor>& out_arg) {
  constexpr const char* op = "ag_gemm decomposed";
  FLUX_CHECK(world_ <= 64, op, "at most 64 ranks");
  const auto [a, slots, shard, cur] = ag_operands(p, input, op);  // slots: rows of rank s at s * rows, pushed by s
  const int64_t W = world_, r = rank_, rows = p.rows, k = p.k;
  const size_t es = a.element_size();
  // Allocated before the first signal, so that an allocation failure cannot leave a signal half sent.
  at::Tensor out = output_or_empty(out_arg, W * rows, p.n, a, p.out_dtype);
  at::Tensor gathered = p.gathered ? at::empty({W * rows, k}, a.options()) : at::Tensor();
  const int64_t lead = lead_rows(p, W);

  // comm: the entry barrier (after the current stream's work so far: every peer's earlier reads
  // of our workspace are done once it passes), then a push of the shard into slot r of every
  // peer, rank + 1 first, each followed by its signal.
  // One peer: its wait follows this rank's push on the communication stream itself, where the
  // signal stream would start it (after the push, the only one), so that one event tells the
  // current stream both that the peer's rows are in and that this rank's push is done (no
  // hand-off to the signal stream, no closing join: four CUDA calls fewer).
  const bool one_peer = W == 2;
  join(comm_, cur);
  barrier(comm_, p.token, /*started=*/true);
  cudaEvent_t first_pushed = one_peer ? nullptr : event();
  push_shard(a, shard, kDataChannel, first_pushed);
  std::array<cudaEvent_t, 64> arrived{};
  if (one_peer) {
    wait_signal(comm_, 1 - r, kDataChannel);
    arrived[1] = event();
    record(arrived[1], comm_);
  }
  // first8 (world size 2): the first GEMM takes `lead` local rows (rank 0 its first, rank 1 its
  // last), the second every other row; the rest of the local rows is copied into the own slot next
  // to the peer's (after the barrier: nobody reads this slot of an earlier call by then).
  const int64_t lo = r == 0 ? 0 : rows - lead, hi = r == 0 ? lead : rows;
  // (With one peer, after its wait: the copy needs the SMs the first GEMM holds anyway.)
  cudaEvent_t own_copied = nullptr;
  if (lead < rows) {
    const int64_t r0 = r == 0 ? lead : 0, r1 = r == 0 ? rows : rows - lead;
    own_copied = event();
    copy(buffer(r) + r * shard + r0 * k * es, static_cast<const char*>(a.data_ptr()) + r0 * k * es,
         (r1 - r0) * k * es, comm_);
    record(own_copied, comm_);
  }
  // signal: the waits for the peers' shards, from the end of this rank's first push (the local
  // GEMM's CTAs are placed by then, so a wait kernel takes no SM from it); a one-warp kernel
  // beside the GEMM sees each signal while the GEMM runs, and the current stream passes an event.
  if (!one_peer) {
    wait_event(signal_, first_pushed);
    for (int64_t step = 1; step < W; ++step) {
      wait_signal(signal_, (r - step + W) % W, kDataChannel);
      arrived[step] = event();
      record(arrived[step], signal_);
    }
  }
  // current: the local GEMM may not start before the barrier kernel holds an SM, or it can take
  // them all and hold this rank's pushes (and so the peers' GEMMs) back by a whole GEMM.
  wait_started(cur);
  gemm_into(rows_of(out, r * rows + lo, hi - lo), rows_of(a, lo, hi - lo), weight, bias, p.nk);
  for (int64_t step = 1; step < W; ++step) {
    const int64_t src = (r - step + W) % W;
    if (own_copied == nullptr) {
      wait_event(cur, arrived[step]);
      gemm_into(rows_of(out, src * rows, rows), rows_of(slots, src * rows, rows), weight, bias, p.nk);
    }
  }
  if (own_copied != nullptr) {  // one GEMM over the peer's rows and the rest of this rank's
    wait_event(cur, own_copied);  // world size 2: on the communication stream after the peer's wait
    const int64_t g0 = r == 0 ? lead : 0, g1 = r == 0 ? W * rows : W * rows - lead;
    gemm_into(rows_of(out, g0, g1 - g0), rows_of(slots, g0, g1 - g0), weight, bias, p.nk);
  }
  if (p.gathered) {
    copy(gathered.data_ptr(), slots.data_ptr(), W * shard, cur);  // every slot but ours is filled
    copy(static_cast<char*>(gathered.data_ptr()) + r * shard, a.data_ptr(), shard, cur);
    gathered = gathered.view(p.gathered_shape);
  }
  // Later barriers, and frees of the input, come after the pushes (one peer: the event the current
  // stream waited for above ended the communication stream's work).
  if (!one_peer) join(cur, comm_);
  return {out.view(p.out_shape), gathered};
}

std::tuple<at::Tensor, at::Tensor> Runtime::ag_oneshot(const Plan& p, const at::Tensor& input,
                                                       const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       const std::optional<at::Tensor>& out_arg) {
  const auto [a, slots, shard, cur] = ag_operands(p, input, "ag_gemm oneshot");
  const int64_t W = world_, r = rank_, rows = p.rows;
  // Allocated before the first signal, so that an allocation failure cannot leave a signal half sent.
  at::Tensor out = output_or_empty(out_arg, W * rows, p.n, a, p.out_dtype);
  at::Tensor gathered = p.gathered ? at::empty_like(slots) : at::Tensor();
  gather_into_workspace(p, a, shard, kDataChannel, cur);
  for (int64_t step = 1; step < W; ++step) wait_signal(cur, (r - step + W) % W, kDataChannel);
  gemm_into(out, slots, weight, bias, p.nk);
  if (p.gathered) {
    copy(gathered.data_ptr(), slots.data_ptr(), W * shard, cur);
    gathered = gathered.view(p.gathered_shape);
  }
  join(cur, comm_);
  return {out.view(p.out_shape), gathered};
}

std::tuple<at::Tensor, at::Tensor> Runtime::ag_fused(const Plan& p, const at::Tensor& input, const at::Tensor& weight,
                                                     const std::optional<at::Tensor>& bias,
                                                     const std::optional<at::Tensor>& out_arg) {
  const auto [a, full, shard, cur] = ag_operands(p, input, "ag_gemm fused");
  const int64_t W = world_, r = rank_, rows = p.rows;
  at::Tensor flags = own_pad_slots(kFlagChannel * W, W);
  // TMA needs 16-byte aligned bases: a caller's tensors at odd offsets go through aligned copies
  // (a rank-local choice: the signals are the same either way).
  const bool out_aligned = out_arg.has_value() && is_aligned(out_arg->data_ptr(), 16);
  at::Tensor res =
      out_aligned ? out_arg->view({W * rows, p.n}) : at::empty({W * rows, p.n}, a.options().dtype(p.out_dtype));
  const at::Tensor w = is_aligned(weight.data_ptr(), 16) ? weight : weight.clone();
  // The kernel's bias is in the output dtype (fp32 for a wider output).
  std::optional<at::Tensor> b = bias;
  if (b.has_value() && b->scalar_type() != p.out_dtype) b = b->to(p.out_dtype);
  if (b.has_value() && !is_aligned(b->data_ptr(), 16)) b = b->clone();
  // Like every allocation of this call, before the first signal (a failure then leaves none half sent).
  at::Tensor gathered = p.gathered ? at::empty_like(full) : at::Tensor();
  // Zeroed after this rank's previous fused GEMM (their only reader) in stream order, and before
  // the barrier, which every peer passes before it sets any of them for this call.
  FLUX_CUDA(cudaMemsetAsync(flags.data_ptr(), 0, W * sizeof(uint32_t), cur));
  // Each push announced by a level flag (many tiles read it), set by a stream write: no SM, the
  // GEMM holds them all. The GEMM starts after the barrier (a barrier kernel could not get an SM
  // once the persistent GEMM runs).
  gather_into_workspace(p, a, shard, kFlagChannel, cur);
  if (push_before_fused_) join(cur, comm_);  // ranks sharing a GPU: a same-GPU copy needs SMs
  // The kernel may be launched with programmatic dependent launch (fused_pdl). What precedes it
  // on `cur` is the own shard's copy, an event wait (the barrier) and the flags' memset, and,
  // further back, kernels (the weight/bias copies, a previous call): PDL only relaxes a
  // kernel -> kernel edge, the copy, memset and event wait stay full dependencies, and
  // whatever kernel it may overlap is waited for (griddepcontrol.wait) before the kernel's
  // first global access: its producer warps' loads, and the tile scheduler's first flag read
  // (ag_tile_scheduler.hpp), which comes before the kernel's own wait.
  ag_gemm_fused_(res, full, w, b, flags, r, W, rows, timeout_ms_, reinterpret_cast<int64_t>(error_record_), p.raster,
                 p.swizzle > 0 ? p.swizzle : fused_swizzle(W * rows, p.n), p.config);
  at::Tensor out = res;
  if (out_arg.has_value() && !out_aligned) {
    out = out_arg->view({W * rows, p.n});
    out.copy_(res);
  }
  // Every peer's rows were waited for by the kernel, so the workspace holds them all now.
  if (p.gathered) {
    copy(gathered.data_ptr(), full.data_ptr(), W * shard, cur);
    gathered = gathered.view(p.gathered_shape);
  }
  join(cur, comm_);
  return {out.view(p.out_shape), gathered};
}

}  // namespace flux
