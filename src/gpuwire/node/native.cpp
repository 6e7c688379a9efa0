// gpuwire's native node helpers (see native.py): a session's hot path per op, the parts that
// are only reading tensor metadata and keeping Python dicts. Every branch that is not the plain
// case answers "not here" and the Python code (session.py) decides, raises or copies, so the
// two paths cannot disagree on anything but speed. Only c10 and Python headers.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include "../_native_common.h"

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace {

using gpuwire_common::InstanceAttrs;
using gpuwire_common::int_tuple;
using gpuwire_common::kCodes;
using gpuwire_common::kScalarTypes;
using gpuwire_common::pack_array_header;
using gpuwire_common::pack_int;

// set by configure()
PyObject* tensor_type = nullptr;  // torch.Tensor
long ext_tensor_code = -1;        // codec.EXT_TENSOR
PyObject* list_marker = nullptr;  // session._LIST
PyObject* kwargs_marker = nullptr;  // session._KWARGS
unsigned long long node_id_base = 0;  // session.NODE_ID_BASE: client ids stay below it
Py_ssize_t view_cache_max = 0;    // session.VIEW_CACHE_MAX
PyObject* dtype_objects[kScalarTypes];  // c10::ScalarType -> torch.dtype
int scalar_of_code[kCodes];             // wire dtype code -> c10::ScalarType (-1: none)

// attribute names, interned once
PyObject *s_cdata, *s_storages, *s_views, *s_view_keys, *s_memory_budget, *s_bytes_in_use, *s_peak_bytes,
    *s_live_ptrs, *s_release, *s_check_budget, *s_untyped_storage, *s_remember_view, *s_new;

// The TensorImpl of a torch.Tensor (exactly that type), or nullptr without an error set.
c10::TensorImpl* impl_of(PyObject* obj) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(tensor_type)) return nullptr;
  PyObject* cdata = PyObject_GetAttr(obj, s_cdata);
  if (cdata == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  auto* impl = static_cast<c10::TensorImpl*>(PyLong_AsVoidPtr(cdata));
  Py_DECREF(cdata);
  if (impl == nullptr) PyErr_Clear();
  return impl;
}

// ints in a tuple or list equal to ``values``, element for element (any other object: false)
bool same_ints(PyObject* seq, c10::IntArrayRef values) {
  if (!PyTuple_Check(seq) && !PyList_Check(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n != static_cast<Py_ssize_t>(values.size())) return false;
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(items[i])) return false;
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow || v != values[i]) return false;
  }
  return true;
}

// ------------------------------------------------------------------ descriptor views (decoding)

// Session._remember_view with room in the cache: ``entry`` as the view of descriptor ``data``,
// listed under its storage so that Free drops it. 0 done, 1 the cache is full (the Python
// method empties it), -1 an error.
int cache_view(PyObject* views, PyObject* view_keys, PyObject* storage_id, PyObject* data, PyObject* entry) {
  if (!PyDict_CheckExact(views) || !PyDict_CheckExact(view_keys) || PyDict_GET_SIZE(views) >= view_cache_max) return 1;
  const int known = PyDict_Contains(views, data);
  if (known < 0) return -1;
  if (!known) {
    PyObject* keys = PyDict_GetItemWithError(view_keys, storage_id);  // borrowed
    if (keys != nullptr && PyList_CheckExact(keys)) {
      if (PyList_Append(keys, data) < 0) return -1;
    } else {
      if (PyErr_Occurred()) return -1;
      PyObject* fresh = PyList_New(1);
      if (fresh == nullptr) return -1;
      Py_INCREF(data);
      PyList_SET_ITEM(fresh, 0, data);
      const int rc = PyDict_SetItem(view_keys, storage_id, fresh);
      Py_DECREF(fresh);
      if (rc < 0) return -1;
    }
  }
  return PyDict_SetItem(views, data, entry);
}

// TensorHook(views, view_keys, storages, bases, fallback): msgpack's ext_hook for a session. A
// tensor descriptor whose cached view is still valid (the same storage in the session's table,
// the view's metadata unchanged) is answered here, and so is a plain new one (a view inside its
// storage, of a dtype the session has made views of before); everything else, and every error,
// by ``fallback`` (Session.ext_hook), which says what is wrong.
struct TensorHook {
  PyObject_HEAD
  PyObject* views;      // descriptor bytes -> (storage id, storage, view, sizes, strides, offset)
  PyObject* view_keys;  // storage id -> [descriptor bytes cached in views]
  PyObject* storages;   // storage id -> storage
  PyObject* bases;      // dtype code -> the empty tensor views of that dtype are made from
  PyObject* fallback;
};

