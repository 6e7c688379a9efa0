// gpuwire's native op loop (see loop.py): an Op frame run straight from its bytes. The frame's
// arguments become the dispatcher's IValues by the op's schema and the kernel is called boxed,
// with no Python object made for an argument and no Python frame between the connection and
// the kernel. Only what the Python path (session.py) has already run for the same op and the
// same argument signature (shapes, strides, dtypes, every other value) is run here, within the
// memory the Python guard measured for it then; anything else answers "not here" before it
// runs, and the connection decodes the frame for Session.handle as before. Results are stored
// by the session's own adoption (native.cpp's adopt, else Session._adopt), and a failure after
// the kernel started is reported by Session._native_loop_failed, as Session.handle reports one.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/List.h>
#include <ATen/ScalarOps.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "../_native_common.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

using gpuwire_common::InstanceAttrs;
using gpuwire_common::int_tuple;
using gpuwire_common::kCodes;
constexpr size_t kMaxList = 4096;      // longer lists: the Python path (and its limits)
constexpr size_t kMaxLearned = 1 << 14;  // learned signatures, node-wide (cleared when full)

// set by configure()
PyObject* ran_type = nullptr;            // session.RanOp
PyObject* applied_precision = nullptr;   // ops.APPLIED_PRECISION (a list; [0] is in force)
long ext_tensor = -1, ext_dtype = -1, ext_device = -1, ext_memory_format = -1, ext_layout = -1;
int scalar_of_code[kCodes];              // wire dtype code -> c10::ScalarType (-1: none)
long strided_layout_code = -1;

PyObject *s_unzeroed, *s_decode_error, *s_overwriting, *s_thread, *s_replay_floor, *s_owner, *s_precision,
    *s_memory_budget, *s_device_bytes, *s_bytes_in_use, *s_ops_run, *s_adopt, *s_allocate, *s_failed, *s_acquire,
    *s_release, *s_device_memory, *s_seq, *s_empty_tuple;

struct Entry {
  std::string name;
  std::optional<c10::OperatorHandle> op;  // none: not for this loop
  bool exact_numbers = true;  // numbers keyed by value (factories: a Scalar may be a size)
  std::unordered_map<std::string, int64_t> learned;  // argument signature -> fresh bytes (guard)
};
std::vector<std::unique_ptr<Entry>> entries;

// why frames went to the Python path, and how many ran here (stats(): tests and tuning)
enum Outcome { kRan, kNoEntry, kNotEligible, kSessionState, kArguments, kUnlearned, kNoRoom, kDeviceState,
               kRerun, kFailed, kOutcomes };
const char* const outcome_names[kOutcomes] = {"ran", "new op", "not eligible", "session state", "arguments",
                                              "new signature", "no room", "device state", "run again", "failed"};
uint64_t outcomes[kOutcomes];
PyObject* entry_index = nullptr;  // op name -> index in entries
size_t learned_total = 0;

// ------------------------------------------------------------------ msgpack, read as the wire has it

struct Reader {
  const unsigned char* p;
  const unsigned char* end;
  bool ok = true;

