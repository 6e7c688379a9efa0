// gpuwire's native client helpers (see native.py): the device guard, the wire descriptors of
// gpuwire tensors, read straight from their TensorImpl, and the kernels of view ops. Only c10,
// the dispatcher's and Python's headers: the module builds in seconds against any torch.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "../_native_common.h"

#include <cstdint>
#include <string>

namespace {

using gpuwire_common::int_tuple;
using gpuwire_common::kScalarTypes;
using gpuwire_common::pack_array_header;
using gpuwire_common::pack_int;
using gpuwire_common::pack_uint;

// ------------------------------------------------------------------ the device guard

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

c10::Device device() { return c10::Device(kType, 0); }
c10::Stream default_stream() { return c10::Stream(c10::Stream::DEFAULT, device()); }

// The answers of torch._C._acc's Python guard (one device, index 0, the default stream, events
// and streams as no-ops), without a call into Python for each.
struct GpuwireGuard final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device) const override { return device(); }
  c10::Device getDevice() const override { return device(); }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override { return default_stream(); }
  c10::Stream getNewStream(c10::Device, int) const override { return default_stream(); }
  c10::Stream exchangeStream(c10::Stream) const noexcept override { return default_stream(); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
};

GpuwireGuard guard;

PyObject* install_guard(PyObject*, PyObject*) {
  c10::impl::device_guard_impl_registry[static_cast<size_t>(kType)].store(&guard);
  return PyLong_FromLong(static_cast<long>(guard.type()));
}

// ------------------------------------------------------------------ view kernels

// A view is metadata over its input's storage, so CPU's kernel makes it for a gpuwire tensor
// too: the Python kernel these replace redispatched to it as well, through the GIL and a Python
// call (on autograd's device thread too), for the most frequent ops of all.
void view_on_cpu_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// never freed: the registrations last as long as the process (no teardown-order questions)
torch::Library* view_library = nullptr;

// register_views(["view", "split.Tensor", ...]): this kernel for each aten op, at PrivateUse1
PyObject* register_views(PyObject*, PyObject* names) {
  PyObject* seq = PySequence_Fast(names, "register_views takes a list of op names");
  if (!seq) return nullptr;
  std::vector<std::string> wanted;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* name = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (!name) {
      Py_DECREF(seq);
      return nullptr;
    }
    wanted.emplace_back(name);
  }
  Py_DECREF(seq);
  try {
    if (!view_library) {
      view_library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    }
    for (const std::string& name : wanted) {
      view_library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&view_on_cpu_kernel>());
    }
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// ------------------------------------------------------------------ tensor descriptors

// set by configure(): what the descriptors need from Python
PyObject* tensor_type = nullptr;  // torch.Tensor
PyObject* ext_type = nullptr;     // msgpack.ExtType
PyObject* ext_code = nullptr;     // codec.EXT_TENSOR (an int)
PyObject* fallback = nullptr;     // wire.encode_default: everything this module does not encode
PyObject* cdata_name = nullptr;   // "_cdata"
int dtype_codes[kScalarTypes];          // c10::ScalarType -> gpuwire dtype code (-1: none)
PyObject* dtype_objects[kScalarTypes];  // c10::ScalarType -> torch.dtype

