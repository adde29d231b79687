// flux::Runtime: the per-call path of the overlapped ops, one object per (process group, device).
//
// The slow path (Python, flux/ops/_plans.py) runs once per problem: every argument check, the
// cross-rank signature exchange, the strategy choice or tuning and the growth of the symmetric
// workspace. It leaves a Plan here, keyed by what the call's tensors look like (shapes, dtypes,
// layout, bias, out, options). Every later call of the same problem is one C++ entry
// (Runtime::call): a key lookup, then the plan's copies, signals, waits and GEMMs enqueued on
// the runtime's own streams with pooled events. No Python per step, no store traffic, no
// environment reads, no allocation but the output (gemm_rs stages its blocks in the workspace).
//
// Each plan carries a token: a hash of the problem's signature, the same on every rank that
// makes the same call. The entry barrier of every call carries it to the peers, which compare
// it with their own: ranks that make different calls fail at once, naming both ranks
// (csrc/runtime/signals.cu), instead of pairing one call's data with another's.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "strategies.h"  // OpKind, StrategyKind, plan parameters, signal channels: from flux/strategies.py

namespace c10d {
class ProcessGroup;
}

namespace flux {

// out <- the ranks' `in` gathered, and out <- `in` summed over ranks and scattered, through the
// group's collectives: torch >= 2.12 names them all_gather_single / reduce_scatter_single and
// deprecates the older _allgather_base / _reduce_scatter_base, which earlier versions alone have.
template <class PG>
auto pg_all_gather(PG& pg, at::Tensor& out, at::Tensor& in) {
  if constexpr (requires { pg.all_gather_single(out, in); }) return pg.all_gather_single(out, in);
  else return pg._allgather_base(out, in);
}
template <class PG>
auto pg_reduce_scatter(PG& pg, at::Tensor& out, at::Tensor& in) {
  if constexpr (requires { pg.reduce_scatter_single(out, in); }) return pg.reduce_scatter_single(out, in);
  else return pg._reduce_scatter_base(out, in);
}

// Signal pad channels (kBarrierChannel ... kSegmentChannel): strategies.h; flux/runtime/symm.py
// documents them.

struct Plan {
  OpKind op = OpKind::AgGemm;
  StrategyKind strategy = StrategyKind::Sequential;
  // Strategy parameters (flux/strategies.py, kPlanParamNames); 0 swizzle: the analytic choice.
  int64_t first8 = 8, chunks = 1, segments = 8, config = 0, swizzle = 0, raster = 1;
  uint32_t token = 1;  // non-zero; see the file comment
  // The problem, fixed by the key.
  int64_t rows = 0;  // ag_gemm: rows of this rank's shard; gemm_rs: rows of one block (M / W)
  int64_t n = 0, k = 0;
  bool nk = true, has_bias = false, gathered = false;
  at::ScalarType dtype = at::kBFloat16, out_dtype = at::kBFloat16;
  std::vector<int64_t> out_shape, gathered_shape;
  int64_t workspace_bytes = 0;
  // gemm_rs fused: each ring step's pushes (a copy and a flag write per segment) as one CUDA
  // graph, made at the plan's first eager call and launched by every later one: one CUDA call
  // instead of two per segment. The graphs hold the workspace's addresses, so they are made again
  // for a new workspace (Runtime::ws_generation_).
  mutable std::vector<cudaGraphExec_t> push_graphs;
  mutable uint64_t push_graphs_ws = 0;
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan();
};

class Runtime {
 public:
  Runtime(const std::string& group_name, int64_t rank, int64_t world, int64_t device, bool nccl, int64_t timeout_ms,
          int64_t error_record);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The symmetric workspace, made (or grown) by flux/runtime/symm.py: every rank's buffer as
  // mapped here (uint8 tensors, this rank's own at index rank), every rank's signal pad, and
  // the device arrays of both.
  void set_workspace(const std::vector<at::Tensor>& buffers, const std::vector<int64_t>& pads, int64_t pads_dev,
                     int64_t buffers_dev, int64_t base_offset, int64_t pad_words);
  int64_t workspace_bytes() const { return ws_bytes_; }

  // A plan for these tensors (validated by the caller, the slow path).
  std::shared_ptr<Plan> make_plan(int64_t op, int64_t strategy, const std::vector<int64_t>& params, int64_t token,
                                  const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, bool nk, int64_t out_dtype, bool gathered);
  // Remember ``plan`` for every later call whose tensors have the same key.
  void add_plan(const std::shared_ptr<Plan>& plan, const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out, int64_t layout,
                int64_t out_dtype, bool gathered);
  void clear_plans() { plans_.clear(); }
  int64_t num_plans() const { return (int64_t)plans_.size(); }