  bool need(size_t n) {
    if (static_cast<size_t>(end - p) < n) ok = false;
    return ok;
  }
  uint64_t be(int n) {
    if (!need(n)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
    p += n;
    return v;
  }
  int peek() const { return p < end ? *p : -1; }
  // an int (any msgpack int encoding); ok=false for anything else
  bool integer(int64_t* out) {
    if (!need(1)) return false;
    const unsigned char c = *p;
    if (c < 0x80) { ++p; *out = c; return true; }
    if (c >= 0xe0) { ++p; *out = static_cast<int8_t>(c); return true; }
    switch (c) {
      case 0xcc: ++p; *out = static_cast<int64_t>(be(1)); return ok;
      case 0xcd: ++p; *out = static_cast<int64_t>(be(2)); return ok;
      case 0xce: ++p; *out = static_cast<int64_t>(be(4)); return ok;
      case 0xcf: { ++p; const uint64_t v = be(8); if (v > INT64_MAX) { ok = false; return false; } *out = static_cast<int64_t>(v); return ok; }
      case 0xd0: ++p; *out = static_cast<int8_t>(be(1)); return ok;
      case 0xd1: ++p; *out = static_cast<int16_t>(be(2)); return ok;
      case 0xd2: ++p; *out = static_cast<int32_t>(be(4)); return ok;
      case 0xd3: ++p; *out = static_cast<int64_t>(be(8)); return ok;
      default: return false;
    }
  }
  bool is_int() const {
    if (p >= end) return false;
    const unsigned char c = *p;
    return c < 0x80 || c >= 0xe0 || (c >= 0xcc && c <= 0xcf) || (c >= 0xd0 && c <= 0xd3);
  }
  bool is_nil() const { return p < end && *p == 0xc0; }
  bool is_bool() const { return p < end && (*p == 0xc2 || *p == 0xc3); }
  bool is_float() const { return p < end && (*p == 0xca || *p == 0xcb); }
  bool boolean() { const bool v = *p == 0xc3; ++p; return v; }
  double floating() {
    const unsigned char c = *p++;
    if (c == 0xca) {
      const uint32_t bits = static_cast<uint32_t>(be(4));
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    const uint64_t bits = be(8);
    double d;
    std::memcpy(&d, &bits, 8);
    return d;
  }
  // a str's bytes; false (and nothing consumed) for anything else
  bool str(std::string_view* out) {
    if (p >= end) return false;
    const unsigned char c = *p;
    size_t n;
    if ((c & 0xe0) == 0xa0) { ++p; n = c & 0x1f; }
    else if (c == 0xd9) { ++p; n = be(1); }
    else if (c == 0xda) { ++p; n = be(2); }
    else if (c == 0xdb) { ++p; n = be(4); }
    else return false;
    if (!need(n)) return false;
    *out = std::string_view(reinterpret_cast<const char*>(p), n);
    p += n;
    return true;
  }
  // an array's (or a map's) length; false for anything else
  bool array(size_t* n) { return container(n, 0x90, 0xdc); }
  bool map(size_t* n) { return container(n, 0x80, 0xde); }
  bool container(size_t* n, unsigned char fixed, unsigned char sized16) {  // (sized16 + 1: 32-bit length)
    if (p >= end) return false;
    const unsigned char c = *p;
    if ((c & 0xf0) == fixed) { ++p; *n = c & 0x0f; return true; }
    if (c == sized16) { ++p; *n = be(2); return ok; }
    if (c == sized16 + 1) { ++p; *n = be(4); return ok; }
    return false;
  }
  // an ext value: its code and data; false for anything else
  bool ext(int* code, const unsigned char** data, size_t* n) {
    if (p >= end) return false;
    const unsigned char c = *p;
    size_t len;
    switch (c) {
      case 0xd4: len = 1; ++p; break;
      case 0xd5: len = 2; ++p; break;
      case 0xd6: len = 4; ++p; break;
      case 0xd7: len = 8; ++p; break;
      case 0xd8: len = 16; ++p; break;
      case 0xc7: ++p; len = be(1); break;
      case 0xc8: ++p; len = be(2); break;
      case 0xc9: ++p; len = be(4); break;
      default: return false;
    }
    if (!need(1 + len)) return false;
    *code = static_cast<int8_t>(*p++);
    *data = p;
    *n = len;
    p += len;
    return true;
  }
  // past one value of any kind (depth-bounded); false where it cannot
  bool skip(int depth = 0) {
    if (p >= end || depth > 8) { ok = false; return false; }
    const unsigned char c = *p;
    int64_t i;
    size_t n;
    std::string_view s;
    int code;
    const unsigned char* data;
    if (is_int()) return integer(&i);
    if (c == 0xc0 || c == 0xc2 || c == 0xc3) { ++p; return true; }
    if (c == 0xca) { ++p; return need(4) && (p += 4, true); }
    if (c == 0xcb) { ++p; return need(8) && (p += 8, true); }
    if (str(&s)) return true;
    if (ext(&code, &data, &n)) return true;
    if (array(&n)) {
      for (size_t k = 0; k < n && ok; ++k) skip(depth + 1);
      return ok;
    }
    if (map(&n)) {
      for (size_t k = 0; k < 2 * n && ok; ++k) skip(depth + 1);
      return ok;
    }
    ok = false;  // bin and the rest: no op argument takes them here
    return false;
  }
};

// ------------------------------------------------------------------ the per-session loop object

struct Loop {
  PyObject_HEAD
  PyObject* session;
  PyObject* decode_hook;  // Session.decode_hook: a descriptor's bytes -> its view
  PyObject* rng;          // the session's RngOwner
  PyObject* rng_lock;
  PyObject* native_adopt;  // native.cpp's adopt, or None
  PyObject* device_type;
  PyObject* device_index;
  PyObject* ext_tensor_code;
  // read per op, so looked up once: the instance dicts of the session and of its RngOwner
  // (InstanceAttrs), the lock's bound acquire and release
  PyObject* session_dict;
  PyObject* rng_dict;
  PyObject* lock_acquire;
  PyObject* lock_release;
  c10::Device device;
  // the signature the last fallback would have had, for learn(): seq, entry, key
  int64_t pending_seq;
  Entry* pending_entry;
  std::string pending_key;
};

// the tensor of a descriptor (its cached view), or an undefined tensor (the Python path decides)
at::Tensor tensor_of(Loop* self, const unsigned char* data, size_t n, std::vector<PyObject*>& keep) {
  PyObject* bytes = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(data), static_cast<Py_ssize_t>(n));
  if (bytes == nullptr) return {};
  PyObject* view = PyObject_CallFunctionObjArgs(self->decode_hook, self->ext_tensor_code, bytes, nullptr);
  Py_DECREF(bytes);
  if (view == nullptr || !THPVariable_CheckExact(view)) {
    Py_XDECREF(view);
    return {};
  }
  keep.push_back(view);
  return THPVariable_Unpack(view);
}

void key_tensor(std::string& key, const at::Tensor& t) {
  key.push_back('T');
  key.push_back(static_cast<char>(t.scalar_type()));
  key.push_back(static_cast<char>((t.is_conj() ? 1 : 0) | (t.is_neg() ? 2 : 0)));
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  key.push_back(static_cast<char>(sizes.size()));
  key.append(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t));
  key.append(reinterpret_cast<const char*>(strides.data()), strides.size() * sizeof(int64_t));
}

