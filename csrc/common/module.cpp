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

// The hot path: (out, gathered-or-None) for ag_gemm, out for gemm_rs; None when this call has no
// plan yet (the caller takes the slow path, which makes one).
py::object call(Runtime& rt, int64_t op, const at::Tensor& input, const at::Tensor& weight, const OptTensor& bias,
                const OptTensor& out, int64_t layout, int64_t out_dtype, bool gathered) {
  auto plan = rt.lookup(op, input, weight, bias, out, layout, out_dtype, gathered);
  if (!plan) return py::none();
  auto [res, g] = rt.run(*plan, input, weight, bias, out);
  if (op == (int64_t)flux::OpKind::AgGemm) return py::make_tuple(res, g);
  return py::cast(res);
}

py::object run(Runtime& rt, const std::shared_ptr<Plan>& plan, const at::Tensor& input, const at::Tensor& weight,
               const OptTensor& bias, const OptTensor& out) {
  auto [res, g] = rt.run(*plan, input, weight, bias, out);
  if (plan->op == flux::OpKind::AgGemm) return py::make_tuple(res, g);
  return py::cast(res);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "flux CUDA kernels (torch.ops.flux.*) and the per-call runtime (flux._C.Runtime)";
  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def_property_readonly("workspace_bytes", [](const Plan& p) { return p.workspace_bytes; })
      .def_property_readonly("token", [](const Plan& p) { return (int64_t)p.token; })
      .def_property_readonly("strategy", [](const Plan& p) { return (int64_t)p.strategy; });
  py::class_<Runtime, std::shared_ptr<Runtime>>(m, "Runtime")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool, int64_t, int64_t>(), py::arg("group_name"),
           py::arg("rank"), py::arg("world"), py::arg("device"), py::arg("nccl"), py::arg("timeout_ms"),
           py::arg("error_record"))
      .def("set_workspace", &Runtime::set_workspace)
      .def_property_readonly("workspace_bytes", &Runtime::workspace_bytes)
      .def("make_plan", &Runtime::make_plan)
      .def("add_plan", &Runtime::add_plan)
      .def("clear_plans", &Runtime::clear_plans)
      .def_property_readonly("num_plans", &Runtime::num_plans)
      .def("call", &call)
      .def("run", &run)
      .def("enqueue_barrier", &Runtime::enqueue_barrier)
      .def("begin_exchange", &Runtime::begin_exchange)
      .def("send", &Runtime::send)
      .def("wait_from", &Runtime::wait_from)
      .def("end_exchange", &Runtime::end_exchange)
      .def("set_drop_transfers", &Runtime::set_drop_transfers)
      .def("set_push_before_fused", &Runtime::set_push_before_fused)
      .def_property_readonly("comm_stream", &Runtime::comm_stream)
      .def_property_readonly("rank", &Runtime::rank)
      .def_property_readonly("world", &Runtime::world)
      .def_property_readonly("device", &Runtime::device);
}