// a msgpack reader over one descriptor: only the encodings a descriptor's fields may use
struct Reader {
  const unsigned char* p;
  const unsigned char* end;
  bool ok = true;

  uint64_t be(int n) {
    if (end - p < n) { ok = false; return 0; }
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
    p += n;
    return v;
  }
  // an int in [0, 2**64) (negative ones: not ok, as the node refuses them)
  uint64_t uint() {
    if (p >= end) { ok = false; return 0; }
    const unsigned char c = *p++;
    if (c < 0x80) return c;
    switch (c) {
      case 0xcc: return be(1);
      case 0xcd: return be(2);
      case 0xce: return be(4);
      case 0xcf: return be(8);
      default: ok = false; return 0;
    }
  }
  size_t array() {
    if (p >= end) { ok = false; return 0; }
    const unsigned char c = *p++;
    if ((c & 0xf0) == 0x90) return c & 0x0f;
    if (c == 0xdc) return be(2);
    if (c == 0xdd) return be(4);
    ok = false;
    return 0;
  }
};

constexpr uint64_t kI62 = 1ULL << 62;
constexpr size_t kMaxDims = 64;  // (codec.MAX_DIMS allows more: those take the Python path)

// a new view for descriptor ``data``, cached, or nullptr (no error set) for the Python path
PyObject* new_view(TensorHook* self, PyObject* data) {
  char* buffer;
  Py_ssize_t length;
  if (PyBytes_AsStringAndSize(data, &buffer, &length) < 0) return nullptr;
  Reader r{reinterpret_cast<const unsigned char*>(buffer), reinterpret_cast<const unsigned char*>(buffer) + length};
  if (r.array() != 6 || !r.ok) return nullptr;
  const uint64_t storage_id = r.uint();
  const uint64_t offset = r.uint();
  const size_t dims = r.array();
  if (!r.ok || offset > kI62 || dims > kMaxDims) return nullptr;
  int64_t sizes[kMaxDims], strides[kMaxDims];
  for (size_t i = 0; i < dims; ++i) {
    const uint64_t v = r.uint();
    if (!r.ok || v > kI62) return nullptr;
    sizes[i] = static_cast<int64_t>(v);
  }
  if (r.array() != dims || !r.ok) return nullptr;
  for (size_t i = 0; i < dims; ++i) {
    const uint64_t v = r.uint();  // (a negative stride: the Python path refuses it)
    if (!r.ok || v > kI62) return nullptr;
    strides[i] = static_cast<int64_t>(v);
  }
  const uint64_t code = r.uint();
  const uint64_t flags = r.uint();
  if (!r.ok || r.p != r.end || flags != 0 || code >= kCodes || scalar_of_code[code] < 0) return nullptr;
  PyObject* id_obj = PyLong_FromUnsignedLongLong(storage_id);
  if (id_obj == nullptr) return nullptr;
  PyObject* code_obj = PyLong_FromUnsignedLongLong(code);
  PyObject* storage = PyDict_GetItemWithError(self->storages, id_obj);  // borrowed
  PyObject* base = code_obj ? PyDict_GetItemWithError(self->bases, code_obj) : nullptr;  // borrowed
  Py_XDECREF(code_obj);
  c10::StorageImpl* storage_impl = nullptr;
  if (storage != nullptr && base != nullptr) {
    PyObject* cdata = PyObject_GetAttr(storage, s_cdata);
    storage_impl = cdata ? static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(cdata)) : nullptr;
    Py_XDECREF(cdata);
  }
  c10::TensorImpl* base_impl = base ? impl_of(base) : nullptr;
  if (storage_impl == nullptr || base_impl == nullptr ||
      static_cast<int>(base_impl->dtype().toScalarType()) != scalar_of_code[code]) {
    Py_DECREF(id_obj);
    PyErr_Clear();
    return nullptr;
  }
  // Session.view's bounds: the last element the view reaches lies inside the storage (an
  // empty view reads nothing); never left to set_, which would grow the storage to fit
  const auto itemsize = static_cast<__int128>(base_impl->dtype().itemsize());
  __int128 high = static_cast<__int128>(offset), elements = 1;
  bool empty = false;
  for (size_t i = 0; i < dims; ++i) {
    if (sizes[i] == 0) empty = true;
    elements *= sizes[i];
    if (elements * itemsize >= (static_cast<__int128>(1) << 63)) {  // more than int64 counts: Python says so
      Py_DECREF(id_obj);
      return nullptr;
    }
    high += static_cast<__int128>(sizes[i] - 1) * strides[i];
  }
  if (empty) high = -1;
  if ((high + 1) * itemsize > static_cast<__int128>(storage_impl->nbytes())) {
    Py_DECREF(id_obj);
    return nullptr;
  }
  PyObject* view = PyObject_CallMethodNoArgs(base, s_new);
  c10::TensorImpl* impl = view ? impl_of(view) : nullptr;
  if (impl == nullptr) {
    Py_XDECREF(view);
    Py_DECREF(id_obj);
    PyErr_Clear();
    return nullptr;
  }
  try {
    impl->set_storage_keep_dtype(c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(storage_impl)));
    impl->set_sizes_and_strides(c10::IntArrayRef(sizes, dims), c10::IntArrayRef(strides, dims),
                                static_cast<int64_t>(offset));
  } catch (const std::exception&) {
    Py_DECREF(view);
    Py_DECREF(id_obj);
    return nullptr;
  }
  // cache it (Session._remember_view; a full cache: the Python path, which empties it)
  PyObject* sizes_tuple = int_tuple(c10::IntArrayRef(sizes, dims));
  PyObject* strides_tuple = int_tuple(c10::IntArrayRef(strides, dims));
  PyObject* offset_obj = PyLong_FromUnsignedLongLong(offset);
  PyObject* entry = (sizes_tuple && strides_tuple && offset_obj)
                        ? PyTuple_Pack(6, id_obj, storage, view, sizes_tuple, strides_tuple, offset_obj) : nullptr;
  Py_XDECREF(sizes_tuple); Py_XDECREF(strides_tuple); Py_XDECREF(offset_obj);
  const int rc = entry == nullptr ? -1 : cache_view(self->views, self->view_keys, id_obj, data, entry);
  Py_XDECREF(entry);
  Py_DECREF(id_obj);
  if (rc != 0) {
    Py_DECREF(view);
    PyErr_Clear();
    return nullptr;
  }
  return view;
}