// one argument of schema type ``type`` from the reader into ``out``; false: not here
// (``exact``: numbers are keyed by value; else by kind only: outside factories no Scalar or
// float sizes a result, and optimizers pass new ones every step)
bool convert(Loop* self, Reader& r, const c10::TypePtr& type, bool exact, c10::IValue* out, std::string& key,
             std::vector<PyObject*>& keep) {
  const unsigned char* start = r.p;
  // every part of the key starts with its own marker: R raw bytes, T a tensor, N None, L a list
  auto raw = [&]() {
    key.push_back('R');
    key.append(reinterpret_cast<const char*>(start), r.p - start);
  };
  auto number = [&](char kind) {  // a Scalar's or float's key
    if (exact) raw();
    else key.push_back(kind);
  };
  const c10::TypeKind kind = type->kind();
  if (kind == c10::TypeKind::OptionalType) {
    if (r.is_nil()) {
      ++r.p;
      key.push_back('N');
      *out = c10::IValue();
      return true;
    }
    return convert(self, r, type->castRaw<c10::OptionalType>()->getElementType(), exact, out, key, keep);
  }
  int code;
  const unsigned char* data;
  size_t n;
  int64_t i;
  switch (kind) {
    case c10::TypeKind::TensorType: {
      if (r.is_int() || r.is_float() || r.is_bool()) {
        // a Python number where the op takes a tensor (``x * 0.5``): a wrapped number, as
        // the op's Python binding makes it (type promotion treats it as a Scalar)
        c10::Scalar scalar;
        if (r.is_bool()) { scalar = r.boolean(); key.append("WB"); }
        else if (r.is_float()) { scalar = r.floating(); key.append("WF"); }
        else if (r.integer(&i)) { scalar = i; key.append("WI"); }
        if (!r.ok) return false;
        at::Tensor t = at::scalar_to_tensor(scalar);
        t.unsafeGetTensorImpl()->set_wrapped_number(true);
        *out = std::move(t);
        return true;
      }
      if (!r.ext(&code, &data, &n) || code != ext_tensor) return false;
      at::Tensor t = tensor_of(self, data, n, keep);
      if (!t.defined()) return false;
      key_tensor(key, t);
      *out = std::move(t);
      return true;
    }
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
      if (!r.integer(&i)) return false;
      raw();
      *out = i;
      return true;
    case c10::TypeKind::FloatType:
      if (r.is_float()) { *out = r.floating(); number('F'); return r.ok; }
      if (!r.integer(&i)) return false;
      number('I');
      *out = static_cast<double>(i);
      return true;
    case c10::TypeKind::BoolType:
      if (!r.is_bool()) return false;
      *out = r.boolean();
      raw();
      return true;
    case c10::TypeKind::NumberType:  // Scalar: as Python's int, float or bool
      if (r.is_bool()) { *out = r.boolean(); number('B'); return true; }
      if (r.is_float()) { *out = r.floating(); number('F'); return r.ok; }
      if (!r.integer(&i)) return false;
      number('I');
      *out = i;
      return true;
    case c10::TypeKind::StringType: {
      std::string_view s;
      if (!r.str(&s)) return false;
      raw();
      *out = std::string(s);
      return true;
    }
    case c10::TypeKind::ScalarTypeType:
      if (!r.ext(&code, &data, &n) || code != ext_dtype || n != 1 || data[0] >= kCodes || scalar_of_code[data[0]] < 0)
        return false;
      raw();
      *out = static_cast<c10::ScalarType>(scalar_of_code[data[0]]);
      return true;
    case c10::TypeKind::MemoryFormatType: {
      static const c10::MemoryFormat formats[] = {c10::MemoryFormat::Contiguous, c10::MemoryFormat::ChannelsLast,
                                                  c10::MemoryFormat::ChannelsLast3d, c10::MemoryFormat::Preserve};
      if (!r.ext(&code, &data, &n) || code != ext_memory_format || n != 1 || data[0] >= 4) return false;
      raw();
      *out = formats[data[0]];
      return true;
    }
    case c10::TypeKind::LayoutType:
      if (!r.ext(&code, &data, &n) || code != ext_layout || n != 1 || data[0] != strided_layout_code) return false;
      raw();
      *out = c10::kStrided;
      return true;
    case c10::TypeKind::DeviceObjType: {
      if (!r.ext(&code, &data, &n) || code != ext_device) return false;
      Reader d{data, data + n};
      size_t fields;
      std::string_view device_type;
      if (!d.array(&fields) || fields != 2 || !d.str(&device_type)) return false;
      raw();
      if (device_type == "cpu") *out = c10::Device(c10::kCPU);
      else if (device_type == "meta") return false;  // (Session.ext_hook refuses it)
      else *out = self->device;
      return true;
    }
    case c10::TypeKind::ListType: {
      size_t count;
      if (!r.array(&count) || count > kMaxList) return false;
      const c10::TypePtr& element = type->castRaw<c10::ListType>()->getElementType();
      const c10::TypeKind element_kind = element->kind();
      key.push_back('L');
      key.append(reinterpret_cast<const char*>(&count), sizeof(count));
      if (element_kind == c10::TypeKind::IntType || element_kind == c10::TypeKind::SymIntType) {
        c10::List<int64_t> values;
        values.reserve(count);
        for (size_t k = 0; k < count; ++k) {
          if (!r.integer(&i)) return false;
          values.push_back(i);
        }
        raw();
        *out = std::move(values);
        return true;
      }
      if (element_kind == c10::TypeKind::TensorType) {
        c10::List<at::Tensor> values;
        values.reserve(count);
        for (size_t k = 0; k < count; ++k) {
          if (!r.ext(&code, &data, &n) || code != ext_tensor) return false;
          at::Tensor t = tensor_of(self, data, n, keep);
          if (!t.defined()) return false;
          key_tensor(key, t);
          values.push_back(std::move(t));
        }
        *out = std::move(values);
        return true;
      }
      if (element_kind == c10::TypeKind::OptionalType &&
          element->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType) {
        c10::List<std::optional<at::Tensor>> values;
        values.reserve(count);
        for (size_t k = 0; k < count; ++k) {
          if (r.is_nil()) {
            ++r.p;
            key.push_back('N');
            values.push_back(std::nullopt);
            continue;
          }
          if (!r.ext(&code, &data, &n) || code != ext_tensor) return false;
          at::Tensor t = tensor_of(self, data, n, keep);
          if (!t.defined()) return false;
          key_tensor(key, t);
          values.push_back(std::move(t));
        }
        *out = std::move(values);
        return true;
      }
      if (element_kind == c10::TypeKind::BoolType) {
        c10::List<bool> values;
        for (size_t k = 0; k < count; ++k) {
          if (!r.is_bool()) return false;
          values.push_back(r.boolean());
        }
        raw();
        *out = std::move(values);
        return true;
      }
      if (element_kind == c10::TypeKind::NumberType) {  // Scalar[] (``_foreach_div_.ScalarList``)
        c10::impl::GenericList values(element);
        values.reserve(count);
        for (size_t k = 0; k < count; ++k) {
          if (r.is_bool()) { values.push_back(c10::IValue(r.boolean())); if (!exact) key.push_back('B'); }
          else if (r.is_float()) { values.push_back(c10::IValue(r.floating())); if (!exact) key.push_back('F'); }
          else if (r.integer(&i)) { values.push_back(c10::IValue(i)); if (!exact) key.push_back('I'); }
          else return false;
        }
        if (exact) raw();
        *out = std::move(values);
        return r.ok;
      }
      if (element_kind == c10::TypeKind::FloatType) {
        c10::List<double> values;
        for (size_t k = 0; k < count; ++k) {
          if (r.is_float()) values.push_back(r.floating());
          else if (r.integer(&i)) values.push_back(static_cast<double>(i));
          else return false;
        }
        raw();
        *out = std::move(values);
        return r.ok;
      }
      return false;
    }
    default:
      return false;
  }
}

