// What gpuwire's two C++ helpers share (client/native.cpp, node/native.cpp; built by
// gpuwire/_native.py, which hashes this file with each source): msgpack's own integer and array
// encodings, tuples of ints, and the dtype table each receives from Python.
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <c10/core/TensorImpl.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

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

}  // namespace gpuwire_common
