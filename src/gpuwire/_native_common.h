// What gpuwire's two C++ helpers share (client/native.cpp, node/native.cpp; built by
// gpuwire/_native.py, which hashes this file with each source): msgpack's own integer and array
// encodings, tuples of ints, and the dtype table each receives from Python.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <c10/core/TensorImpl.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpuwire_common {

constexpr int kScalarTypes = 64;  // c10::ScalarType numbers a table may hold
constexpr int kCodes = 64;        // gpuwire wire dtype codes a table may hold

inline void put_be(std::string& out, uint64_t value, int bytes) {
  for (int shift = 8 * (bytes - 1); shift >= 0; shift -= 8) out.push_back(static_cast<char>((value >> shift) & 0xff));
}

// msgpack's smallest encoding of each value, as msgpack-python's Packer writes it: a node caches
// views by a descriptor's bytes, so client and node must write the same bytes for one descriptor
inline void pack_uint(std::string& out, uint64_t v) {
  if (v < 0x80) out.push_back(static_cast<char>(v));
  else if (v < 0x100) { out.push_back('\xcc'); put_be(out, v, 1); }
  else if (v < 0x10000) { out.push_back('\xcd'); put_be(out, v, 2); }
  else if (v < 0x100000000ULL) { out.push_back('\xce'); put_be(out, v, 4); }
  else { out.push_back('\xcf'); put_be(out, v, 8); }
}

inline void pack_int(std::string& out, int64_t v) {
  if (v >= 0) {
    pack_uint(out, static_cast<uint64_t>(v));
    return;
  }
  const auto bits = static_cast<uint64_t>(v);
  if (v >= -32) out.push_back(static_cast<char>(bits & 0xff));
  else if (v >= -0x80) { out.push_back('\xd0'); put_be(out, bits, 1); }
  else if (v >= -0x8000) { out.push_back('\xd1'); put_be(out, bits, 2); }
  else if (v >= -0x80000000LL) { out.push_back('\xd2'); put_be(out, bits, 4); }
  else { out.push_back('\xd3'); put_be(out, bits, 8); }
}

inline void pack_array_header(std::string& out, size_t n) {
  if (n < 16) out.push_back(static_cast<char>(0x90 | n));
  else if (n < 0x10000) { out.push_back('\xdc'); put_be(out, n, 2); }
  else { out.push_back('\xdd'); put_be(out, n, 4); }
}

inline PyObject* int_tuple(c10::IntArrayRef values) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = PyLong_FromLongLong(values[i]);
    if (item == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
  }
  return tuple;
}

// The node's session state is plain Python attributes that its C++ hot path reads several
// times an op. Read from the instance's own dict they cost a hash probe; PyObject_GetAttr first
// looks each name up along the type's MRO (~25 % of the native loop's instructions for a small op,
// callgrind). These fall back to getattr/setattr for a name not in the dict (a class default,
// a property), so the result is always what Python would see.
class InstanceAttrs {
 public:
  // a strong reference to obj's instance dict (materialised if it was not); nullptr: none
  static PyObject* dict_of(PyObject* obj) {
    PyObject* dict = PyObject_GenericGetDict(obj, nullptr);
    if (dict == nullptr || !PyDict_CheckExact(dict)) {
      PyErr_Clear();
      Py_XDECREF(dict);
      return nullptr;
    }
    return dict;
  }
  // a new reference to obj.name (dict: obj's instance dict, or nullptr), or nullptr with an error
  static PyObject* get(PyObject* obj, PyObject* dict, PyObject* name) {
    if (dict != nullptr) {
      PyObject* value = PyDict_GetItemWithError(dict, name);
      if (value != nullptr) return Py_NewRef(value);
      if (PyErr_Occurred()) return nullptr;
    }
    return PyObject_GetAttr(obj, name);
  }
  static int set(PyObject* obj, PyObject* dict, PyObject* name, PyObject* value) {
    if (dict != nullptr && PyDict_Contains(dict, name) == 1) return PyDict_SetItem(dict, name, value);
    return PyObject_SetAttr(obj, name, value);
  }
  // obj.name is expected: 1, 0, or -1 with an error
  static int is(PyObject* obj, PyObject* dict, PyObject* name, PyObject* expected) {
    PyObject* value = get(obj, dict, name);
    if (value == nullptr) return -1;
    const int same = value == expected;
    Py_DECREF(value);
    return same;
  }
  // obj.name as an int into *out (0), or -1 with an error; *none (when given): it was None
  static int read_int(PyObject* obj, PyObject* dict, PyObject* name, int64_t* out, bool* none = nullptr) {
    PyObject* value = get(obj, dict, name);
    if (value == nullptr) return -1;
    if (none != nullptr) *none = value == Py_None;
    if (value == Py_None && none != nullptr) {
      Py_DECREF(value);
      return 0;
    }
    *out = PyLong_AsLongLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
  }
  static int write_int(PyObject* obj, PyObject* dict, PyObject* name, int64_t value) {
    PyObject* number = PyLong_FromLongLong(value);
    if (number == nullptr) return -1;
    const int rc = set(obj, dict, name, number);
    Py_DECREF(number);
    return rc;
  }
};

// Reads {c10 scalar type: (wire code, torch.dtype)} and calls store(scalar type, code, dtype)
// for each (the dtype borrowed); -1 with a Python error when an entry is out of range.
template <typename Store>
int read_dtype_table(PyObject* table, Store store) {
  PyObject *k, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(table, &pos, &k, &v)) {
    const long index = PyLong_AsLong(k);
    int code;
    PyObject* dtype;
    if (index < 0 || index >= kScalarTypes || !PyArg_ParseTuple(v, "iO", &code, &dtype) || code < 0 || code >= kCodes) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "scalar type or wire code out of range");
      return -1;
    }
    store(static_cast<int>(index), code, dtype);
  }
  return 0;
}

// scalar_type(tensor) -> the c10::ScalarType number of a tensor's dtype (to build the tables)
inline PyObject* scalar_type(PyObject*, PyObject* obj) {
  PyObject* cdata = PyObject_GetAttrString(obj, "_cdata");
  if (cdata == nullptr) return nullptr;
  auto* impl = static_cast<c10::TensorImpl*>(PyLong_AsVoidPtr(cdata));
  Py_DECREF(cdata);
  if (impl == nullptr) return nullptr;
  return PyLong_FromLong(static_cast<long>(impl->dtype().toScalarType()));
}

// quiet_warnings(True) ... quiet_warnings(False): c10 warnings (TORCH_WARN) on this thread are
// dropped in between (calls nest). For work that runs a kernel's checks without being the call
// whose warnings a program should see: the client's shape inference (the node's kernel says
// them, once), the node's meta pass before the kernel itself.
struct DroppedWarnings final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

inline PyObject* quiet_warnings(PyObject*, PyObject* on) {
  static thread_local DroppedWarnings dropped;
  static thread_local std::vector<c10::WarningHandler*> replaced;
  const int quiet = PyObject_IsTrue(on);
  if (quiet < 0) return nullptr;
  if (quiet) {
    replaced.push_back(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::set_warning_handler(&dropped);
  } else if (!replaced.empty()) {
    c10::WarningUtils::set_warning_handler(replaced.back());
    replaced.pop_back();
  }
  Py_RETURN_NONE;
}

}  // namespace gpuwire_common