// an op's declared output: [storage id, nbytes, sizes, strides, dtype code]
struct Out {
  int64_t storage_id, nbytes, code;
  std::vector<int64_t> sizes, strides;
};

PyObject* out_list(const Out& out) {
  PyObject* items[5] = {PyLong_FromLongLong(out.storage_id), PyLong_FromLongLong(out.nbytes), int_tuple(out.sizes),
                        int_tuple(out.strides), PyLong_FromLongLong(out.code)};
  PyObject* list = PyList_New(5);
  for (int k = 0; k < 5; ++k) {
    if (items[k] == nullptr || list == nullptr) {
      for (PyObject* item : items) Py_XDECREF(item);
      Py_XDECREF(list);
      return nullptr;
    }
  }
  for (int k = 0; k < 5; ++k) PyList_SET_ITEM(list, k, items[k]);
  return list;
}

// What one run() works with, kept per thread between frames so that a frame costs no heap
// allocation for them (the capacity stays; ~10 malloc/free pairs a frame before). Emptied on every
// way out: the stack's tensors and the Python references must not outlive the frame.
struct Scratch {
  std::vector<PyObject*> refs;  // Python references released on every way out
  torch::jit::Stack stack;
  std::vector<const unsigned char*> at;
  std::vector<Out> outs;
  std::string key;
  bool busy = false;
};
thread_local Scratch scratch;

struct Held {
  Scratch& s;
  explicit Held(Scratch& s) : s(s) { s.busy = true; }
  ~Held() {
    s.stack.clear();
    for (PyObject* o : s.refs) Py_DECREF(o);
    s.refs.clear();
    s.busy = false;
  }
};

// RanOp(seq), made without running its Python __init__ (a frame a run; the class has a slot
// for seq and no __new__ of its own)
PyObject* ran_op(int64_t seq) {
  PyObject* seq_obj = PyLong_FromLongLong(seq);
  if (seq_obj == nullptr) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(ran_type);
  PyObject* event = type->tp_new(type, s_empty_tuple, nullptr);
  if (event != nullptr && PyObject_SetAttr(event, s_seq, seq_obj) < 0) Py_CLEAR(event);
  Py_DECREF(seq_obj);
  return event;
}

#define REFUSE(why)  \
  do {               \
    ++outcomes[why]; \
    return 0;        \
  } while (0)