PyObject* cached_view(TensorHook* self, PyObject* data) {
  PyObject* entry = PyDict_GetItemWithError(self->views, data);  // borrowed
  if (entry == nullptr || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 6) return nullptr;
  PyObject* current = PyDict_GetItemWithError(self->storages, PyTuple_GET_ITEM(entry, 0));
  if (current == nullptr || current != PyTuple_GET_ITEM(entry, 1)) return nullptr;
  PyObject* view = PyTuple_GET_ITEM(entry, 2);
  c10::TensorImpl* impl = impl_of(view);
  if (impl == nullptr || !same_ints(PyTuple_GET_ITEM(entry, 3), impl->sizes()) ||
      !same_ints(PyTuple_GET_ITEM(entry, 4), impl->strides())) {
    return nullptr;
  }
  PyObject* offset = PyTuple_GET_ITEM(entry, 5);
  if (!PyLong_CheckExact(offset) || PyLong_AsLongLong(offset) != impl->storage_offset()) {
    PyErr_Clear();
    return nullptr;
  }
  Py_INCREF(view);
  return view;
}

PyObject* hook_call(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<TensorHook*>(obj);
  if (self->fallback == nullptr) {
    PyErr_SetString(PyExc_TypeError, "TensorHook(views, view_keys, storages, bases, fallback) was not initialised");
    return nullptr;
  }
  long code = -1;
  if (kwargs == nullptr && PyTuple_GET_SIZE(args) == 2 && PyLong_CheckExact(PyTuple_GET_ITEM(args, 0))) {
    code = PyLong_AsLong(PyTuple_GET_ITEM(args, 0));
    if (code == -1 && PyErr_Occurred()) PyErr_Clear();  // (msgpack's codes fit a byte; the fallback decides)
  }
  if (code == ext_tensor_code && code >= 0) {
    PyObject* data = PyTuple_GET_ITEM(args, 1);
    PyObject* view = cached_view(self, data);
    if (view == nullptr && !PyErr_Occurred() && PyBytes_CheckExact(data)) view = new_view(self, data);
    if (view != nullptr) return view;
    if (PyErr_Occurred()) PyErr_Clear();  // (the fallback decides, and says what is wrong)
  }
  return PyObject_Call(self->fallback, args, kwargs);
}