  // The hot path: the plan for this call, or nullptr when the call must take the slow path
  // (new problem, or anything a plan does not cover: non-contiguous tensors, other devices,
  // an out= that overlaps an input).
  std::shared_ptr<Plan> lookup(int64_t op, const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out,
                               int64_t layout, int64_t out_dtype, bool gathered) const;
  // Enqueue ``plan`` on the current stream: (out, gathered-or-undefined).
  std::tuple<at::Tensor, at::Tensor> run(const Plan& plan, const at::Tensor& input, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out);

  // The token-carrying barrier with every peer, enqueued on the current stream (the MoE ops of
  // flux/ops/moe/symm.py, which order their workspace writes with it).
  void enqueue_barrier(int64_t token);

  // The transfers of an overlapped op driven from Python (the 'decomposed' strategy of the
  // tensor-parallel MoE ops, flux/ops/moe/tp_strategies.py), on the communication stream in the order
  // called:
  //   begin_exchange(token)   starts a call: the communication stream joins the current stream,
  //                           then the entry barrier carrying ``token`` (every peer has finished
  //                           the work it enqueued before its own call, reads of its workspace
  //                           included);
  //   send(src, peer, offset, after_current)
  //                           ``src`` (contiguous) by copy engine into ``peer``'s workspace at
  //                           ``offset`` bytes, then a put on the data channel; after the current
  //                           stream's work so far when ``after_current`` (src made in this call);
  //   wait_from(src)          the current stream waits (bounded, naming the peer) for ``src``'s put;
  //   end_exchange()          the current stream waits for every send (their sources may be freed).
  void begin_exchange(int64_t token);
  void send(const at::Tensor& src, int64_t peer, int64_t offset, bool after_current);
  void wait_from(int64_t src);
  void end_exchange();

  // Test hook: while set, this rank passes the entry barriers but sends no data and no flags.
  void set_drop_transfers(bool on) { drop_transfers_ = on; }
  // Ranks sharing one GPU (FLUX_GLOO_CUDA, tests): the fused AG and RS kernels start after this
  // rank's pushes (a copy within one GPU needs SMs, which a persistent kernel holds).
  void set_push_before_fused(bool on) { push_before_fused_ = on; }

  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  int64_t device() const { return device_.index(); }
  int64_t comm_stream() const { return reinterpret_cast<int64_t>(comm_); }

 private:
  // The strategies, one member per row of FLUX_PLAN_STRATEGIES (strategies.h, generated from
  // flux/strategies.py), written in csrc/ag_gemm/ag_gemm_plan.cpp and csrc/gemm_rs/gemm_rs_plan.cpp
  // and run by Runtime::run: ag_gemm's return (out, gathered), gemm_rs's the output.
  using AgGemmResult = std::tuple<at::Tensor, at::Tensor>;
  using GemmRsResult = at::Tensor;
#define FLUX_DECLARE_STRATEGY(OP, STRATEGY, MEMBER)                                                   \
  OP##Result MEMBER(const Plan&, const at::Tensor& input, const at::Tensor& weight,                   \
                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out);
  FLUX_PLAN_STRATEGIES(FLUX_DECLARE_STRATEGY)
#undef FLUX_DECLARE_STRATEGY
  // gemm_rs decomposed and decomposed_p2p (``p2p``: the GEMMs write the peers' slots directly).
  at::Tensor rs_decomposed(const Plan&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, bool p2p);