// Runs the Op frame header at [data, data + len): 1 when it was run (or failed and was reported
// as Session.handle reports a failure), *ran_seq its seq; 0 when the Python path must decode and
// run it (then nothing was done); -1 with a Python error.
int run_frame(Loop* self, const unsigned char* data, size_t len, PyObject* names, int64_t* ran_seq) {
  self->pending_seq = -1;
  self->pending_entry = nullptr;
  PyObject* session = self->session;
  Reader r{data, data + len};
  size_t fields;
  int64_t code, seq, index;
  if (!r.array(&fields) || fields != 6 || !r.integer(&code) || code != 11 || !r.integer(&seq) || seq < 0 ||
      !r.integer(&index) || index < 0 || index >= PyList_GET_SIZE(names)) {
    REFUSE(kArguments);
  }
  PyObject* name = PyList_GET_ITEM(names, index);
  PyObject* found = PyDict_GetItemWithError(entry_index, name);  // borrowed
  if (found == nullptr) {
    if (PyErr_Occurred()) return -1;
    self->pending_seq = seq;  // (learn() defines the op's entry)
    self->pending_entry = nullptr;
    self->pending_key.clear();
    REFUSE(kNoEntry);
  }
  Entry* entry = entries[PyLong_AsSsize_t(found)].get();
  if (!entry->op) REFUSE(kNotEligible);

  // the session's state: anything but the plain case is Session.handle's
  PyObject* state = self->session_dict;
  int64_t floor = 0;
  if (InstanceAttrs::read_int(session, state, s_replay_floor, &floor) < 0) return -1;
  if (seq <= floor && seq) REFUSE(kSessionState);
  for (PyObject* attr : {s_unzeroed, s_decode_error, s_overwriting}) {
    const int none = InstanceAttrs::is(session, state, attr, Py_None);
    if (none < 0) return -1;
    if (!none) REFUSE(kSessionState);
  }
  if (scratch.busy) REFUSE(kSessionState);  // (never: nothing it calls runs a frame)
  Held held(scratch);
  {
    PyObject* thread = InstanceAttrs::get(session, state, s_thread);
    if (thread == nullptr) return -1;
    const unsigned long ident = thread == Py_None ? 0 : PyLong_AsUnsignedLong(thread);
    Py_DECREF(thread);
    if (PyErr_Occurred()) return -1;
    if (ident != PyThread_get_thread_ident()) REFUSE(kSessionState);
  }

  // arguments, by the schema
  const c10::FunctionSchema& schema = entry->op->schema();
  const auto& arguments = schema.arguments();
  size_t positional;
  if (!r.array(&positional) || positional > arguments.size()) REFUSE(kArguments);
  std::vector<const unsigned char*>& at = scratch.at;
  at.assign(arguments.size(), nullptr);
  for (size_t k = 0; k < positional; ++k) {
    at[k] = r.p;
    if (!r.skip()) REFUSE(kArguments);
  }
  size_t keywords;
  if (!r.map(&keywords) || keywords > arguments.size()) REFUSE(kArguments);
  for (size_t k = 0; k < keywords; ++k) {
    std::string_view key_name;
    if (!r.str(&key_name)) REFUSE(kArguments);
    size_t slot = positional;
    while (slot < arguments.size() && arguments[slot].name() != key_name) ++slot;
    if (slot == arguments.size() || at[slot] != nullptr) REFUSE(kArguments);  // (unknown or given twice)
    at[slot] = r.p;
    if (!r.skip()) REFUSE(kArguments);
  }
  size_t out_count;
  if (!r.array(&out_count) || out_count > 64) REFUSE(kArguments);
  std::vector<Out>& outs = scratch.outs;
  outs.resize(out_count);
  std::string& key = scratch.key;
  key.clear();
  int64_t declared = 0;
  for (auto& out : outs) {
    size_t parts, dims;
    if (!r.array(&parts) || parts != 5 || !r.integer(&out.storage_id) || out.storage_id < 0) REFUSE(kArguments);
    const unsigned char* start = r.p;
    if (!r.integer(&out.nbytes) || out.nbytes < 0 || !r.array(&dims) || dims > 64) REFUSE(kArguments);
    out.sizes.resize(dims);
    for (auto& v : out.sizes) if (!r.integer(&v)) REFUSE(kArguments);
    if (!r.array(&dims) || dims != out.sizes.size()) REFUSE(kArguments);
    out.strides.resize(dims);
    for (auto& v : out.strides) if (!r.integer(&v)) REFUSE(kArguments);
    if (!r.integer(&out.code)) REFUSE(kArguments);
    key.append(reinterpret_cast<const char*>(start), r.p - start);
    declared += out.nbytes;
  }
  if (!r.ok || r.p != r.end) REFUSE(kArguments);
  if (out_count && out_count != schema.returns().size()) REFUSE(kArguments);

  torch::jit::Stack& stack = scratch.stack;
  for (size_t k = 0; k < arguments.size(); ++k) {
    key.push_back(static_cast<char>(k));
    if (at[k] == nullptr) {
      const auto& fallback = arguments[k].default_value();
      if (!fallback) REFUSE(kArguments);  // (a missing argument: Python's error)
      key.push_back('D');
      stack.push_back(*fallback);
      continue;
    }
    Reader value{at[k], r.end};
    c10::IValue converted;
    if (!convert(self, value, arguments[k].real_type(), entry->exact_numbers, &converted, key, scratch.refs)) {
      if (PyErr_Occurred()) PyErr_Clear();
      REFUSE(kArguments);
    }
    stack.push_back(std::move(converted));
  }

  // the guard: this signature was measured by the Python path, and it still fits
  auto learned = entry->learned.find(key);
  if (learned == entry->learned.end()) {
    self->pending_seq = seq;
    self->pending_entry = entry;
    self->pending_key = std::move(key);
    REFUSE(kUnlearned);
  }
  int64_t budget = 0, device_bytes = 0, in_use = 0;
  bool no_budget = false, no_device = false;
  if (InstanceAttrs::read_int(session, state, s_memory_budget, &budget, &no_budget) < 0 ||
      InstanceAttrs::read_int(session, state, s_device_bytes, &device_bytes, &no_device) < 0 ||
      InstanceAttrs::read_int(session, state, s_bytes_in_use, &in_use) < 0) {
    return -1;
  }
  if (no_budget && no_device) {  // (measured once, on a session's first need: Session._device_memory)
    PyObject* measured = PyObject_CallMethodNoArgs(session, s_device_memory);
    if (measured == nullptr) return -1;
    device_bytes = PyLong_AsLongLong(measured);
    Py_DECREF(measured);
    if (device_bytes == -1 && PyErr_Occurred()) return -1;
  }
  const int64_t room = (no_budget ? device_bytes : budget) - in_use;
  if (declared > room || learned->second > room) REFUSE(kNoRoom);  // (Python raises the OOM)

  // the device's lock and math-mode flags, as Session._run_op takes them
  PyObject* got = PyObject_CallNoArgs(self->lock_acquire);
  if (got == nullptr) return -1;
  Py_DECREF(got);
  struct Unlock {
    PyObject* release;
    ~Unlock() {
      PyObject* done = PyObject_CallNoArgs(release);
      if (done == nullptr) PyErr_Clear();  // (cannot fail: this thread acquired it)
      Py_XDECREF(done);
    }
  };
  std::exception_ptr failure;
  {
    Unlock unlock{self->lock_release};
    const int owner = InstanceAttrs::is(self->rng, self->rng_dict, s_owner, session);
    if (owner < 0) return -1;
    PyObject* precision = InstanceAttrs::get(session, state, s_precision);
    if (precision == nullptr) return -1;
    const bool applied = PyList_GET_SIZE(applied_precision) > 0 && PyList_GET_ITEM(applied_precision, 0) == precision;
    Py_DECREF(precision);
    if (!owner || !applied) REFUSE(kDeviceState);
    Py_BEGIN_ALLOW_THREADS
    try {
      entry->op->callBoxed(stack);
    } catch (...) {
      failure = std::current_exception();
    }
    Py_END_ALLOW_THREADS
  }
  PyObject* seq_obj = PyLong_FromLongLong(seq);
  if (seq_obj == nullptr) return -1;
  scratch.refs.push_back(seq_obj);
  int64_t ran = 0;
  if (failure) {
    // (counted as Session._run_op counts: ops that returned)
  } else if (InstanceAttrs::read_int(session, state, s_ops_run, &ran) == 0) {
    if (InstanceAttrs::write_int(session, state, s_ops_run, ran + 1) < 0) PyErr_Clear();
  } else {
    PyErr_Clear();
  }

  PyObject* outs_list = PyList_New(0);
  if (outs_list == nullptr) return -1;
  scratch.refs.push_back(outs_list);
  for (const auto& out : outs) {
    PyObject* declared_out = out_list(out);
    if (declared_out == nullptr || PyList_Append(outs_list, declared_out) < 0) {
      Py_XDECREF(declared_out);
      return -1;
    }
    Py_DECREF(declared_out);
  }
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (...) {
      torch::translate_exception_to_python(std::current_exception());
    }
  } else if (out_count) {
    // store the results under the client's ids, as Session._run_op does
    for (size_t k = 0; k < out_count; ++k) {
      PyObject* declared_out = PyList_GET_ITEM(outs_list, k);
      const c10::IValue& result = stack[k];
      PyObject* done;
      if (!result.isTensor() || !result.toTensor().defined()) {
        if (!result.isTensor() && !result.isNone()) {
          PyErr_Format(PyExc_RuntimeError, "%s returned a %s where a tensor was expected", entry->name.c_str(),
                       result.tagKind().c_str());
          break;
        }
        done = PyObject_CallMethodObjArgs(session, s_allocate, PyList_GET_ITEM(declared_out, 0),
                                          PyList_GET_ITEM(declared_out, 1), nullptr);
      } else {
        PyObject* tensor = THPVariable_Wrap(result.toTensor());
        if (tensor == nullptr) break;
        done = self->native_adopt != Py_None
                   ? PyObject_CallFunctionObjArgs(self->native_adopt, session, tensor, declared_out, self->device_type,
                                                  self->device_index, nullptr)
                   : Py_NewRef(Py_False);
        if (done == Py_False) {
          Py_DECREF(done);
          done = PyObject_CallMethodObjArgs(session, s_adopt, tensor, declared_out, nullptr);
        }
        Py_DECREF(tensor);
      }
      if (done == nullptr) break;
      Py_DECREF(done);
    }
  }
  if (PyErr_Occurred()) {
    // Session.handle's report of a failed op; False: the Python path runs it again (a CPU
    // kernel without half precision: Session._run_op computes it in float32)
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    PyObject* name_obj = PyUnicode_FromStringAndSize(entry->name.data(), static_cast<Py_ssize_t>(entry->name.size()));
    PyObject* reported = name_obj ? PyObject_CallMethodObjArgs(session, s_failed, seq_obj, name_obj,
                                                               value ? value : Py_None, outs_list, nullptr)
                                  : nullptr;
    Py_XDECREF(name_obj);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    if (reported == nullptr) return -1;
    const bool again = reported == Py_False;
    Py_DECREF(reported);
    if (again) REFUSE(kRerun);
    ++outcomes[kFailed];
  } else {
    ++outcomes[kRan];
  }
  *ran_seq = seq;
  return 1;
}