int hook_init(PyObject* obj, PyObject* args, PyObject*) {
  auto* self = reinterpret_cast<TensorHook*>(obj);
  PyObject *views, *view_keys, *storages, *bases, *fallback;
  if (!PyArg_ParseTuple(args, "O!O!O!O!O", &PyDict_Type, &views, &PyDict_Type, &view_keys, &PyDict_Type, &storages,
                        &PyDict_Type, &bases, &fallback)) {
    return -1;
  }
  for (PyObject* o : {views, view_keys, storages, bases, fallback}) Py_INCREF(o);
  Py_XSETREF(self->views, views);
  Py_XSETREF(self->view_keys, view_keys);
  Py_XSETREF(self->storages, storages);
  Py_XSETREF(self->bases, bases);
  Py_XSETREF(self->fallback, fallback);
  return 0;
}

int hook_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<TensorHook*>(obj);
  Py_VISIT(self->views);
  Py_VISIT(self->view_keys);
  Py_VISIT(self->storages);
  Py_VISIT(self->bases);
  Py_VISIT(self->fallback);
  return 0;
}

int hook_clear(PyObject* obj) {
  auto* self = reinterpret_cast<TensorHook*>(obj);
  Py_CLEAR(self->views);
  Py_CLEAR(self->view_keys);
  Py_CLEAR(self->storages);
  Py_CLEAR(self->bases);
  Py_CLEAR(self->fallback);
  return 0;
}

void hook_dealloc(PyObject* obj) {
  PyObject_GC_UnTrack(obj);
  hook_clear(obj);
  Py_TYPE(obj)->tp_free(obj);
}

PyTypeObject TensorHookType = {PyVarObject_HEAD_INIT(nullptr, 0) "gpuwire_node_native.TensorHook"};

// ------------------------------------------------------------------ adopting an op's result

