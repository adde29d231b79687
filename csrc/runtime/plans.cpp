// Plans: what the slow path (flux/ops/_plans.py) leaves for a problem, the key that finds one
// for a call (everything the plan depends on), and Runtime::run, which sends a plan to the member
// that runs its strategy (one per row of FLUX_PLAN_STRATEGIES, strategies.h).
#include <ATen/ATen.h>

#include "runtime/runtime.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/check.h"

namespace flux {
namespace {

constexpr const char* kOp = "runtime";

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

Plan::~Plan() {
  // In-flight launches finish first (the driver frees an executing graph once it completes); at
  // process exit the driver may be gone already, hence no check.
  for (cudaGraphExec_t g : push_graphs) {
    if (g != nullptr) (void)cudaGraphExecDestroy(g);
  }
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

}  // namespace flux