struct BufferView {  // a Python buffer held for a scope
  Py_buffer view;
  bool held = false;
  ~BufferView() {
    if (held) PyBuffer_Release(&view);
  }
  bool get(PyObject* obj) {
    held = PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) == 0;
    return held;
  }
  const unsigned char* data() const { return static_cast<const unsigned char*>(view.buf); }
};

// run(raw, names) -> RanOp(seq) when the Op frame ``raw`` was run (or failed and was reported
// as Session.handle reports a failure), None when the Python path must decode and run it (then
// nothing was done).
PyObject* loop_run(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Loop*>(obj);
  if (nargs != 2 || !PyList_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "run(raw, names)");
    return nullptr;
  }
  BufferView raw;
  if (!raw.get(args[0])) return nullptr;
  int64_t seq = -1;
  const int ran = run_frame(self, raw.data(), static_cast<size_t>(raw.view.len), args[1], &seq);
  if (ran < 0) return nullptr;
  if (ran == 0) Py_RETURN_NONE;
  return ran_op(seq);
}

// run_frames(buffer, start, names, max_header) -> (position, RanOp(seq of the last)) after
// running the complete Op frames that follow one another in ``buffer`` from ``start`` (the
// connection's receive buffer: 12-byte prefix, header, no payload), or None when the first was
// not run (the Python path decodes it; run() would refuse it too). It stops at the first frame
// it does not run, at an incomplete one, at one the connection would compact its buffer for,
// and after ``kBatchSeconds``: the session loop checks its quantum between the events it gets,
// and a RanOp per frame cost each frame ~1 us of Python (next_event, the session loop).
// A Python error (a bug: a failing op is the session's pending error) is raised at once, as
// run() raises it: the node then ends the session with an internal error (server.py), so the
// frames of this call that ran are never offered again.
constexpr double kBatchSeconds = 0.001;
constexpr size_t kPrefixBytes = 12;  // protocol/connection.py's PREFIX: "!IQ", header and payload lengths

PyObject* loop_run_frames(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Loop*>(obj);
  if (nargs != 4 || !PyList_CheckExact(args[2])) {
    PyErr_SetString(PyExc_TypeError, "run_frames(buffer, start, names, max_header)");
    return nullptr;
  }
  const Py_ssize_t start = PyLong_AsSsize_t(args[1]);
  const Py_ssize_t max_header = PyLong_AsSsize_t(args[3]);
  if (PyErr_Occurred()) return nullptr;
  BufferView buffer;
  if (!buffer.get(args[0])) return nullptr;
  const unsigned char* data = buffer.data();
  const auto length = static_cast<size_t>(buffer.view.len);
  if (start < 0 || static_cast<size_t>(start) > length) {
    PyErr_SetString(PyExc_ValueError, "run_frames: start outside the buffer");
    return nullptr;
  }
  const auto began = std::chrono::steady_clock::now();
  size_t position = static_cast<size_t>(start);
  int64_t last_seq = -1;
  size_t frames = 0;
  while (length - position >= kPrefixBytes) {
    Reader prefix{data + position, data + length};
    const uint64_t header_len = prefix.be(4);
    const uint64_t payload_len = prefix.be(8);
    if (payload_len != 0 || header_len < 2 || header_len > static_cast<uint64_t>(max_header)) break;
    const size_t end = position + kPrefixBytes + static_cast<size_t>(header_len);
    if (end > length || (end > (size_t{1} << 20) && end * 2 > length)) break;
    const unsigned char* header = data + position + kPrefixBytes;
    if (header[0] != 0x96 || header[1] != 0x0b) break;  // not [Op, ...]: connection.py's _OP_HEAD
    int64_t seq = -1;
    const int ran = run_frame(self, header, static_cast<size_t>(header_len), args[2], &seq);
    if (ran < 0) return nullptr;
    if (ran == 0) break;
    position = end;
    last_seq = seq;
    ++frames;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() > kBatchSeconds) break;
  }
  if (frames == 0) Py_RETURN_NONE;
  PyObject* event = ran_op(last_seq);
  if (event == nullptr) return nullptr;
  return Py_BuildValue("(nN)", static_cast<Py_ssize_t>(position), event);
}