// the descriptor of a fresh result, (storage id, 0, sizes, strides, dtype code, 0), packed
PyObject* result_descriptor(uint64_t storage_id, c10::IntArrayRef sizes, c10::IntArrayRef strides, int code) {
  std::string out;
  out.reserve(48);
  pack_array_header(out, 6);
  pack_int(out, static_cast<int64_t>(storage_id));
  pack_int(out, 0);
  pack_array_header(out, sizes.size());
  for (const auto size : sizes) pack_int(out, size);
  pack_array_header(out, strides.size());
  for (const auto stride : strides) pack_int(out, stride);
  pack_int(out, code);
  pack_int(out, 0);
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

// Session._remember_view: in C++ while the cache has room, else the Python method
int remember_view(PyObject* session, PyObject* state, PyObject* storage_id, PyObject* data, PyObject* entry) {
  PyObject* views = InstanceAttrs::get(session, state, s_views);
  PyObject* view_keys = views ? InstanceAttrs::get(session, state, s_view_keys) : nullptr;
  int rc = view_keys ? cache_view(views, view_keys, storage_id, data, entry) : -1;
  Py_XDECREF(views);
  Py_XDECREF(view_keys);
  if (rc == 1) {
    PyObject* done = PyObject_CallMethodObjArgs(session, s_remember_view, data, entry, nullptr);
    Py_XDECREF(done);
    rc = done == nullptr ? -1 : 0;
  }
  return rc;
}

// adopt(session, tensor, out, device_type, device_index) -> True when the result was stored
// under the client's id as it is (Session._adopt's no-copy case, with the strides the client
// declared: a one-element result in other strides is Python's), False when Session._adopt must
// look at it (a copy, a malformed declaration, anything unusual). Raises what the session raises
// (its budget, its _release).
PyObject* adopt(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "adopt(session, tensor, out, device_type, device_index)");
    return nullptr;
  }
  PyObject *session = args[0], *tensor = args[1], *out = args[2];
  const long device_type = PyLong_AsLong(args[3]);
  const long device_index = PyLong_AsLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (!PyList_CheckExact(out) || PyList_GET_SIZE(out) != 5) Py_RETURN_FALSE;
  PyObject *id_obj = PyList_GET_ITEM(out, 0), *nbytes_obj = PyList_GET_ITEM(out, 1), *sizes_obj = PyList_GET_ITEM(out, 2),
           *strides_obj = PyList_GET_ITEM(out, 3), *code_obj = PyList_GET_ITEM(out, 4);
  if (!PyLong_CheckExact(id_obj) || !PyLong_CheckExact(nbytes_obj) || !PyLong_CheckExact(code_obj)) Py_RETURN_FALSE;
  const unsigned long long storage_id = PyLong_AsUnsignedLongLong(id_obj);
  const long long nbytes = PyLong_AsLongLong(nbytes_obj);
  const long code = PyLong_AsLong(code_obj);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  if (storage_id >= node_id_base || code < 0 || code >= kCodes || scalar_of_code[code] < 0) Py_RETURN_FALSE;
  c10::TensorImpl* impl = impl_of(tensor);
  if (impl == nullptr || impl->layout() != c10::kStrided || !impl->has_storage() || impl->has_symbolic_sizes_strides() ||
      impl->key_set().has(c10::DispatchKey::Python)) {
    Py_RETURN_FALSE;
  }
  const c10::Device device = impl->device();
  const bool on_device = static_cast<long>(device.type()) == device_type &&
                         (device.is_cpu() ? device_index == -1 : device.index() == device_index);
  if (static_cast<int>(impl->dtype().toScalarType()) != scalar_of_code[code] || impl->storage_offset() != 0 ||
      !same_ints(sizes_obj, impl->sizes()) || !same_ints(strides_obj, impl->strides()) ||
      !on_device || impl->is_conj() || impl->is_neg()) {
    Py_RETURN_FALSE;
  }
  const c10::StorageImpl* storage_impl = impl->unsafe_storage().unsafeGetStorageImpl();
  const auto have = static_cast<long long>(storage_impl->nbytes());
  const auto ptr = reinterpret_cast<uintptr_t>(have ? storage_impl->data() : nullptr);
  if (have < nbytes) Py_RETURN_FALSE;

  PyObject *live = nullptr, *ptr_obj = nullptr, *storage = nullptr, *storages = nullptr, *budget = nullptr;
  PyObject* result = nullptr;
  int64_t in_use = 0, peak = 0;
  PyObject* state = InstanceAttrs::dict_of(session);  // (nullptr: getattr for each)
  live = InstanceAttrs::get(session, state, s_live_ptrs);
  if (live == nullptr || !PySet_Check(live)) goto fallback;
  ptr_obj = PyLong_FromVoidPtr(reinterpret_cast<void*>(ptr));
  if (ptr_obj == nullptr) goto done;
  if (have) {
    const int taken = PySet_Contains(live, ptr_obj);
    if (taken < 0) goto done;
    if (taken) goto fallback;  // another storage of this session owns this memory: a copy
  }
  storage = PyObject_CallMethodNoArgs(tensor, s_untyped_storage);
  storages = InstanceAttrs::get(session, state, s_storages);
  if (storage == nullptr || storages == nullptr) goto done;
  {
    const int known = PyDict_CheckExact(storages) ? PyDict_Contains(storages, id_obj) : PySequence_Contains(storages, id_obj);
    if (known < 0) goto done;
    if (known) {
      PyObject* released = PyObject_CallMethodOneArg(session, s_release, id_obj);
      if (released == nullptr) goto done;
      Py_DECREF(released);
    }
  }
  budget = InstanceAttrs::get(session, state, s_memory_budget);
  if (budget == nullptr) goto done;
  if (InstanceAttrs::read_int(session, state, s_bytes_in_use, &in_use) < 0) goto done;  // (after _release's change)
  if (budget != Py_None) {
    const long long limit = PyLong_AsLongLong(budget);
    if (limit == -1 && PyErr_Occurred()) goto done;
    if (in_use + have > limit) {
      PyObject* nbytes_needed = PyLong_FromLongLong(have);
      PyObject* checked = nbytes_needed ? PyObject_CallMethodOneArg(session, s_check_budget, nbytes_needed) : nullptr;
      Py_XDECREF(nbytes_needed);
      if (checked == nullptr) goto done;
      Py_DECREF(checked);
    }
  }
  if (PyObject_SetItem(storages, id_obj, storage) < 0) goto done;
  in_use += have;
  if (InstanceAttrs::write_int(session, state, s_bytes_in_use, in_use) < 0 ||
      InstanceAttrs::read_int(session, state, s_peak_bytes, &peak) < 0) {
    goto done;
  }
  if (in_use > peak && InstanceAttrs::write_int(session, state, s_peak_bytes, in_use) < 0) goto done;
  if (have && PySet_Add(live, ptr_obj) < 0) goto done;
  // the client names this result next by the descriptor of exactly this layout (Session._adopt)
  if (!impl->requires_grad()) {
    PyObject* data = result_descriptor(storage_id, impl->sizes(), impl->strides(), static_cast<int>(code));
    PyObject* sizes = int_tuple(impl->sizes());
    PyObject* strides = int_tuple(impl->strides());
    PyObject* zero = PyLong_FromLong(0);
    PyObject* entry = (data && sizes && strides && zero)
                          ? PyTuple_Pack(6, id_obj, storage, tensor, sizes, strides, zero) : nullptr;
    const int rc = entry == nullptr ? -1 : remember_view(session, state, id_obj, data, entry);
    Py_XDECREF(data); Py_XDECREF(sizes); Py_XDECREF(strides); Py_XDECREF(zero); Py_XDECREF(entry);
    if (rc < 0) goto done;
  }
  result = Py_True;
  Py_INCREF(result);
  goto done;
