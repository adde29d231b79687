// flux::Runtime's core (runtime.h): its streams, pooled events, the symmetric workspace, the
// signals (barrier, put, wait, stream writes) and copies that the strategies are built from, and
// the transfers the MoE ops drive from Python. Plans and the dispatch of a call to its strategy are
// in plans.cpp; the strategies themselves in csrc/ag_gemm/ag_gemm_plan.cpp and
// csrc/gemm_rs/gemm_rs_plan.cpp.
#include <ATen/ATen.h>

#include "runtime/runtime.h"

#include <cuda.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
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

}  // namespace

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

}  // namespace flux