// learn(seq, name, eligible, fresh): after Session._run_op ran op ``name`` (frame ``seq``)
// without error, with ``fresh`` bytes the guard measured: the signature the loop's last
// fallback computed for that frame is run here from now on. ``eligible`` (the first time a
// name is seen): whether the op may ever run here (session.py decides from its schema).
PyObject* loop_learn(PyObject* obj, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Loop*>(obj);
  if (nargs != 4 || !PyUnicode_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "learn(seq, name, eligible, fresh)");
    return nullptr;
  }
  const long long seq = PyLong_AsLongLong(args[0]);
  const long long fresh = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return nullptr;
  if (seq != self->pending_seq) Py_RETURN_NONE;
  self->pending_seq = -1;
  PyObject* found = PyDict_GetItemWithError(entry_index, args[1]);
  if (found == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    auto entry = std::make_unique<Entry>();
    Py_ssize_t length;
    const char* text = PyUnicode_AsUTF8AndSize(args[1], &length);
    if (text == nullptr) return nullptr;
    entry->name.assign(text, length);
    if (PyObject_IsTrue(args[2]) == 1) {
      std::string_view full(entry->name);
      const size_t dot = full.find('.', full.find("::"));
      const std::string base(full.substr(0, dot));
      const std::string overload(dot == std::string_view::npos ? "" : full.substr(dot + 1));
      entry->op = c10::Dispatcher::singleton().findSchema({base, overload == "default" ? "" : overload});
      if (entry->op) {
        for (const auto& argument : entry->op->schema().arguments()) {
          c10::TypePtr type = argument.real_type();
          if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
          if (type->kind() == c10::TypeKind::ListType) type = type->castRaw<c10::ListType>()->getElementType();
          if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
          if (type->kind() == c10::TypeKind::TensorType) entry->exact_numbers = false;
        }
      }
    }
    PyObject* position = PyLong_FromSize_t(entries.size());
    if (position == nullptr || PyDict_SetItem(entry_index, args[1], position) < 0) {
      Py_XDECREF(position);
      return nullptr;
    }
    Py_DECREF(position);
    entries.push_back(std::move(entry));
    Py_RETURN_NONE;
  }
  Entry* entry = entries[PyLong_AsSsize_t(found)].get();
  if (self->pending_entry != entry || fresh < 0) Py_RETURN_NONE;
  if (learned_total >= kMaxLearned) {  // (a client cannot grow it without bound)
    for (auto& e : entries) e->learned.clear();
    learned_total = 0;
  }
  if (entry->learned.emplace(std::move(self->pending_key), fresh).second) ++learned_total;
  self->pending_entry = nullptr;
  Py_RETURN_NONE;
}

int loop_init(PyObject* obj, PyObject* args, PyObject*) {
  auto* self = reinterpret_cast<Loop*>(obj);
  PyObject *session, *decode_hook, *rng, *rng_lock, *native_adopt, *device_type, *device_index, *device;
  if (!PyArg_ParseTuple(args, "OOOOOOOO", &session, &decode_hook, &rng, &rng_lock, &native_adopt, &device_type,
                        &device_index, &device)) {
    return -1;
  }
  if (!THPDevice_Check(device)) {
    PyErr_SetString(PyExc_TypeError, "Loop: device must be a torch.device");
    return -1;
  }
  for (PyObject* o : {session, decode_hook, rng, rng_lock, native_adopt, device_type, device_index}) Py_INCREF(o);
  Py_XSETREF(self->session, session);
  Py_XSETREF(self->decode_hook, decode_hook);
  Py_XSETREF(self->rng, rng);
  Py_XSETREF(self->rng_lock, rng_lock);
  Py_XSETREF(self->native_adopt, native_adopt);
  Py_XSETREF(self->device_type, device_type);
  Py_XSETREF(self->device_index, device_index);
  Py_XSETREF(self->ext_tensor_code, PyLong_FromLong(ext_tensor));
  self->device = reinterpret_cast<THPDevice*>(device)->device;
  self->pending_seq = -1;
  self->pending_entry = nullptr;
  Py_XSETREF(self->session_dict, InstanceAttrs::dict_of(session));
  Py_XSETREF(self->rng_dict, InstanceAttrs::dict_of(rng));
  Py_XSETREF(self->lock_acquire, PyObject_GetAttr(rng_lock, s_acquire));
  Py_XSETREF(self->lock_release, PyObject_GetAttr(rng_lock, s_release));
  return self->ext_tensor_code && self->lock_acquire && self->lock_release ? 0 : -1;
}

PyObject* loop_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* obj = type->tp_alloc(type, 0);
  if (obj == nullptr) return nullptr;
  auto* self = reinterpret_cast<Loop*>(obj);
  new (&self->device) c10::Device(c10::kCPU);
  new (&self->pending_key) std::string();
  self->pending_seq = -1;
  self->pending_entry = nullptr;
  return obj;
}