fallback:
  result = Py_False;
  Py_INCREF(result);
done:
  Py_XDECREF(live); Py_XDECREF(ptr_obj); Py_XDECREF(storage); Py_XDECREF(storages); Py_XDECREF(budget);
  Py_XDECREF(state);
  return result;
}

// ------------------------------------------------------------------ the guard's signature

int add_signature(PyObject* key, PyObject* values, bool strided);

PyObject* list_signature(PyObject* values, bool strided) {
  PyObject* key = PyList_New(0);
  if (key == nullptr || PyList_Append(key, list_marker) < 0 || add_signature(key, values, strided) < 0) {
    Py_XDECREF(key);
    return nullptr;
  }
  PyObject* tuple = PyList_AsTuple(key);
  Py_DECREF(key);
  return tuple;
}

int append_new(PyObject* key, PyObject* item) {  // appends and drops the new reference
  if (item == nullptr) return -1;
  const int rc = PyList_Append(key, item);
  Py_DECREF(item);
  return rc;
}

// session._add_signature: what the meta-cost cache keys an argument by
int add_signature(PyObject* key, PyObject* values, bool strided) {
  PyObject* seq = PySequence_Fast(values, "arguments");
  if (seq == nullptr) return -1;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  int rc = 0;
  for (Py_ssize_t i = 0; i < n && rc == 0; ++i) {
    PyObject* a = items[i];
    PyTypeObject* tp = Py_TYPE(a);
    if (reinterpret_cast<PyObject*>(tp) == tensor_type) {
      c10::TensorImpl* impl = impl_of(a);
      const int st = impl ? static_cast<int>(impl->dtype().toScalarType()) : -1;
      if (impl == nullptr || st < 0 || st >= kScalarTypes || dtype_objects[st] == nullptr ||
          impl->has_symbolic_sizes_strides() || impl->layout() != c10::kStrided) {
        // (no tensor of another layout reaches a node's op today; were one to, Python's key)
        PyObject* shape = PyObject_GetAttrString(a, "shape");
        rc = append_new(key, shape);
        if (rc == 0 && strided) rc = append_new(key, PyObject_CallMethod(a, "stride", nullptr));
        if (rc == 0) rc = append_new(key, PyObject_GetAttrString(a, "dtype"));
        continue;
      }
      rc = append_new(key, int_tuple(impl->sizes()));
      if (rc == 0 && strided) rc = append_new(key, int_tuple(impl->strides()));
      if (rc == 0) rc = PyList_Append(key, dtype_objects[st]);
    } else if (tp == &PyLong_Type || a == Py_None) {
      rc = PyList_Append(key, a);
    } else if (tp == &PyList_Type) {
      rc = append_new(key, list_signature(a, strided));
    } else {
      rc = PyList_Append(key, a);
      if (rc == 0) rc = PyList_Append(key, reinterpret_cast<PyObject*>(tp));
    }
  }
  Py_DECREF(seq);
  return rc;
}