// The TensorImpl of a plain gpuwire tensor (strided, on a storage, no Python or functorch
// wrapping), or nullptr: everything else takes the Python path, which raises or encodes it.
c10::TensorImpl* gpuwire_impl(PyObject* obj) {
  if (tensor_type == nullptr || !PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(tensor_type))) {
    return nullptr;
  }
  PyObject* cdata = PyObject_GetAttr(obj, cdata_name);
  if (cdata == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  auto* impl = static_cast<c10::TensorImpl*>(PyLong_AsVoidPtr(cdata));
  Py_DECREF(cdata);
  if (impl == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  const c10::DispatchKeySet keys = impl->key_set();
  if (!keys.has(c10::DispatchKey::PrivateUse1) || keys.has(c10::DispatchKey::Python) ||
      impl->layout() != c10::kStrided || !impl->has_storage() || impl->has_symbolic_sizes_strides()) {
    return nullptr;
  }
  const auto scalar_type = static_cast<int>(impl->dtype().toScalarType());
  if (scalar_type < 0 || scalar_type >= kScalarTypes || dtype_codes[scalar_type] < 0) {
    return nullptr;
  }
  return impl;
}

// (storage id, the descriptor's msgpack bytes) of a gpuwire tensor: (pointer, offset, sizes,
// strides, dtype code, conj | neg << 1), as wire.encode_default packs it
uint64_t describe(c10::TensorImpl* impl, std::string& out) {
  const auto storage_id = reinterpret_cast<uint64_t>(impl->unsafe_storage().unsafeGetStorageImpl()->data());
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  pack_array_header(out, 6);
  pack_uint(out, storage_id);
  pack_int(out, impl->storage_offset());
  pack_array_header(out, sizes.size());
  for (const auto size : sizes) pack_int(out, size);
  pack_array_header(out, strides.size());
  for (const auto stride : strides) pack_int(out, stride);
  pack_int(out, dtype_codes[static_cast<int>(impl->dtype().toScalarType())]);
  pack_int(out, (impl->is_conj() ? 1 : 0) | (impl->is_neg() ? 2 : 0));
  return storage_id;
}

PyObject* make_ext(const std::string& bytes) {
  auto* type = reinterpret_cast<PyTypeObject*>(ext_type);
  PyObject* ext = type->tp_alloc(type, 2);
  if (ext == nullptr) return nullptr;
  PyObject* data = PyBytes_FromStringAndSize(bytes.data(), static_cast<Py_ssize_t>(bytes.size()));
  if (data == nullptr) {
    Py_DECREF(ext);
    return nullptr;
  }
  Py_INCREF(ext_code);
  PyTuple_SET_ITEM(ext, 0, ext_code);
  PyTuple_SET_ITEM(ext, 1, data);
  return ext;
}

// msgpack's ``default`` hook: a gpuwire tensor's descriptor here, anything else by the fallback
PyObject* encode_default(PyObject*, PyObject* obj) {
  c10::TensorImpl* impl = gpuwire_impl(obj);
  if (impl == nullptr) {
    return PyObject_CallOneArg(fallback, obj);
  }
  std::string bytes;
  bytes.reserve(48);
  describe(impl, bytes);
  return make_ext(bytes);
}

// wire.encode_device_tensors: (key, encoded, storage ids) of a list of gpuwire tensors, or None
PyObject* encode_device_tensors(PyObject*, PyObject* items) {
  PyObject* seq = PySequence_Fast(items, "a list of tensors");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** elements = PySequence_Fast_ITEMS(seq);
  PyObject* key = PyTuple_New(n);
  PyObject* encoded = PyList_New(n);
  PyObject* ids = PyList_New(n);
  std::string bytes;
  if (key == nullptr || encoded == nullptr || ids == nullptr) goto fail;
  for (Py_ssize_t i = 0; i < n; ++i) {
    c10::TensorImpl* impl = gpuwire_impl(elements[i]);
    if (impl == nullptr) {
      if (PyErr_Occurred()) goto fail;
      Py_DECREF(seq); Py_DECREF(key); Py_DECREF(encoded); Py_DECREF(ids);
      Py_RETURN_NONE;
    }
    bytes.clear();
    const uint64_t storage_id = describe(impl, bytes);
    PyObject* ext = make_ext(bytes);
    PyObject* id = PyLong_FromUnsignedLongLong(storage_id);
    PyObject* dtype = dtype_objects[static_cast<int>(impl->dtype().toScalarType())];
    Py_INCREF(dtype);
    PyObject* item_key = Py_BuildValue("(NNNi)", dtype, int_tuple(impl->sizes()), int_tuple(impl->strides()),
                                       (impl->is_conj() ? 1 : 0) | (impl->is_neg() ? 2 : 0));
    if (ext == nullptr || id == nullptr || item_key == nullptr) {
      Py_XDECREF(ext); Py_XDECREF(id); Py_XDECREF(item_key);
      goto fail;
    }
    PyList_SET_ITEM(encoded, i, ext);
    PyList_SET_ITEM(ids, i, id);
    PyTuple_SET_ITEM(key, i, item_key);
  }
  Py_DECREF(seq);
  return Py_BuildValue("(NNN)", key, encoded, ids);
fail:
  Py_DECREF(seq);
  Py_XDECREF(key);
  Py_XDECREF(encoded);
  Py_XDECREF(ids);
  return nullptr;
}

// configure(torch.Tensor, msgpack.ExtType, EXT_TENSOR, encode_default, {scalar type: (code, dtype)})
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *tensor, *ext, *code, *fallback_default, *table;
  if (!PyArg_ParseTuple(args, "OOOOO!", &tensor, &ext, &code, &fallback_default, &PyDict_Type, &table)) return nullptr;
  if (!PyType_Check(ext) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(ext), &PyTuple_Type)) {
    PyErr_SetString(PyExc_TypeError, "ExtType must be a tuple subclass");
    return nullptr;
  }
  for (int i = 0; i < kScalarTypes; ++i) {
    dtype_codes[i] = -1;
    Py_CLEAR(dtype_objects[i]);
  }
  if (gpuwire_common::read_dtype_table(table, [](int index, int code, PyObject* dtype) {
        dtype_codes[index] = code;
        Py_INCREF(dtype);
        dtype_objects[index] = dtype;
      }) < 0) {
    return nullptr;
  }
  for (PyObject** slot : {&tensor_type, &ext_type, &ext_code, &fallback}) Py_CLEAR(*slot);
  Py_INCREF(tensor); tensor_type = tensor;
  Py_INCREF(ext); ext_type = ext;
  Py_INCREF(code); ext_code = code;
  Py_INCREF(fallback_default); fallback = fallback_default;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"install_guard", install_guard, METH_NOARGS, "Install the C++ device guard for PrivateUse1."},
    {"configure", configure, METH_VARARGS, "Give the descriptor encoder its Python objects."},
    {"encode_default", encode_default, METH_O, "msgpack default hook: gpuwire tensors natively."},
    {"encode_device_tensors", encode_device_tensors, METH_O, "(key, encoded, storage ids) of a tensor list, or None."},
    {"scalar_type", gpuwire_common::scalar_type, METH_O, "The c10::ScalarType number of a tensor's dtype."},
    {"register_views", register_views, METH_O, "Register the C++ view kernel for these aten ops at PrivateUse1."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuwire_native", "gpuwire's native client helpers", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_gpuwire_native() {
  cdata_name = PyUnicode_InternFromString("_cdata");
  for (int i = 0; i < kScalarTypes; ++i) dtype_codes[i] = -1;
  return PyModule_Create(&module);
}