int loop_traverse(PyObject* obj, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<Loop*>(obj);
  Py_VISIT(self->session);
  Py_VISIT(self->decode_hook);
  Py_VISIT(self->rng);
  Py_VISIT(self->rng_lock);
  Py_VISIT(self->native_adopt);
  Py_VISIT(self->session_dict);
  Py_VISIT(self->rng_dict);
  Py_VISIT(self->lock_acquire);
  Py_VISIT(self->lock_release);
  return 0;
}

int loop_clear(PyObject* obj) {
  auto* self = reinterpret_cast<Loop*>(obj);
  Py_CLEAR(self->session);
  Py_CLEAR(self->decode_hook);
  Py_CLEAR(self->rng);
  Py_CLEAR(self->rng_lock);
  Py_CLEAR(self->native_adopt);
  Py_CLEAR(self->device_type);
  Py_CLEAR(self->device_index);
  Py_CLEAR(self->ext_tensor_code);
  Py_CLEAR(self->session_dict);
  Py_CLEAR(self->rng_dict);
  Py_CLEAR(self->lock_acquire);
  Py_CLEAR(self->lock_release);
  return 0;
}

void loop_dealloc(PyObject* obj) {
  PyObject_GC_UnTrack(obj);
  loop_clear(obj);
  reinterpret_cast<Loop*>(obj)->pending_key.~basic_string();
  Py_TYPE(obj)->tp_free(obj);
}

PyMethodDef loop_methods[] = {
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(loop_run)), METH_FASTCALL,
     "run(raw, names) -> RanOp, or None where Session.handle must run the frame."},
    {"run_frames", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(loop_run_frames)), METH_FASTCALL,
     "run_frames(buffer, start, names, max_header) -> (position, RanOp of the last), or None: the Op frames "
     "that follow one another from start, run until one is not."},
    {"learn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(loop_learn)), METH_FASTCALL,
     "learn(seq, name, eligible, fresh): the Python path ran this frame's op without error."},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject LoopType = {PyVarObject_HEAD_INIT(nullptr, 0) "gpuwire_node_loop.Loop"};

// configure(RanOp, APPLIED_PRECISION, node/native.py's dtype_table(), ext codes
// (tensor, dtype, device, memory format, layout), the strided layout's wire code)
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *ran, *applied, *table;
  if (!PyArg_ParseTuple(args, "OO!O!(lllll)l", &ran, &PyList_Type, &applied, &PyDict_Type, &table, &ext_tensor,
                        &ext_dtype, &ext_device, &ext_memory_format, &ext_layout, &strided_layout_code)) {
    return nullptr;
  }
  for (int& v : scalar_of_code) v = -1;
  if (gpuwire_common::read_dtype_table(table, [](int scalar, int code, PyObject*) { scalar_of_code[code] = scalar; }) < 0)
    return nullptr;
  Py_INCREF(ran);
  Py_XSETREF(ran_type, ran);
  Py_INCREF(applied);
  Py_XSETREF(applied_precision, applied);
  if (entry_index == nullptr && (entry_index = PyDict_New()) == nullptr) return nullptr;
  Py_RETURN_NONE;
}

PyObject* stats(PyObject*, PyObject*) {
  PyObject* counts = PyDict_New();
  if (counts == nullptr) return nullptr;
  for (int k = 0; k < kOutcomes; ++k) {
    PyObject* value = PyLong_FromUnsignedLongLong(outcomes[k]);
    if (value == nullptr || PyDict_SetItemString(counts, outcome_names[k], value) < 0) {
      Py_XDECREF(value);
      Py_DECREF(counts);
      return nullptr;
    }
    Py_DECREF(value);
  }
  return counts;
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "Give the loop its Python objects and tables."},
    {"stats", stats, METH_NOARGS, "{outcome: frames} since the node started: how many ran here, and why others did not."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "gpuwire_node_loop", "gpuwire's native op loop (node/loop.py).",
                          -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_gpuwire_node_loop() {
  struct Name {
    PyObject** slot;
    const char* text;
  };
  for (const Name& n : {Name{&s_unzeroed, "_unzeroed"}, Name{&s_decode_error, "decode_error"},
                        Name{&s_overwriting, "_overwriting"}, Name{&s_thread, "_thread"},
                        Name{&s_replay_floor, "replay_floor"}, Name{&s_owner, "owner"}, Name{&s_precision, "precision"},
                        Name{&s_memory_budget, "memory_budget"}, Name{&s_device_bytes, "_device_bytes"},
                        Name{&s_bytes_in_use, "bytes_in_use"}, Name{&s_ops_run, "ops_run"}, Name{&s_adopt, "_adopt"},
                        Name{&s_allocate, "allocate"}, Name{&s_failed, "_native_loop_failed"},
                        Name{&s_acquire, "acquire"}, Name{&s_release, "release"},
                        Name{&s_device_memory, "_device_memory"}, Name{&s_seq, "seq"}}) {
    *n.slot = PyUnicode_InternFromString(n.text);
    if (*n.slot == nullptr) return nullptr;
  }
  if ((s_empty_tuple = PyTuple_New(0)) == nullptr) return nullptr;
  LoopType.tp_basicsize = sizeof(Loop);
  LoopType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  LoopType.tp_doc = "Loop(session, decode_hook, rng, rng_lock, native_adopt, device_type, device_index, device)";
  LoopType.tp_new = loop_new;
  LoopType.tp_init = loop_init;
  LoopType.tp_traverse = loop_traverse;
  LoopType.tp_clear = loop_clear;
  LoopType.tp_dealloc = loop_dealloc;
  LoopType.tp_methods = loop_methods;
  if (PyType_Ready(&LoopType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  Py_INCREF(&LoopType);
  if (PyModule_AddObject(module, "Loop", reinterpret_cast<PyObject*>(&LoopType)) < 0) {
    Py_DECREF(&LoopType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
