// torch.ops.flux.lt_gemm_: out = a @ weight^T (+ bias) through cuBLASLt with a chosen algorithm
// of cuBLASLt's heuristic list, and torch.ops.flux.lt_gemm_algos: how long that list is.
//
// Why: cuBLAS picks one kernel per problem from its heuristic, which does not count waves. On
// H200 it runs the 4096x8192x14336 row blocks of the decomposed AG+GEMM with 320x128 tiles
// (13 M tiles x 112 N tiles = 11.03 waves of 132 SMs: a twelfth wave with one tile per CTA of
// almost nothing else), while other kernels of the same list may fit the SMs better. The
// decomposed strategies take the index of the algorithm as a parameter, and the autotuner
// times a few (flux/autotune/space.py). Index 0 is cuBLASLt's own first choice.
//
// Row-major out[m, n] = a[m, k] @ weight[n, k]^T is, in cuBLASLt's column-major terms,
// out^T[n, m] = weight^T(op T on a k x n matrix, ld k) * a^T (k x m, ld k), "TN".
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "common/check.h"

#if defined(FLUX_WITH_CUBLASLT)
#include <cublasLt.h>
#endif

namespace flux {

#if defined(FLUX_WITH_CUBLASLT)
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;  // cuBLASLt's recommendation for Hopper
constexpr int kMaxAlgos = 8;

#define FLUX_LT_CHECK(expr, op)                                                                      \
  do {                                                                                             \
    const cublasStatus_t st_ = (expr);                                                             \
    FLUX_CHECK(st_ == CUBLAS_STATUS_SUCCESS, op, #expr " failed: cuBLASLt status ", (int)st_);     \
  } while (0)

// The descriptors of one problem and its heuristic list, made once per (problem, device).
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lw = nullptr, la = nullptr, lo = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
};

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, bool, int>;  // device, m, n, k, dtype, bias, align

std::mutex plans_mutex;
std::map<PlanKey, LtPlan> plans;

int alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  for (int a = 256; a > 1; a /= 2) {
    if (v % a == 0) return a;
  }
  return 1;
}

const LtPlan& plan_for(cublasLtHandle_t handle, int device, int64_t m, int64_t n, int64_t k, at::ScalarType dtype,
                       bool bias, int align, const char* op) {
  const PlanKey key{device, m, n, k, (int)dtype, bias, align};
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  LtPlan p;
  const cudaDataType_t t = dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  FLUX_LT_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), op);
  const cublasOperation_t trans = CUBLAS_OP_T, notrans = CUBLAS_OP_N;
  FLUX_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)), op);
  FLUX_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &notrans, sizeof(notrans)), op);
  if (bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    FLUX_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), op);
    FLUX_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &t, sizeof(t)), op);
  }
  FLUX_LT_CHECK(cublasLtMatrixLayoutCreate(&p.lw, t, k, n, k), op);  // weight [n, k] row-major = k x n, ld k
  FLUX_LT_CHECK(cublasLtMatrixLayoutCreate(&p.la, t, k, m, k), op);  // a [m, k] row-major = k x m, ld k
  FLUX_LT_CHECK(cublasLtMatrixLayoutCreate(&p.lo, t, n, m, n), op);  // out [m, n] row-major = n x m, ld n
  cublasLtMatmulPreference_t pref;
  FLUX_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), op);
  const size_t ws = kWorkspaceBytes;
  FLUX_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
                op);
  const uint32_t al = (uint32_t)align;
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    FLUX_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al)), op);
  }
  p.algos.resize(kMaxAlgos);
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.lw, p.la, p.lo, p.lo, pref, kMaxAlgos,
                                                           p.algos.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  p.algos.resize(st == CUBLAS_STATUS_SUCCESS ? found : 0);
  return plans.emplace(key, std::move(p)).first->second;
}

