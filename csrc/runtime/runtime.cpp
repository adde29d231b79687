// flux::Runtime: streams, pooled events, signals, the workspace and the plan cache
// (runtime.h). The strategies themselves are in csrc/ag_gemm/ag_gemm_plan.cpp and
// csrc/gemm_rs/gemm_rs_plan.cpp.
#include "runtime/runtime.h"

#include <cuda.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/strides.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "common/check.h"

namespace flux {
namespace {

constexpr const char* kOp = "runtime";
constexpr size_t kEventsPerCall = 128;  // a call uses at most (W - 1) chunks + W + 4 (W <= 16, chunks <= 7)

// Stream memory operations through the driver's entry points (no link against libcuda): a
// stream write of a 32-bit value needs no SM, so it runs while a persistent GEMM holds them all.
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using MemsetD32Async = CUresult (*)(CUdeviceptr, unsigned int, size_t, CUstream);

template <typename F>
F driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
  FLUX_CUDA(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status));
#else
  FLUX_CUDA(cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &status));
#endif
  FLUX_CHECK(fn != nullptr && status == cudaDriverEntryPointSuccess, kOp, "the CUDA driver has no ", name);
  return reinterpret_cast<F>(fn);
}

WriteValue32 write_value32() {
  static const WriteValue32 fn = driver_entry<WriteValue32>("cuStreamWriteValue32");
  return fn;
}

MemsetD32Async memset_d32() {
  static const MemsetD32Async fn = driver_entry<MemsetD32Async>("cuMemsetD32Async");
  return fn;
}

bool contiguous_on(const at::Tensor& t, const c10::Device& d) { return t.device() == d && t.is_contiguous(); }

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr()), b0 = reinterpret_cast<uintptr_t>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// The key of a call: everything a plan depends on. Empty when the call is outside what plans
// cover (the slow path then checks it and raises, or runs it).
std::vector<int64_t> key_of(int64_t op, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out,
                            int64_t layout, int64_t out_dtype, bool gathered, const c10::Device& device) {
  std::vector<int64_t> key;
  if (!contiguous_on(input, device) || !contiguous_on(weight, device) || weight.dim() != 2 || input.dim() < 2) {
    return key;
  }
  if (bias.has_value() && !contiguous_on(*bias, device)) return key;
  if (out.has_value() && (!contiguous_on(*out, device) || overlaps(*out, input) || overlaps(*out, weight) ||
                          (bias.has_value() && overlaps(*out, *bias)))) {
    return key;
  }
  key.reserve(16 + input.dim() + (out.has_value() ? out->dim() : 0));
  key.push_back(op);
  key.push_back(layout);
  key.push_back(out_dtype);
  key.push_back(gathered);
  key.push_back((int64_t)input.scalar_type());
  key.push_back(input.dim());
  for (int64_t s : input.sizes()) key.push_back(s);
  key.push_back((int64_t)weight.scalar_type());
  key.push_back(weight.size(0));
  key.push_back(weight.size(1));
  if (bias.has_value()) {
    key.push_back((int64_t)bias->scalar_type());
    key.push_back(bias->dim());
    key.push_back(bias->numel());
  } else {
    key.push_back(-1);
  }
  if (out.has_value()) {
    key.push_back((int64_t)out->scalar_type());
    key.push_back(out->dim());
    for (int64_t s : out->sizes()) key.push_back(s);
  } else {
    key.push_back(-1);
  }
  return key;
}

}  // namespace

size_t Runtime::KeyHash::operator()(const std::vector<int64_t>& v) const noexcept {
  size_t h = 1469598103934665603ull;
  for (int64_t x : v) h = (h ^ (size_t)x) * 1099511628211ull;
  return h;
}

Runtime::Runtime(const std::string& group_name, int64_t rank, int64_t world, int64_t device, bool nccl,
                 int64_t timeout_ms, int64_t error_record)
    : group_name_(group_name),
      rank_(rank),
      world_(world),
      device_(c10::DeviceType::CUDA, (c10::DeviceIndex)device),
      nccl_(nccl),
      timeout_ms_(timeout_ms),
      error_record_(reinterpret_cast<uint32_t*>(error_record)) {
  FLUX_CHECK(world >= 1 && rank >= 0 && rank < world, kOp, "bad rank ", rank, " of ", world);
  const c10::cuda::CUDAGuard guard(device_);
  if (nccl_) pg_ = c10d::resolve_process_group(group_name_);
  int lo = 0, hi = 0;
  FLUX_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  // Highest priority: a copy or a wait queued behind a GEMM's blocks is scheduled first.
  FLUX_CUDA(cudaStreamCreateWithPriority(&comm_, cudaStreamNonBlocking, hi));
  FLUX_CUDA(cudaStreamCreateWithPriority(&signal_, cudaStreamNonBlocking, hi));
  FLUX_CUDA(cudaStreamCreateWithFlags(&capture_, cudaStreamNonBlocking));
  events_.resize(kEventsPerCall);
  for (auto& e : events_) FLUX_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  write_value32();  // resolve the driver entry points now, not in the first call
  memset_d32();
}

