// The Python module flux._C. It holds no Python functions: importing it runs the
// static TORCH_LIBRARY registrations of torch_bindings.cpp, and the ops are then
// reached as torch.ops.flux.*.
#include <Python.h>

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "flux CUDA kernels, registered as torch.ops.flux.*", -1, nullptr};
  return PyModule_Create(&module_def);
}