void check_args(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                const char* op) {
  FLUX_CHECK(a.is_cuda() && weight.is_cuda() && out.is_cuda(), op, "CUDA tensors expected");
  FLUX_CHECK(a.dim() == 2 && weight.dim() == 2 && out.dim() == 2, op, "2-D a, weight and out expected");
  FLUX_CHECK(a.is_contiguous() && weight.is_contiguous() && out.is_contiguous(), op, "contiguous tensors expected");
  const auto dt = a.scalar_type();
  FLUX_CHECK((dt == at::kBFloat16 || dt == at::kHalf) && weight.scalar_type() == dt && out.scalar_type() == dt, op,
             "bf16 or fp16 a, weight and out of one dtype expected");
  FLUX_CHECK(weight.size(1) == a.size(1) && out.size(0) == a.size(0) && out.size(1) == weight.size(0), op,
             "shape mismatch: a ", a.sizes(), ", weight ", weight.sizes(), ", out ", out.sizes());
  if (bias.has_value()) {
    FLUX_CHECK(bias->is_cuda() && bias->scalar_type() == dt && bias->numel() == weight.size(0) && bias->is_contiguous(),
               op, "bias must be a contiguous CUDA tensor of N elements in the input dtype");
  }
}

}  // namespace

int64_t lt_gemm_algos(const at::Tensor& out, const at::Tensor& a, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "lt_gemm_algos";
  at::Tensor o = out;
  check_args(o, a, weight, bias, op);
  const c10::cuda::CUDAGuard guard(a.device());
  const int align = std::min({alignment_of(a.data_ptr()), alignment_of(weight.data_ptr()),
                              alignment_of(out.data_ptr()), 16});
  return (int64_t)plan_for(at::cuda::getCurrentCUDABlasLtHandle(), a.get_device(), a.size(0), weight.size(0),
                           a.size(1), a.scalar_type(), bias.has_value(), align, op)
      .algos.size();
}

void lt_gemm_(at::Tensor& out, const at::Tensor& a, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
              int64_t algo) {
  constexpr const char* op = "lt_gemm_";
  check_args(out, a, weight, bias, op);
  const int64_t m = a.size(0), n = weight.size(0), k = a.size(1);
  if (m == 0 || n == 0) return;
  FLUX_CHECK(k > 0, op, "K must be positive");
  const c10::cuda::CUDAGuard guard(a.device());
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const int align = std::min({alignment_of(a.data_ptr()), alignment_of(weight.data_ptr()),
                              alignment_of(out.data_ptr()), 16});
  const LtPlan& p = plan_for(handle, a.get_device(), m, n, k, a.scalar_type(), bias.has_value(), align, op);
  FLUX_CHECK(algo >= 0 && algo < (int64_t)p.algos.size(), op, "algorithm ", algo, " of cuBLASLt's list of ",
             p.algos.size(), " for this problem (M=", m, " N=", n, " K=", k, ") does not exist");
  // The descriptor is shared by every call of this problem: the bias pointer is set under the lock.
  const float alpha = 1.0f, beta = 0.0f;
  at::Tensor ws = at::empty({(int64_t)kWorkspaceBytes}, a.options().dtype(at::kByte));
  std::lock_guard<std::mutex> lock(plans_mutex);
  if (bias.has_value()) {
    const void* bp = bias->data_ptr();
    FLUX_LT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)), op);
  }
  FLUX_LT_CHECK(cublasLtMatmul(handle, p.desc, &alpha, weight.data_ptr(), p.lw, a.data_ptr(), p.la, &beta,
                               out.data_ptr(), p.lo, out.data_ptr(), p.lo, &p.algos[algo].algo, ws.data_ptr(),
                               kWorkspaceBytes, at::cuda::getCurrentCUDAStream()),
                op);
}

#else  // built without cuBLASLt

int64_t lt_gemm_algos(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  return 0;
}

void lt_gemm_(at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t) {
  FLUX_CHECK(false, "lt_gemm_", "flux._C was built without cuBLASLt (libcublasLt was not found at build time)");
}

#endif

}  // namespace flux
