// gpuwire's autocast kernels in C++ (see autocast.py): CUDA's own op lists and cast policies,
// taken from ATen's autocast_mode.h (the macros PyTorch itself registers AutocastCUDA with),
// registered at AutocastPrivateUse1. What crosses the boundary: `register_kernels()` and
// `unregister_kernels()`, nothing else; casts go through the dispatcher to the device's
// `_to_copy` kernel, and autocast's weight-cast cache is ATen's, as on CUDA.
//
// Its own module because ATen's operator headers take ~10 s to compile: the other helpers
// build against the dispatcher's headers only.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/Functions.h>
#include <ATen/Operators.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <exception>

namespace {

using namespace at;  // (the header's signature lists name Tensor and Scalar unqualified)

torch::Library* library = nullptr;

void register_lists(torch::Library& m) {
#define GPUWIRE_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(GPUWIRE_LOWER_PRECISION_FP)
#define GPUWIRE_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(GPUWIRE_FP32)
#define GPUWIRE_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(GPUWIRE_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define GPUWIRE_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(GPUWIRE_PROMOTE)
}

PyObject* register_kernels(PyObject*, PyObject*) {
  if (library) Py_RETURN_NONE;
  try {
    library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutocastPrivateUse1, __FILE__,
                                 __LINE__);
    register_lists(*library);
  } catch (const std::exception& error) {
    delete library;  // (unregisters what was registered: all or nothing)
    library = nullptr;
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* unregister_kernels(PyObject*, PyObject*) {
  delete library;
  library = nullptr;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"register_kernels", register_kernels, METH_NOARGS,
     "Register CUDA's autocast lists and policies at AutocastPrivateUse1 (idempotent)."},
    {"unregister_kernels", unregister_kernels, METH_NOARGS, "Remove them again."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "gpuwire_autocast", "gpuwire's autocast kernels (C++).", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit_gpuwire_autocast() { return PyModule_Create(&module_def); }