// signature(name, args, kwargs, strided) -> the meta-cost cache key (session._signature)
PyObject* signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "signature(name, args, kwargs, strided)");
    return nullptr;
  }
  const int strided = PyObject_IsTrue(args[3]);
  if (strided < 0) return nullptr;
  PyObject* key = PyList_New(0);
  if (key == nullptr) return nullptr;
  int rc = PyList_Append(key, args[0]);
  if (rc == 0) rc = add_signature(key, args[1], strided);
  PyObject* kwargs = args[2];
  if (rc == 0 && kwargs != Py_None && PyObject_IsTrue(kwargs) == 1) {
    rc = PyList_Append(key, kwargs_marker);
    if (rc == 0) rc = append_new(key, PySequence_Tuple(kwargs));
    if (rc == 0) {
      PyObject* values = PyMapping_Values(kwargs);
      rc = values == nullptr ? -1 : add_signature(key, values, strided);
      Py_XDECREF(values);
    }
  }
  if (rc < 0) {
    Py_DECREF(key);
    return nullptr;
  }
  PyObject* tuple = PyList_AsTuple(key);
  Py_DECREF(key);
  return tuple;
}

// ------------------------------------------------------------------ warnings

// A kernel's warning (TORCH_WARN) on a session's thread, kept for its client. An op called as
// the node calls it (torch.ops, or the native loop with the GIL released) has no Python warning
// handler around it: c10 hands the warning to the thread's handler, whose default prints it to
// the node's stderr, where the program that caused it never sees it. Kept as PyTorch's Python
// handler words it, so the client's warning reads as a local run's. At most kMaxKept between two
// replies (a stream of ops that each warn must not grow it without bound; the node's meta pass
// before a kernel is quiet: quiet_warnings).
constexpr size_t kMaxKept = 64;

struct KeptWarnings final : c10::WarningHandler {
  std::vector<std::pair<bool, std::string>> kept;  // (a DeprecationWarning, text)
  size_t dropped = 0;

  void process(const c10::Warning& warning) override {
    if (kept.size() >= kMaxKept) {
      ++dropped;
      return;
    }
    std::string text = warning.msg();
    if (!warning.verbatim()) {
      const auto& where = warning.source_location();
      text += " (Triggered internally at ";
      text += where.file;
      text += ":";
      text += std::to_string(where.line);
      text += ".)";
    }
    kept.emplace_back(std::holds_alternative<c10::DeprecationWarning>(warning.type()), std::move(text));
  }
};

thread_local KeptWarnings kept_warnings;

// keep_warnings(): this thread's kernel warnings are kept for take_warnings() from now on.
PyObject* keep_warnings(PyObject*, PyObject*) {
  c10::WarningUtils::set_warning_handler(&kept_warnings);
  Py_RETURN_NONE;
}

// take_warnings() -> None, or ([(is_deprecation, text), ...], number dropped): what this thread's
// kernels said since the last call.
PyObject* take_warnings(PyObject*, PyObject*) {
  auto& kept = kept_warnings.kept;
  if (kept.empty() && kept_warnings.dropped == 0) Py_RETURN_NONE;
  PyObject* items = PyList_New(static_cast<Py_ssize_t>(kept.size()));
  if (items == nullptr) return nullptr;
  for (size_t i = 0; i < kept.size(); ++i) {
    PyObject* text = PyUnicode_DecodeUTF8(kept[i].second.data(), static_cast<Py_ssize_t>(kept[i].second.size()),
                                          "replace");
    PyObject* item = text == nullptr ? nullptr : Py_BuildValue("(ON)", kept[i].first ? Py_True : Py_False, text);
    if (item == nullptr) {
      Py_DECREF(items);
      return nullptr;
    }
    PyList_SET_ITEM(items, static_cast<Py_ssize_t>(i), item);
  }
  PyObject* taken = Py_BuildValue("(Nn)", items, static_cast<Py_ssize_t>(kept_warnings.dropped));
  kept.clear();
  kept_warnings.dropped = 0;
  return taken;
}