Plan::~Plan() {
  // In-flight launches finish first (the driver frees an executing graph once it completes); at
  // process exit the driver may be gone already, hence no check.
  for (cudaGraphExec_t g : push_graphs) {
    if (g != nullptr) (void)cudaGraphExecDestroy(g);
  }
}

Runtime::~Runtime() {
  // Streams and events are released with the process; destroying them here could race work
  // still queued on them when Python drops the object at exit.
}

void Runtime::set_workspace(const std::vector<at::Tensor>& buffers, const std::vector<int64_t>& pads,
                            int64_t pads_dev, int64_t buffers_dev, int64_t base_offset, int64_t pad_words) {
  FLUX_CHECK((int64_t)buffers.size() == world_ && (int64_t)pads.size() == world_, kOp,
             "one buffer and one signal pad per rank expected");
  FLUX_CHECK(pad_words >= (kSegmentChannel + 1) * world_, kOp, "signal pads of ", pad_words, " words are too small");
  ws_buffers_ = buffers;
  ws_ptrs_.clear();
  for (auto& b : ws_buffers_) ws_ptrs_.push_back(static_cast<char*>(b.data_ptr()));
  pads_.clear();
  for (int64_t p : pads) pads_.push_back(reinterpret_cast<uint32_t*>(p));
  pads_dev_ = reinterpret_cast<uint32_t**>(pads_dev);
  buffers_dev_ = buffers_dev;
  base_offset_ = base_offset;
  pad_words_ = pad_words;
  ws_bytes_ = buffers[rank_].numel();
  ++ws_generation_;
  own_pad_ = view(pads_[rank_], {pad_words}, at::kInt);
}