  // Building blocks, each enqueued on the given stream.
  cudaEvent_t event();  // the next pooled event of this call (begin_call resets the pool)
  void begin_call();
  void record(cudaEvent_t e, cudaStream_t s);
  void wait_event(cudaStream_t s, cudaEvent_t e);
  void join(cudaStream_t waiter, cudaStream_t other);  // waiter waits for other's work so far
  // Entry barrier with every peer, carrying the plan's token; ``started``: also raise this rank's
  // own "barrier started" slot once the barrier kernel runs (consumed by wait_started).
  void barrier(cudaStream_t s, uint32_t token, bool started);
  void wait_started(cudaStream_t s);
  // A stream write (no SM) of ``value`` into slot ``slot`` of ``peer``'s pad.
  void write_slot(cudaStream_t s, int64_t peer, int64_t slot, uint32_t value);
  void put(cudaStream_t s, int64_t peer, int channel) { write_slot(s, peer, channel * world_ + rank_, 1u); }
  void wait_signal(cudaStream_t s, int64_t src, int channel);  // consumes src's put on ``channel``
  // comm: this rank's shard ``a`` (``bytes``) into slot ``rank`` of every peer's workspace, rank + 1
  // first, each copy followed by a put on ``channel`` (a data signal, or the fused kernel's level
  // flag); ``first`` (if any) recorded after the first push.
  void push_shard(const at::Tensor& a, size_t bytes, int channel, cudaEvent_t first);
  // comm: the entry barrier, then push_shard; current: this rank's own rows into its slot once
  // the barrier has passed (the one-shot and fused all-gathers).
  void gather_into_workspace(const Plan& p, const at::Tensor& a, size_t bytes, int channel, cudaStream_t cur);
  void copy(void* dst, const void* src, size_t bytes, cudaStream_t s);
  // An executable graph of what ``body`` enqueues on the stream it is given (copies and stream
  // writes at fixed addresses), captured on a private stream as the caller's own capture would
  // hold them: copy nodes, and the stream writes as memset nodes (write_slot while capturing_).
  cudaGraphExec_t graph_of(const std::function<void(cudaStream_t)>& body);
  char* buffer(int64_t peer) const { return ws_ptrs_[peer]; }
  at::Tensor view(void* p, at::IntArrayRef sizes, at::ScalarType dtype) const;
  at::Tensor own_pad_slots(int64_t first, int64_t count) const;  // int32 slots of this rank's pad
  void check_workspace(const Plan& plan, const char* op) const;
  // What the AG strategies over the workspace start from (after check_workspace): the input as
  // [rows, k], this rank's workspace as [W * rows, k] (rank s's rows at s * rows), the bytes of
  // one shard and the current stream.
  struct AgOperands {
    at::Tensor a, slots;
    size_t shard = 0;
    cudaStream_t cur = nullptr;
  };
  AgOperands ag_operands(const Plan& p, const at::Tensor& input, const char* op) const;

  std::string group_name_;
  int64_t rank_, world_;
  c10::Device device_;
  bool nccl_;
  int64_t timeout_ms_;
  uint32_t* error_record_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;  // NCCL groups: the collectives of 'sequential'
  cudaStream_t comm_ = nullptr, signal_ = nullptr, capture_ = nullptr;  // capture_: graph_of's
  std::vector<cudaEvent_t> events_;
  size_t next_event_ = 0;
  // Workspace (set_workspace).
  std::vector<at::Tensor> ws_buffers_;
  std::vector<char*> ws_ptrs_;
  std::vector<uint32_t*> pads_;
  uint32_t** pads_dev_ = nullptr;
  int64_t buffers_dev_ = 0, base_offset_ = 0, pad_words_ = 0, ws_bytes_ = 0;
  uint64_t ws_generation_ = 0;  // counts set_workspace calls: what Plan::push_graphs were made on
  at::Tensor own_pad_;
  bool drop_transfers_ = false, push_before_fused_ = false;
  bool capturing_ = false;  // the current call is being captured into a CUDA graph (set by run)

  struct KeyHash {
    size_t operator()(const std::vector<int64_t>& v) const noexcept;
  };
  std::unordered_map<std::vector<int64_t>, std::shared_ptr<Plan>, KeyHash> plans_;
};

// Launchers of the signal kernels (csrc/runtime/signals.cu).
void launch_barrier(uint32_t** pads_dev, int channel, int rank, int world, uint64_t timeout_ms, uint32_t* started,
                    uint32_t token, uint32_t* error_record, cudaStream_t stream);
void launch_wait(uint32_t* slot, int channel, int rank, int peer, uint64_t timeout_ms, cudaStream_t stream);

// Views made without the dispatcher (a narrow() is three dispatched ops, ~1 µs each on the host):
// a tensor sharing ``t``'s storage and version counter, with the given sizes, strides and element
// offset from ``t``'s first element. The callers only view contiguous tensors within their bounds.
at::Tensor strided_view(const at::Tensor& t, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset);
// Rows [first, first + count) of a contiguous tensor of rows (dim 0), as [count, rest...].
at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t count);
// A plan's output: the caller's ``out`` viewed as [rows, n], or a new tensor like ``like`` in ``dtype``.
at::Tensor output_or_empty(const std::optional<at::Tensor>& out, int64_t rows, int64_t n, const at::Tensor& like,
                           at::ScalarType dtype);

// The GEMM of every strategy: out = a @ W (+ bias), W [N, K] (nk) or [K, N]; written into ``out``.
void gemm_into(at::Tensor out, const at::Tensor& a, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               bool nk);

}  // namespace flux
