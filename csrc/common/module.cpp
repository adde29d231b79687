// The Python module flux._C. Importing it runs the static TORCH_LIBRARY registrations of
// torch_bindings.cpp (the kernels, reached as torch.ops.flux.*), and it holds the one Python
// class of the per-call path: flux._C.Runtime (csrc/runtime/runtime.h), reached from
// flux/ops/_plans.py only.
#include <torch/extension.h>

#include "runtime/runtime.h"

namespace py = pybind11;

namespace {

using flux::Plan;
using flux::Runtime;
using OptTensor = std::optional<at::Tensor>;

// Enqueue ``plan``: (out, gathered-or-None) for ag_gemm, out for gemm_rs.
py::object run(Runtime& rt, const Plan& plan, const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
               const OptTensor& out) {
  auto [res, g] = rt.run(plan, input, weight, bias, out);
  if (plan.op == flux::OpKind::AgGemm) return py::make_tuple(res, g);
  return py::cast(res);
}

// The hot path: run's result, or None when this call has no plan yet (the caller takes the slow
// path, which makes one).
py::object call(Runtime& rt, int64_t op, const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                const OptTensor& out, int64_t layout, int64_t out_dtype, bool gathered) {
  auto plan = rt.lookup(op, input, weight, bias, out, layout, out_dtype, gathered);
  return plan ? run(rt, *plan, input, weight, bias, out) : py::none();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flux CUDA kernels (torch.ops.flux.*) and the per-call runtime (flux._C.Runtime)";
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def_property_readonly("workspace_bytes", [](const Plan& p) { return p.workspace_bytes; })
      .def_property_readonly("token", [](const Plan& p) { return (int64_t)p.token; })
      .def_property_readonly("strategy", [](const Plan& p) { return (int64_t)p.strategy; });
  py::class_<Runtime, std::shared_ptr<Runtime>> rt(m, "Runtime");
  rt.def(py::init<const std::string&, int64_t, int64_t, int64_t, bool, int64_t, int64_t>(), py::arg("group_name"),
         py::arg("rank"), py::arg("world"), py::arg("device"), py::arg("nccl"), py::arg("timeout_ms"),
         py::arg("error_record"));
  rt.def("call", &call).def("run", &run);
  // Runtime's own members keep their C++ names in Python (runtime.h documents them).
#define FLUX_METHOD(NAME) rt.def(#NAME, &Runtime::NAME);
#define FLUX_PROPERTY(NAME) rt.def_property_readonly(#NAME, &Runtime::NAME);
  FLUX_METHOD(set_workspace) FLUX_METHOD(make_plan) FLUX_METHOD(add_plan) FLUX_METHOD(clear_plans)
  FLUX_METHOD(enqueue_barrier) FLUX_METHOD(begin_exchange) FLUX_METHOD(send) FLUX_METHOD(wait_from)
  FLUX_METHOD(end_exchange) FLUX_METHOD(set_drop_transfers) FLUX_METHOD(set_push_before_fused)
  FLUX_PROPERTY(workspace_bytes) FLUX_PROPERTY(num_plans) FLUX_PROPERTY(comm_stream) FLUX_PROPERTY(rank)
  FLUX_PROPERTY(world) FLUX_PROPERTY(device)
#undef FLUX_PROPERTY
#undef FLUX_METHOD
}