std::shared_ptr<Plan> Runtime::make_plan(int64_t op, int64_t strategy, const std::vector<int64_t>& params,
                                         int64_t token, const at::Tensor& input, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, bool nk, int64_t out_dtype,
                                         bool gathered) {
  FLUX_CHECK(op >= 0 && op < kNumOps, kOp, "unknown op ", op);
  FLUX_CHECK(strategy >= 0 && strategy < kNumStrategies, kOp, "unknown strategy ", strategy);
  FLUX_CHECK((int64_t)params.size() == kNumPlanParams, kOp, kNumPlanParams,
             " parameters expected (kPlanParamNames, csrc/runtime/strategies.h)");
  auto p = std::make_shared<Plan>();
  p->op = static_cast<OpKind>(op);
  p->strategy = static_cast<StrategyKind>(strategy);
  p->first8 = params[0];
  p->chunks = params[1];
  p->segments = params[2];
  p->config = params[3];
  p->swizzle = params[4];
  p->raster = params[5];
  p->token = (uint32_t)token;
  FLUX_CHECK(p->token != 0, kOp, "a plan's token must be non-zero");
  p->nk = nk;
  p->n = nk ? weight.size(0) : weight.size(1);
  p->k = nk ? weight.size(1) : weight.size(0);
  p->has_bias = bias.has_value();
  p->gathered = gathered;
  p->dtype = input.scalar_type();
  p->out_dtype = out_dtype < 0 ? p->dtype : static_cast<at::ScalarType>(out_dtype);
  const int64_t all_rows = input.numel() / std::max<int64_t>(1, p->k);
  const int64_t es = (int64_t)input.element_size();
  std::vector<int64_t> tail(input.sizes().begin() + 1, input.sizes().end() - 1);
  if (p->op == OpKind::AgGemm) {
    p->rows = all_rows;
    p->out_shape = {input.size(0) * world_};
    p->out_shape.insert(p->out_shape.end(), tail.begin(), tail.end());
    p->out_shape.push_back(p->n);
    p->gathered_shape = {input.size(0) * world_};
    p->gathered_shape.insert(p->gathered_shape.end(), tail.begin(), tail.end());
    p->gathered_shape.push_back(p->k);
    p->workspace_bytes = p->strategy == StrategyKind::Sequential ? 0 : world_ * p->rows * p->k * es;
  } else {
    FLUX_CHECK(input.size(0) % world_ == 0, kOp, "gemm_rs rows not divisible by the world size");
    p->rows = all_rows / world_;
    p->out_shape = {input.size(0) / world_};
    p->out_shape.insert(p->out_shape.end(), tail.begin(), tail.end());
    p->out_shape.push_back(p->n);
    const int64_t out_es = (int64_t)c10::elementSize(p->out_dtype);  // partials are in the output dtype
    switch (p->strategy) {
      case StrategyKind::Sequential: p->workspace_bytes = 0; break;
      // The inbox of the ring's partial sums, then this rank's staging of the sums it passes on.
      case StrategyKind::Fused: p->workspace_bytes = 2 * (world_ - 1) * p->rows * p->n * out_es; break;
      // The W slots of the partials, then this rank's staging of the peers' blocks.
      case StrategyKind::Decomposed: p->workspace_bytes = (2 * world_ - 1) * p->rows * p->n * out_es; break;
      default: p->workspace_bytes = world_ * p->rows * p->n * out_es; break;
    }
    FLUX_CHECK((p->strategy != StrategyKind::Decomposed && p->strategy != StrategyKind::DecomposedP2P) ||
                   (p->chunks >= 1 && p->chunks <= kMaxDataChannels),
               kOp, "chunks must be 1..", kMaxDataChannels);
  }
  FLUX_CHECK(p->strategy == StrategyKind::Sequential || world_ > 1, kOp, "overlapped strategies need 2+ ranks");
  // fp32 from bf16/fp16: the fused kernels write it from their fp32 epilogue (and, for gemm_rs,
  // pass fp32 partial sums); the other strategies through aten::mm's dtype_out.
  FLUX_CHECK(p->out_dtype == p->dtype ||
                 (p->out_dtype == at::kFloat && (p->dtype == at::kBFloat16 || p->dtype == at::kHalf)),
             kOp, "out_dtype ", p->out_dtype, " from ", p->dtype, " is not planned here");
  FLUX_CHECK(p->strategy != StrategyKind::Sequential || nccl_, kOp,
             "'sequential' runs here only on NCCL groups (others run it in Python)");
  return p;
}

void Runtime::add_plan(const std::shared_ptr<Plan>& plan, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out, int64_t layout,
                       int64_t out_dtype, bool gathered) {
  auto key = key_of((int64_t)plan->op, input, weight, bias, out, layout, out_dtype, gathered, device_);
  if (key.empty()) return;  // not cacheable: every such call takes the slow path
  if (plans_.size() >= 4096) plans_.clear();  // many shapes in one process: start over rather than grow
  plans_[std::move(key)] = plan;
}

std::shared_ptr<Plan> Runtime::lookup(int64_t op, const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out,
                                      int64_t layout, int64_t out_dtype, bool gathered) const {
  if (plans_.empty() || c10::cuda::current_device() != device_.index()) return nullptr;
  auto key = key_of(op, input, weight, bias, out, layout, out_dtype, gathered, device_);
  if (key.empty()) return nullptr;
  auto it = plans_.find(key);
  return it == plans_.end() ? nullptr : it->second;
}

namespace {
constexpr bool same_name(const char* a, const char* b) { return *a == *b && (*a == 0 || same_name(a + 1, b + 1)); }
// make_plan reads the parameter vector by position: the generated order must be this one.
static_assert(same_name(kPlanParamNames[0], "first8") && same_name(kPlanParamNames[1], "chunks") &&
                  same_name(kPlanParamNames[2], "segments") && same_name(kPlanParamNames[3], "config") &&
                  same_name(kPlanParamNames[4], "swizzle") && same_name(kPlanParamNames[5], "raster"),
              "flux/strategies.py PARAM_ORDER changed: update Runtime::make_plan");
std::tuple<at::Tensor, at::Tensor> as_result(std::tuple<at::Tensor, at::Tensor> r) { return r; }
std::tuple<at::Tensor, at::Tensor> as_result(at::Tensor out) { return {std::move(out), at::Tensor()}; }
}  // namespace