// ------------------------------------------------------------------ set-up

// configure(torch.Tensor, EXT_TENSOR, {scalar type: (wire code, dtype)}, _LIST, _KWARGS, NODE_ID_BASE, VIEW_CACHE_MAX)
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *tensor, *table, *list_mark, *kwargs_mark;
  long code;
  unsigned long long base;
  Py_ssize_t cache_max;
  if (!PyArg_ParseTuple(args, "OlO!OOKn", &tensor, &code, &PyDict_Type, &table, &list_mark, &kwargs_mark, &base,
                        &cache_max)) {
    return nullptr;
  }
  for (int i = 0; i < kScalarTypes; ++i) Py_CLEAR(dtype_objects[i]);
  for (int i = 0; i < kCodes; ++i) scalar_of_code[i] = -1;
  if (gpuwire_common::read_dtype_table(table, [](int index, int code, PyObject* dtype) {
        scalar_of_code[code] = index;
        Py_INCREF(dtype);
        dtype_objects[index] = dtype;
      }) < 0) {
    return nullptr;
  }
  for (PyObject** slot : {&tensor_type, &list_marker, &kwargs_marker}) Py_CLEAR(*slot);
  Py_INCREF(tensor); tensor_type = tensor;
  Py_INCREF(list_mark); list_marker = list_mark;
  Py_INCREF(kwargs_mark); kwargs_marker = kwargs_mark;
  ext_tensor_code = code;
  node_id_base = base;
  view_cache_max = cache_max;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Give the helpers their Python objects and tables."},
    {"adopt", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(adopt)), METH_FASTCALL,
     "Store an op's result as it is (True), or leave it to Session._adopt (False)."},
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(signature)), METH_FASTCALL,
     "The guard's meta-cost cache key of an op's arguments."},
    {"scalar_type", gpuwire_common::scalar_type, METH_O, "The c10::ScalarType number of a tensor's dtype."},
    {"quiet_warnings", gpuwire_common::quiet_warnings, METH_O,
     "quiet_warnings(True) ... quiet_warnings(False): this thread's c10 warnings are dropped in between."},
    {"keep_warnings", keep_warnings, METH_NOARGS, "Keep this thread's kernel warnings for take_warnings()."},
    {"take_warnings", take_warnings, METH_NOARGS,
     "None, or ([(is_deprecation, text), ...], number dropped): this thread's kernel warnings since the last call."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuwire_node_native", "gpuwire's native node helpers", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_gpuwire_node_native() {
  for (auto [slot, name] : {std::pair{&s_cdata, "_cdata"}, {&s_storages, "storages"}, {&s_views, "_views"},
                            {&s_view_keys, "_view_keys"}, {&s_memory_budget, "memory_budget"},
                            {&s_bytes_in_use, "bytes_in_use"}, {&s_peak_bytes, "peak_bytes"},
                            {&s_live_ptrs, "_live_ptrs"}, {&s_release, "_release"},
                            {&s_check_budget, "check_budget"}, {&s_untyped_storage, "untyped_storage"},
                            {&s_remember_view, "_remember_view"}, {&s_new, "new"}}) {
    *slot = PyUnicode_InternFromString(name);
    if (*slot == nullptr) return nullptr;
  }
  for (int i = 0; i < kCodes; ++i) scalar_of_code[i] = -1;
  TensorHookType.tp_basicsize = sizeof(TensorHook);
  TensorHookType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  TensorHookType.tp_doc = "msgpack ext_hook: a session's cached tensor views, else its Python hook";
  TensorHookType.tp_new = PyType_GenericNew;
  TensorHookType.tp_init = hook_init;
  TensorHookType.tp_call = hook_call;
  TensorHookType.tp_traverse = hook_traverse;
  TensorHookType.tp_clear = hook_clear;
  TensorHookType.tp_dealloc = hook_dealloc;
  if (PyType_Ready(&TensorHookType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  Py_INCREF(&TensorHookType);
  if (PyModule_AddObject(m, "TensorHook", reinterpret_cast<PyObject*>(&TensorHookType)) < 0) {
    Py_DECREF(&TensorHookType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