std::tuple<at::Tensor, at::Tensor> Runtime::run(const Plan& plan, const at::Tensor& input, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias,
                                                const std::optional<at::Tensor>& out) {
  const c10::cuda::CUDAGuard guard(device_);
  // Plans run on tensors that need no gradient (the autograd path calls them from a Function's
  // forward): the ATen ops below skip the autograd layer of the dispatcher.
  const at::AutoDispatchBelowAutograd below_autograd;
  begin_call();
  // Every stream of a call joins the current stream's capture, if any: one query serves them all.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FLUX_CUDA(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(device_.index()).stream(), &capture));
  capturing_ = capture != cudaStreamCaptureStatusNone;
  // One case per table entry of flux/strategies.py; AG returns (out, gathered), RS its output.
#define FLUX_RUN_STRATEGY(OP, STRATEGY, MEMBER)                                  \
  if (plan.op == OpKind::OP && plan.strategy == StrategyKind::STRATEGY) {        \
    return as_result(MEMBER(plan, input, weight, bias, out));                    \
  }
  FLUX_PLAN_STRATEGIES(FLUX_RUN_STRATEGY)
#undef FLUX_RUN_STRATEGY
  FLUX_CHECK(false, kOp, "no strategy ", (int64_t)plan.strategy, " for op ", (int64_t)plan.op);
}

at::Tensor Runtime::rs_decomposed(const Plan& p, const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out) {
  return rs_decomposed(p, input, weight, bias, out, false);
}

at::Tensor Runtime::rs_decomposed_p2p(const Plan& p, const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& out) {
  return rs_decomposed(p, input, weight, bias, out, true);
}

// ---- building blocks ------------------------------------------------------------------------

void Runtime::begin_call() { next_event_ = 0; }

cudaEvent_t Runtime::event() {
  FLUX_CHECK(next_event_ < events_.size(), kOp, "more than ", events_.size(), " events in one call");
  return events_[next_event_++];
}

void Runtime::record(cudaEvent_t e, cudaStream_t s) { FLUX_CUDA(cudaEventRecord(e, s)); }

void Runtime::wait_event(cudaStream_t s, cudaEvent_t e) { FLUX_CUDA(cudaStreamWaitEvent(s, e, 0)); }

void Runtime::join(cudaStream_t waiter, cudaStream_t other) {
  cudaEvent_t e = event();
  record(e, other);
  wait_event(waiter, e);
}

void Runtime::barrier(cudaStream_t s, uint32_t token, bool started) {
  uint32_t* started_slot = started ? pads_[rank_] + kStartedChannel * world_ + rank_ : nullptr;
  launch_barrier(pads_dev_, kBarrierChannel, (int)rank_, (int)world_, (uint64_t)timeout_ms_, started_slot, token,
                 error_record_, s);
}

void Runtime::enqueue_barrier(int64_t token) {
  FLUX_CHECK(!ws_ptrs_.empty(), kOp, "barrier without a workspace");
  FLUX_CHECK(token != 0, kOp, "a barrier's token must be non-zero");
  const c10::cuda::CUDAGuard guard(device_);
  barrier(at::cuda::getCurrentCUDAStream(device_.index()).stream(), (uint32_t)token, false);
}

void Runtime::begin_exchange(int64_t token) {
  FLUX_CHECK(!ws_ptrs_.empty(), kOp, "an exchange without a workspace");
  FLUX_CHECK(token != 0, kOp, "a barrier's token must be non-zero");
  const c10::cuda::CUDAGuard guard(device_);
  auto cur = at::cuda::getCurrentCUDAStream(device_.index()).stream();
  cudaStreamCaptureStatus status;
  FLUX_CUDA(cudaStreamIsCapturing(cur, &status));
  capturing_ = status != cudaStreamCaptureStatusNone;
  begin_call();
  join(comm_, cur);
  barrier(comm_, (uint32_t)token, false);
}

void Runtime::send(const at::Tensor& src, int64_t peer, int64_t offset, bool after_current) {
  FLUX_CHECK(peer >= 0 && peer < world_ && peer != rank_, kOp, "send to rank ", peer, " of ", world_,
             " (this is rank ", rank_, ")");
  FLUX_CHECK(src.is_contiguous() && src.device() == device_, kOp, "send: a contiguous tensor on this device expected");
  const int64_t bytes = src.numel() * src.element_size();
  FLUX_CHECK(offset >= 0 && offset + bytes <= ws_bytes_, kOp, "send of ", bytes, " B at ", offset,
             " exceeds the workspace (", ws_bytes_, " B)");
  const c10::cuda::CUDAGuard guard(device_);
  if (after_current) join(comm_, at::cuda::getCurrentCUDAStream(device_.index()).stream());
  if (drop_transfers_) return;
  copy(buffer(peer) + offset, src.data_ptr(), bytes, comm_);  // copy engine, over NVLink
  put(comm_, peer, kDataChannel);
}

void Runtime::wait_from(int64_t src) {
  FLUX_CHECK(!pads_.empty(), kOp, "wait_from without a workspace (begin_exchange first)");
  FLUX_CHECK(src >= 0 && src < world_ && src != rank_, kOp, "wait for rank ", src, " of ", world_);
  const c10::cuda::CUDAGuard guard(device_);
  wait_signal(at::cuda::getCurrentCUDAStream(device_.index()).stream(), src, kDataChannel);
}

void Runtime::end_exchange() {
  const c10::cuda::CUDAGuard guard(device_);
  join(at::cuda::getCurrentCUDAStream(device_.index()).stream(), comm_);
}

void Runtime::wait_started(cudaStream_t s) {
  launch_wait(pads_[rank_] + kStartedChannel * world_ + rank_, kStartedChannel, (int)rank_, (int)rank_,
              (uint64_t)timeout_ms_, s);
}

void Runtime::wait_signal(cudaStream_t s, int64_t src, int channel) {
  launch_wait(pads_[rank_] + channel * world_ + src, channel, (int)rank_, (int)src, (uint64_t)timeout_ms_, s);
}

void Runtime::write_slot(cudaStream_t s, int64_t peer, int64_t slot, uint32_t value) {
  auto addr = reinterpret_cast<CUdeviceptr>(pads_[peer] + slot);
  CUresult r;
  if (!capturing_) {
    // cuStreamWriteValue32's default flags put a system-wide memory fence before the write:
    // everything earlier on the stream (a copy-engine transfer, a kernel's stores) is visible
    // to whoever sees the value.
    r = write_value32()(reinterpret_cast<CUstream>(s), addr, value, 0);
  } else {
    // Under CUDA graph capture a memset node, as PyTorch's async-TP does: the graph orders it
    // after the copy node that precedes it in the stream.
    r = memset_d32()(addr, value, 1, reinterpret_cast<CUstream>(s));
  }
  FLUX_CHECK(r == CUDA_SUCCESS, kOp, "stream write to rank ", peer, "'s signal pad failed (CUresult ", (int)r, ")");
}

void Runtime::copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
  if (bytes) FLUX_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
}

cudaGraphExec_t Runtime::graph_of(const std::function<void(cudaStream_t)>& body) {
  const bool was = capturing_;
  cudaGraph_t graph = nullptr;
  FLUX_CUDA(cudaStreamBeginCapture(capture_, cudaStreamCaptureModeThreadLocal));
  capturing_ = true;
  try {
    body(capture_);
  } catch (...) {
    capturing_ = was;
    (void)cudaStreamEndCapture(capture_, &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    throw;
  }
  capturing_ = was;
  FLUX_CUDA(cudaStreamEndCapture(capture_, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  FLUX_CUDA(made);
  return exec;
}

at::Tensor Runtime::view(void* p, at::IntArrayRef sizes, at::ScalarType dtype) const {
  return at::for_blob(p, sizes).options(at::TensorOptions().dtype(dtype).device(device_)).target_device(device_)
      .make_tensor();
}

at::Tensor Runtime::own_pad_slots(int64_t first, int64_t count) const { return rows_of(own_pad_, first, count); }

void Runtime::check_workspace(const Plan& plan, const char* op) const {
  FLUX_CHECK(ws_bytes_ >= plan.workspace_bytes && !ws_ptrs_.empty(), op, "the workspace holds ", ws_bytes_,
             " B, the plan needs ", plan.workspace_bytes, " B (plans are made by flux/ops/_plans.py)");
}

at::Tensor strided_view(const at::Tensor& t, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()), t.key_set(),
                                                   t.dtype());
  impl->set_sizes_and_strides(sizes, strides, t.storage_offset() + offset);
  // Writes through the view count as writes to ``t`` (as through a narrow()).
  impl->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
  return at::Tensor(std::move(impl));
}

at::Tensor rows_of(const at::Tensor& t, int64_t first, int64_t count) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  const int64_t row = t.numel() / std::max<int64_t>(1, sizes[0]);
  FLUX_CHECK(t.is_contiguous() && first >= 0 && count >= 0 && first + count <= sizes[0], kOp, "rows ", first, "..",
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
