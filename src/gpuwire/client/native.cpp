// gpuwire's native client helpers (see native.py): the device guard, the wire descriptors of
// gpuwire tensors, read straight from their TensorImpl, and the kernels of view ops. Only c10,
// the dispatcher's and Python's headers: the module builds in seconds against any torch.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>
#include <torch/library.h>

#include <c10/core/Stream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "../_native_common.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>


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

PyObject* wait_hook = nullptr;  // torch_module.synchronize(): waits until the node has run every queued op

void wait_for_the_node() {
  if (wait_hook == nullptr) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* answer = PyObject_CallNoArgs(wait_hook);
  if (answer == nullptr) {
    python_error error;  // (the node's error, raised again as itself when C++ returns to Python)
    error.persist();
    PyGILState_Release(gil);
    throw error;
  }
  Py_DECREF(answer);
  PyGILState_Release(gil);
}

// A recorded event: the host clock when the node had run everything queued before it.
struct HostEvent {
  int64_t nanos = -1;
};

// One device, index 0, one stream (a session's ops run in order on the node), without a call
// into Python for each answer. Waiting (``torch.Stream.synchronize``, ``torch.Event.synchronize``,
// device synchronization) waits for the node, as ``torch.cuda.synchronize()`` does. A timing
// event (``torch.Event(enable_timing=True)``: EventFlag::BACKEND_DEFAULT) waits for the node when
// recorded, so ``elapsed_time`` measures what ran between two records plus a round trip, as
// ``torch.cuda.Event`` does here; PyTorch's own events (no timing) are records in name only,
// free as before: they order streams, and there is one. They said "Backend doesn't support
// synchronizing events" before session 31, and stream synchronization returned at once.
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
  void record(void** event, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag flag) const override {
    if (*event == nullptr) *event = new HostEvent();
    auto* recorded = static_cast<HostEvent*>(*event);
    if (flag == c10::EventFlag::BACKEND_DEFAULT) {
      wait_for_the_node();
      recorded->nanos = c10::getTime(true);
    } else {
      recorded->nanos = 0;  // (recorded, untimed)
    }
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<HostEvent*>(event);
  }
  void synchronizeEvent(void* event) const override {
    if (event != nullptr) wait_for_the_node();
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    const auto* from = static_cast<const HostEvent*>(start);
    const auto* to = static_cast<const HostEvent*>(end);
    TORCH_CHECK(from != nullptr && to != nullptr && from->nanos > 0 && to->nanos > 0,
                "Both events must be recorded with enable_timing=True before calculating elapsed time.");
    return static_cast<double>(to->nanos - from->nanos) / 1e6;
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override { wait_for_the_node(); }
  void synchronizeDevice(const c10::DeviceIndex) const override { wait_for_the_node(); }
};

GpuwireGuard guard;

PyObject* install_guard(PyObject*, PyObject* wait) {
  Py_INCREF(wait);
  Py_XSETREF(wait_hook, wait);
  c10::impl::device_guard_impl_registry[static_cast<size_t>(kType)].store(&guard);
  return PyLong_FromLong(static_cast<long>(guard.type()));
}

// ------------------------------------------------------------------ device hooks

// PyTorch's bridge for a Python backend's hooks (torch/csrc/acc) answers isBuilt, isAvailable
// and hasPrimaryContext from Python and leaves the rest to PrivateUse1HooksInterface, whose
// getPinnedMemoryAllocator throws. PyTorch's own C++ asks for pinned host memory on the
// accelerator's behalf: DDP's reducer stages its used-parameter map through it
// (find_unused_parameters, static_graph), and ``pin_memory()`` allocates with it. Here the same
// three answers (the Python hooks return True: a session's device exists once it is asked for),
// and pinned memory is ordinary host memory: bytes go to the node through a socket, page-locked
// memory buys nothing. Registered in place of the Python bridge (PyTorch takes one
// registration).
//
// The blocks it hands out are remembered, so ``is_pinned()`` says True for them, as for CUDA's
// pinned memory (DDP's reducer asserts it of its staging tensor).
struct HostAsPinnedAllocator final : c10::Allocator {
  mutable std::mutex mutex;
  std::unordered_set<const void*> blocks;

  static void release(void* ptr);

  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = c10::alloc_cpu(nbytes);
    {
      std::lock_guard<std::mutex> lock(mutex);
      blocks.insert(ptr);
    }
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool owns(const void* ptr) const {
    std::lock_guard<std::mutex> lock(mutex);
    return blocks.count(ptr) != 0;
  }
};

HostAsPinnedAllocator* host_as_pinned = new HostAsPinnedAllocator();  // (never freed: blocks outlive exit)

void HostAsPinnedAllocator::release(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(host_as_pinned->mutex);
    host_as_pinned->blocks.erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct GpuwireHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return host_as_pinned; }
  bool isPinnedPtr(const void* data) const override { return data && host_as_pinned->owns(data); }
};

// DDP's reducer times each iteration's forward, backward and communication with a timer of its
// parameters' device type (``ddp._get_ddp_logging_data()``); PyTorch registers CPU's and CUDA's,
// and for any other device it printed "Time stats are currently only collected for CPU and CUDA
// devices" in every DDP program. Host clock times, as CPU's timer takes: gpuwire's ops are
// queued, so like CPU's these time the program's side of the iteration.
struct HostClockTimer final : c10d::Timer {
  explicit HostClockTimer(c10::Device) {}
  std::optional<int64_t> measureDifference(Event start, Event end) override {
    const int64_t start_time = getTimeRef(start);
    const int64_t end_time = getTimeRef(end);
    if (start_time == c10d::kUnsetTime || end_time < start_time) return std::nullopt;
    return end_time - start_time;
  }
};

PyObject* register_hooks(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  if (!c10d::TimerRegistry()->Has(c10::DeviceType::PrivateUse1)) {
    c10d::TimerRegistry()->Register(c10::DeviceType::PrivateUse1, [](c10::Device device) -> std::unique_ptr<c10d::Timer> {
      return std::make_unique<HostClockTimer>(device);
    });
  }
  if (at::isPrivateUse1HooksRegistered()) Py_RETURN_FALSE;
  at::RegisterPrivateUse1HooksInterface(new GpuwireHooks());  // (never freed: registered for good)
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
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

// ------------------------------------------------------------------ op kernels

// A functional op with one fresh result (``add.Tensor``, ``addmm``, ``mm``, ``sum.dim_IntList``
// ...: ``device.DirectPlan``s) whose argument signature Python has already served sends one
// message and makes one tensor; Python's plan did that through the GIL, the conversion of
// every argument to a Python object, its signature key, and the tensor's creation, for every
// call. Here a call whose signature C++ has learned is keyed, encoded and its tensor made in
// C++; Python is called once, to number the message, reserve the result's address and queue it
// (``device._native_submit``). Any other call — a new signature, an argument kind not handled
// here, a host tensor, the runtime not ready — goes to the op's Python plan exactly as its
// Python kernel was called (``device._native_learn``), which also says when the signature's
// layout is known, so the next call with it takes the C++ path.

// The argument kinds of a schema this handles (from ``device._NATIVE_KINDS``); Optional[...]
// of each too (None needs no kind).
enum Kind : uint8_t {
  kTensor = 0, kInt = 1, kIntList = 2, kFloat = 3, kBool = 4, kScalar = 5, kStr = 6, kScalarType = 7,
  kMemoryFormat = 8, kLayout = 9, kDevice = 10, kBoolList = 11, kTensorList = 12, kOptionalTensorList = 13,
};

PyObject* learn_hook = nullptr;    // device._native_learn(plan, args, kwargs) -> (result, spec | None)
PyObject* submit_hook = nullptr;   // device._native_submit(name, nbytes, weak ref, body, out tail) -> address | None
PyObject* submit_many_hook = nullptr;  // device._native_submit_many(name, body, nbytes, refs, tails) -> addresses | None
PyObject* device_type_obj = nullptr;  // torch.device, for a Device value handed to Python
long tensor_ext_code = 1;          // codec.EXT_TENSOR
// c10::MemoryFormat / c10::Layout value -> (msgpack, Python object), as wire.encode_default packs them
constexpr int kEnums = 16;
std::string memory_format_bytes[kEnums], layout_bytes[kEnums];
PyObject* memory_format_objects[kEnums] = {};
PyObject* layout_objects[kEnums] = {};
std::string device_bytes, device_bytes_no_index;  // gpuwire:0, gpuwire (no index)

// One fresh result of a learned signature
struct Out {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  int64_t nbytes;
  std::string tail;  // msgpack of [nbytes, sizes, strides, code]: its out declaration after the id
};
using Outs = std::vector<Out>;  // one per result of the op

void pack_ext(std::string& out, int type, const std::string& data) {
  const size_t n = data.size();
  switch (n) {  // msgpack-python's choice: fixext where the length fits one, else ext 8/16/32
    case 1: out.push_back('\xd4'); break;
    case 2: out.push_back('\xd5'); break;
    case 4: out.push_back('\xd6'); break;
    case 8: out.push_back('\xd7'); break;
    case 16: out.push_back('\xd8'); break;
    default:
      if (n < 0x100) { out.push_back('\xc7'); gpuwire_common::put_be(out, n, 1); }
      else if (n < 0x10000) { out.push_back('\xc8'); gpuwire_common::put_be(out, n, 2); }
      else { out.push_back('\xc9'); gpuwire_common::put_be(out, n, 4); }
  }
  out.push_back(static_cast<char>(type));
  out += data;
}

void pack_str(std::string& out, const std::string& s) {
  const size_t n = s.size();
  if (n < 32) out.push_back(static_cast<char>(0xa0 | n));
  else if (n < 0x100) { out.push_back('\xd9'); gpuwire_common::put_be(out, n, 1); }
  else if (n < 0x10000) { out.push_back('\xda'); gpuwire_common::put_be(out, n, 2); }
  else { out.push_back('\xdb'); gpuwire_common::put_be(out, n, 4); }
  out += s;
}

void pack_double(std::string& out, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  out.push_back('\xcb');
  gpuwire_common::put_be(out, bits, 8);
}

template <typename T>
void put_raw(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// A gpuwire tensor this path may describe (as ``gpuwire_impl`` accepts a Python one), or nullptr
c10::TensorImpl* plain_gpuwire(const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::DispatchKeySet keys = impl->key_set();
  if (!keys.has(c10::DispatchKey::PrivateUse1) || keys.has(c10::DispatchKey::Python) ||
      impl->layout() != c10::kStrided || !impl->has_storage() || impl->has_symbolic_sizes_strides()) {
    return nullptr;
  }
  const auto st = static_cast<int>(impl->dtype().toScalarType());
  return st >= 0 && st < kScalarTypes && dtype_codes[st] >= 0 ? impl : nullptr;
}

bool is_wrapped_number(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().is_cpu();
}

// 'f', 'i', 'b' for a wrapped number of a floating, integral or boolean type; 0 otherwise
char number_category(c10::ScalarType st) {
  if (st == c10::ScalarType::Bool) return 'b';
  if (c10::isIntegralType(st, false)) return 'i';
  if (c10::isFloatingType(st)) return 'f';
  return 0;
}

bool concrete_int(const c10::IValue& v, int64_t& out) {
  if (v.isInt()) { out = v.toInt(); return true; }
  if (v.isSymInt()) {
    auto value = v.toSymInt().maybe_as_int();
    if (!value) return false;
    out = *value;
    return true;
  }
  return false;
}

bool int_list(const c10::IValue& v, std::vector<int64_t>& out) {
  if (v.isIntList()) { out = v.toIntVector(); return true; }
  if (!v.isList()) return false;
  for (const c10::IValue& item : v.toListRef()) {
    int64_t value;
    if (!concrete_int(item, value)) return false;
    out.push_back(value);
  }
  return true;
}

// THPVariable_Wrap (libtorch_python: the Python tensor of a C++ one) is declared differently by
// torch versions (const&, &&, by value) and its header costs seconds of every build: this finds
// whichever the loaded torch exports
PyObject* wrap_tensor(const at::Tensor& t) {
  using ByRef = PyObject* (*)(const at::TensorBase&);
  using ByValue = PyObject* (*)(at::TensorBase);
  static void* library = dlopen("libtorch_python.so", RTLD_LAZY | RTLD_NOLOAD);
  static auto by_ref = library ? reinterpret_cast<ByRef>(dlsym(library, "_Z16THPVariable_WrapRKN2at10TensorBaseE")) : nullptr;
  // (an rvalue reference is passed as a pointer, as a const one: called so on a copy)
  static auto by_rvalue = library ? reinterpret_cast<ByRef>(dlsym(library, "_Z16THPVariable_WrapON2at10TensorBaseE")) : nullptr;
  static auto by_value = library ? reinterpret_cast<ByValue>(dlsym(library, "_Z16THPVariable_WrapN2at10TensorBaseE")) : nullptr;
  if (by_ref) return by_ref(t);
  if (by_rvalue) {
    at::TensorBase copy(t);
    return by_rvalue(copy);
  }
  if (by_value) return by_value(at::TensorBase(t));
  PyErr_SetString(PyExc_RuntimeError, "gpuwire: this torch exports no THPVariable_Wrap the native op kernels know");
  return nullptr;
}

// A tensor's part of a call signature: dtype, dimensions, sizes, strides
void key_layout(c10::TensorImpl* impl, std::string& out) {
  out.push_back(static_cast<char>(impl->dtype().toScalarType()));
  const auto sizes = impl->sizes();
  const auto strides = impl->strides();
  put_raw<uint8_t>(out, static_cast<uint8_t>(sizes.size()));
  for (auto size : sizes) put_raw(out, size);
  for (auto stride : strides) put_raw(out, stride);
}

struct OpKernel final : public c10::OperatorKernel {
  PyObject* plan;   // the op's device.DirectPlan (kept alive by device._NATIVE_OPS)
  PyObject* name;   // "aten::add.Tensor"
  bool numbers_as_numbers;  // a wrapped number goes as a Python number (ops allowing numbers as tensors)
  bool known_values;        // an op whose result the client mirrors (mirror.py ``OPS``): the runtime
                            // declines a call whose inputs are all mirrored, so the Python path mirrors it
  int64_t tiny_first = 0;   // a predicate (``isnan``): a first argument of at most this many bytes goes to
                            // the Python path, which reads it along with the result (mirror.py ``TINY``)
  bool functional;          // a FunctionalPlan's rules: a Scalar by its value, the inputs' mirrors dropped
  size_t results = 1;       // fresh results; 0: in place on its first argument, which it returns
  bool has_lists = false;   // a Tensor[] argument (``cat``): its tensors' mirrored values dropped too
  std::vector<Kind> kinds;
  std::unordered_map<std::string, std::shared_ptr<const Outs>> cache;

  // The signature of a call (what decides the result's layout, as ``device._call_key`` reads
  // it: a tensor's dtype, sizes and strides, a number in a Scalar or Tensor slot by its kind,
  // any other value by value); false for a call this path does not take.
  bool key(const c10::ArrayRef<c10::IValue> args, std::string& out) const {
    for (size_t i = 0; i < args.size(); ++i) {
      const c10::IValue& v = args[i];
      if (v.isNone()) { out.push_back('N'); continue; }
      switch (kinds[i]) {
        case kTensor: {
          if (!v.isTensor()) return false;
          const at::Tensor& t = v.toTensor();
          if (!t.defined()) { out.push_back('N'); break; }
          if (is_wrapped_number(t)) {
            const char category = number_category(t.scalar_type());
            if (!numbers_as_numbers || category == 0) return false;
            out.push_back(category);
            break;
          }
          c10::TensorImpl* impl = plain_gpuwire(t);
          if (impl == nullptr) return false;
          if (i == 0 && tiny_first > 0 && impl->numel() * static_cast<int64_t>(impl->itemsize()) <= tiny_first) return false;
          out.push_back('T');
          key_layout(impl, out);
          break;
        }
        case kInt: {
          int64_t value;
          if (!concrete_int(v, value)) return false;
          out.push_back('I');
          put_raw(out, value);
          break;
        }
        case kIntList: {
          std::vector<int64_t> values;
          if (!int_list(v, values)) return false;
          out.push_back('L');
          put_raw<uint32_t>(out, static_cast<uint32_t>(values.size()));
          for (auto value : values) put_raw(out, value);
          break;
        }
        case kFloat:
          if (!v.isDouble()) return false;
          out.push_back('D');
          put_raw(out, v.toDouble());
          break;
        case kBool:
          if (!v.isBool()) return false;
          out.push_back(v.toBool() ? 'Y' : 'n');
          break;
        case kScalar:  // by kind alone, as a DirectPlan keys it; a FunctionalPlan by value too
          if (v.isDouble()) {
            out.push_back('f');
            if (functional) put_raw(out, v.toDouble());
          } else if (v.isBool()) {
            out.push_back('b');
            if (functional) out.push_back(v.toBool() ? 1 : 0);
          } else if (v.isInt()) {
            out.push_back('i');
            if (functional) put_raw(out, v.toInt());
          } else {
            return false;
          }
          break;
        case kStr: {
          if (!v.isString()) return false;
          const std::string& s = v.toStringRef();
          out.push_back('S');
          put_raw<uint32_t>(out, static_cast<uint32_t>(s.size()));
          out += s;
          break;
        }
        case kScalarType: {
          if (!v.isInt()) return false;
          const int64_t st = v.toInt();
          if (st < 0 || st >= kScalarTypes || dtype_codes[st] < 0) return false;
          out.push_back('Z');
          out.push_back(static_cast<char>(st));
          break;
        }
        case kMemoryFormat:
        case kLayout: {
          if (!v.isInt()) return false;
          const int64_t value = v.toInt();
          const std::string* table = kinds[i] == kLayout ? layout_bytes : memory_format_bytes;
          if (value < 0 || value >= kEnums || table[value].empty()) return false;
          out.push_back(kinds[i] == kLayout ? 'Q' : 'M');
          out.push_back(static_cast<char>(value));
          break;
        }
        case kTensorList: {
          if (!v.isTensorList()) return false;
          const auto tensors = v.toTensorList();
          out.push_back('W');
          put_raw<uint32_t>(out, static_cast<uint32_t>(tensors.size()));
          for (const at::Tensor& t : tensors) {
            c10::TensorImpl* impl = t.defined() ? plain_gpuwire(t) : nullptr;
            if (impl == nullptr) return false;
            out.push_back(static_cast<char>((impl->is_conj() ? 1 : 0) | (impl->is_neg() ? 2 : 0)));
            key_layout(impl, out);
          }
          break;
        }
        case kOptionalTensorList: {  // (``index``'s indices: a None for each dimension taken whole)
          if (!v.isList()) return false;
          const auto items = v.toListRef();
          out.push_back('O');
          put_raw<uint32_t>(out, static_cast<uint32_t>(items.size()));
          for (const c10::IValue& item : items) {
            if (item.isNone()) { out.push_back('N'); continue; }
            if (!item.isTensor()) return false;
            const at::Tensor& t = item.toTensor();
            c10::TensorImpl* impl = t.defined() && !is_wrapped_number(t) ? plain_gpuwire(t) : nullptr;
            if (impl == nullptr) return false;  // (a host index: the Python path uploads it)
            out.push_back(static_cast<char>((impl->is_conj() ? 1 : 0) | (impl->is_neg() ? 2 : 0)));
            key_layout(impl, out);
          }
          break;
        }
        case kBoolList: {
          if (!v.isBoolList()) return false;
          const auto values = v.toBoolList();
          out.push_back('K');
          put_raw<uint32_t>(out, static_cast<uint32_t>(values.size()));
          for (bool value : values) out.push_back(value ? 1 : 0);
          break;
        }
        case kDevice: {  // the gpuwire device only (another goes to Python, which says why)
          if (!v.isDevice() || v.toDevice().type() != c10::DeviceType::PrivateUse1 || v.toDevice().index() > 0) return false;
          out.push_back('V');
          out.push_back(v.toDevice().has_index() ? 1 : 0);
          break;
        }
        default:
          return false;
      }
    }
    return true;
  }

  // One argument's msgpack, as the Python plan's message packs the Python object its kernel got
  static void encode_value(Kind kind, const c10::IValue& v, std::string& out) {
    if (v.isNone()) { out.push_back('\xc0'); return; }
    switch (kind) {
      case kTensor: {
        const at::Tensor& t = v.toTensor();
        if (!t.defined()) { out.push_back('\xc0'); return; }
        if (is_wrapped_number(t)) {
          const auto st = t.scalar_type();
          if (st == c10::ScalarType::Bool) out.push_back(t.item<bool>() ? '\xc3' : '\xc2');
          else if (c10::isIntegralType(st, false)) pack_int(out, t.item<int64_t>());
          else pack_double(out, t.item<double>());
          return;
        }
        std::string descriptor;
        describe(t.unsafeGetTensorImpl(), descriptor);
        pack_ext(out, static_cast<int>(tensor_ext_code), descriptor);
        return;
      }
      case kInt: {
        int64_t value = 0;
        concrete_int(v, value);
        pack_int(out, value);
        return;
      }
      case kIntList: {
        std::vector<int64_t> values;
        int_list(v, values);
        pack_array_header(out, values.size());
        for (auto value : values) pack_int(out, value);
        return;
      }
      case kFloat: pack_double(out, v.toDouble()); return;
      case kBool: out.push_back(v.toBool() ? '\xc3' : '\xc2'); return;
      case kScalar:
        if (v.isDouble()) pack_double(out, v.toDouble());
        else if (v.isBool()) out.push_back(v.toBool() ? '\xc3' : '\xc2');
        else pack_int(out, v.toInt());
        return;
      case kStr: pack_str(out, v.toStringRef()); return;
      case kScalarType: {  // ExtType(EXT_DTYPE, bytes([code])), as wire._DTYPE_EXT
        out.push_back('\xd4');
        out.push_back('\x02');
        out.push_back(static_cast<char>(dtype_codes[v.toInt()]));
        return;
      }
      case kMemoryFormat: out += memory_format_bytes[v.toInt()]; return;
      case kLayout: out += layout_bytes[v.toInt()]; return;
      case kDevice: out += v.toDevice().has_index() ? device_bytes : device_bytes_no_index; return;
      case kTensorList: {
        const auto tensors = v.toTensorList();
        pack_array_header(out, tensors.size());
        for (const at::Tensor& t : tensors) {
          std::string descriptor;
          describe(t.unsafeGetTensorImpl(), descriptor);
          pack_ext(out, static_cast<int>(tensor_ext_code), descriptor);
        }
        return;
      }
      case kBoolList: {
        const auto values = v.toBoolList();
        pack_array_header(out, values.size());
        for (bool value : values) out.push_back(value ? '\xc3' : '\xc2');
        return;
      }
      case kOptionalTensorList: {
        const auto items = v.toListRef();
        pack_array_header(out, items.size());
        for (const c10::IValue& item : items) {
          if (item.isNone()) { out.push_back('\xc0'); continue; }
          std::string descriptor;
          describe(item.toTensor().unsafeGetTensorImpl(), descriptor);
          pack_ext(out, static_cast<int>(tensor_ext_code), descriptor);
        }
        return;
      }
    }
  }

  // (arguments given positionally, first keyword-only argument): the split PyTorch makes when it
  // hands a call to a Python kernel (``parseIValuesToPyArgsKwargs``): trailing positional
  // arguments equal to their defaults are left out, and keyword-only ones equal to theirs
  static size_t positional_count(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, size_t& kwarg_start) {
    const auto& arguments = schema.arguments();
    size_t k = args.size();
    while (k > 0 && arguments[k - 1].kwarg_only()) --k;
    kwarg_start = k;
    size_t p = k;
    while (p > 0 && is_default(arguments[p - 1], args[p - 1])) --p;
    return p;
  }

  static bool is_default(const c10::Argument& argument, const c10::IValue& value) {
    const auto& fallback_value = argument.default_value();
    return fallback_value.has_value() && *fallback_value == value;
  }

  // msgpack of (args, kwargs) as the Python plan's message has them
  void encode_call(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, std::string& out) const {
    size_t kwarg_start;
    const size_t positional = positional_count(schema, args, kwarg_start);
    pack_array_header(out, positional);
    for (size_t i = 0; i < positional; ++i) encode_value(kinds[i], args[i], out);
    std::vector<size_t> keywords;
    for (size_t i = kwarg_start; i < args.size(); ++i) {
      if (!is_default(schema.arguments()[i], args[i])) keywords.push_back(i);
    }
    if (keywords.size() < 16) {
      out.push_back(static_cast<char>(0x80 | keywords.size()));
    } else {
      out.push_back('\xde');
      gpuwire_common::put_be(out, keywords.size(), 2);
    }
    for (size_t i : keywords) {
      pack_str(out, schema.arguments()[i].name());
      encode_value(kinds[i], args[i], out);
    }
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const c10::FunctionSchema& schema = op.schema();
    const size_t n = schema.arguments().size();
    GilHolder gil;
    const auto args = torch::jit::last(*stack, n);
    std::string signature;
    bool keyed = kinds.size() == n && key(args, signature);
    if (keyed) {
      auto found = cache.find(signature);
      if (found != cache.end()) {
        std::shared_ptr<const Outs> outs = found->second;  // (a Python call below may clear the cache)
        if (submit(schema, args, *outs, stack)) return;
        keyed = false;  // (Python declined: the general path, and nothing to learn)
      }
    }
    call_python(schema, args, stack, keyed ? &signature : nullptr);
  }

  // The C++ path: true with the results on the stack, false where Python declines the call
  bool submit(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, const Outs& outs,
              torch::jit::Stack* stack) const {
    std::string body;
    body.reserve(256);
    encode_call(schema, args, body);
    const c10::Device device(c10::DeviceType::PrivateUse1, 0);
    const size_t n = outs.size();
    std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages;
    std::vector<c10::StorageImpl*> weak;  // runtime._live's references, once it takes them
    for (const Out& out : outs) {
      storages.push_back(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), c10::SymInt(out.nbytes),
                                                               c10::DataPtr(nullptr, device), nullptr, false));
      weak.push_back(c10::raw::intrusive_ptr::make_weak(storages.back().get()));
    }
    PyObject* answer = nullptr;
    PyObject* body_bytes = PyBytes_FromStringAndSize(body.data(), static_cast<Py_ssize_t>(body.size()));
    PyObject* forget = functional || known_values || results == 0 || has_lists ? input_storages(args) : (Py_INCREF(Py_None), Py_None);
    if (forget == nullptr) Py_CLEAR(body_bytes);
    if (n == 1) {
      PyObject* ref = PyLong_FromVoidPtr(weak[0]);
      PyObject* nbytes = PyLong_FromLongLong(outs[0].nbytes);
      PyObject* tail = PyBytes_FromStringAndSize(outs[0].tail.data(), static_cast<Py_ssize_t>(outs[0].tail.size()));
      if (ref && nbytes && body_bytes && tail) {
        PyObject* call_args[] = {name, nbytes, ref, body_bytes, tail, forget};
        answer = PyObject_Vectorcall(submit_hook, call_args, 6, nullptr);
      }
      Py_XDECREF(ref);
      Py_XDECREF(nbytes);
      Py_XDECREF(tail);
    } else {
      PyObject* refs = PyTuple_New(static_cast<Py_ssize_t>(n));
      PyObject* sizes = PyTuple_New(static_cast<Py_ssize_t>(n));
      PyObject* tails = PyTuple_New(static_cast<Py_ssize_t>(n));
      bool ok = refs && sizes && tails && body_bytes;
      for (size_t i = 0; ok && i < n; ++i) {
        PyObject* ref = PyLong_FromVoidPtr(weak[i]);
        PyObject* nbytes = PyLong_FromLongLong(outs[i].nbytes);
        PyObject* tail = PyBytes_FromStringAndSize(outs[i].tail.data(), static_cast<Py_ssize_t>(outs[i].tail.size()));
        ok = ref && nbytes && tail;
        if (ref) PyTuple_SET_ITEM(refs, static_cast<Py_ssize_t>(i), ref);
        if (nbytes) PyTuple_SET_ITEM(sizes, static_cast<Py_ssize_t>(i), nbytes);
        if (tail) PyTuple_SET_ITEM(tails, static_cast<Py_ssize_t>(i), tail);
      }
      if (ok) {
        PyObject* call_args[] = {name, body_bytes, sizes, refs, tails, forget};
        answer = PyObject_Vectorcall(submit_many_hook, call_args, 6, nullptr);
      }
      Py_XDECREF(refs);
      Py_XDECREF(sizes);
      Py_XDECREF(tails);
    }
    Py_XDECREF(body_bytes);
    Py_XDECREF(forget);
    if (answer == Py_None) {
      for (c10::StorageImpl* ref : weak) c10::raw::weak_intrusive_ptr::decref(ref);  // (the runtime declined)
      Py_DECREF(answer);
      return false;
    }
    if (answer == nullptr) throw_python_error();  // (the references may be kept by then: not released)
    std::vector<void*> addresses;
    if (n == 1) {
      addresses.push_back(PyLong_AsVoidPtr(answer));
    } else if (PyTuple_Check(answer) && static_cast<size_t>(PyTuple_GET_SIZE(answer)) == n) {
      for (size_t i = 0; i < n; ++i) addresses.push_back(PyLong_AsVoidPtr(PyTuple_GET_ITEM(answer, static_cast<Py_ssize_t>(i))));
    }
    Py_DECREF(answer);
    if (PyErr_Occurred()) throw_python_error();
    if (addresses.size() != n) throw std::runtime_error("gpuwire: the runtime answered a native op with the wrong addresses");
    if (results == 0) {  // in place: the op returns the tensor it wrote
      c10::IValue written = args[0];
      torch::jit::drop(*stack, args.size());
      stack->emplace_back(std::move(written));
      return true;
    }
    torch::jit::drop(*stack, args.size());
    for (size_t i = 0; i < n; ++i) {
      storages[i]->set_data_ptr_noswap(c10::DataPtr(addresses[i], device));
      auto result = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(storages[i])),
                                                             c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                             caffe2::TypeMeta::fromScalarType(outs[i].dtype));
      result.unsafeGetTensorImpl()->set_sizes_and_strides(outs[i].sizes, outs[i].strides);
      stack->emplace_back(std::move(result));
    }
    return true;
  }

  // The storage ids of the gpuwire tensors among ``args`` (a list; nullptr with an error)
  static PyObject* input_storages(c10::ArrayRef<c10::IValue> args) {
    PyObject* ids = PyList_New(0);
    auto add = [&ids](const at::Tensor& t) {
      if (ids == nullptr || !t.defined() || is_wrapped_number(t)) return;
      PyObject* id = PyLong_FromVoidPtr(const_cast<void*>(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()->data()));
      if (id == nullptr || PyList_Append(ids, id) < 0) Py_CLEAR(ids);
      Py_XDECREF(id);
    };
    for (const c10::IValue& v : args) {
      if (v.isTensor()) add(v.toTensor());
      else if (v.isTensorList()) for (const at::Tensor& t : v.toTensorList()) add(t);
      else if (v.isList()) for (const c10::IValue& item : v.toListRef()) if (item.isTensor()) add(item.toTensor());
    }
    return ids;
  }

  // The op's Python plan, called as PyTorch calls a Python kernel; learns the signature's layout
  // when Python has it cached (``signature`` given)
  void call_python(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args, torch::jit::Stack* stack,
                   const std::string* signature) {
    size_t kwarg_start;
    const size_t positional = positional_count(schema, args, kwarg_start);
    PyObject* py_args = PyTuple_New(static_cast<Py_ssize_t>(positional));
    PyObject* py_kwargs = PyDict_New();
    bool ok = py_args && py_kwargs;
    for (size_t i = 0; ok && i < positional; ++i) {
      PyObject* value = to_python(kinds[i], args[i]);
      ok = value != nullptr;
      if (ok) PyTuple_SET_ITEM(py_args, static_cast<Py_ssize_t>(i), value);
    }
    for (size_t i = kwarg_start; ok && i < args.size(); ++i) {
      if (is_default(schema.arguments()[i], args[i])) continue;
      PyObject* value = to_python(kinds[i], args[i]);
      ok = value != nullptr && PyDict_SetItemString(py_kwargs, schema.arguments()[i].name().c_str(), value) == 0;
      Py_XDECREF(value);
    }
    PyObject* answer = nullptr;
    if (ok) {
      PyObject* call_args[] = {plan, py_args, py_kwargs};
      answer = PyObject_Vectorcall(learn_hook, call_args, 3, nullptr);
    }
    Py_XDECREF(py_args);
    Py_XDECREF(py_kwargs);
    if (answer == nullptr) throw_python_error();
    PyObject* result = PyTuple_Check(answer) && PyTuple_GET_SIZE(answer) == 2 ? PyTuple_GET_ITEM(answer, 0) : nullptr;
    std::vector<at::Tensor> tensors;
    if (result != nullptr && results <= 1) {  // (in place: the tensor it wrote)
      tensors.emplace_back();
      if (!tensor_of(result, tensors.back())) tensors.clear();
    } else if (result != nullptr && PyTuple_Check(result) && static_cast<size_t>(PyTuple_GET_SIZE(result)) == results) {
      for (size_t i = 0; i < results; ++i) {
        PyObject* item = PyTuple_GET_ITEM(result, static_cast<Py_ssize_t>(i));
        tensors.emplace_back();  // (None: an undefined tensor, as PyTorch reads it)
        if (item != Py_None && !tensor_of(item, tensors.back())) {
          tensors.clear();
          break;
        }
      }
    }
    if (tensors.size() != std::max<size_t>(results, 1)) {
      Py_DECREF(answer);
      throw std::runtime_error("gpuwire: an op's plan returned other than its schema's tensors");
    }
    PyObject* specs = PyTuple_GET_ITEM(answer, 1);
    if (signature != nullptr && specs != Py_None) remember(*signature, specs);
    Py_DECREF(answer);
    if (PyErr_Occurred()) throw_python_error();
    torch::jit::drop(*stack, args.size());
    for (at::Tensor& tensor : tensors) stack->emplace_back(std::move(tensor));
  }

  // specs: one (sizes, strides, dtype, code, nbytes) per result, as device.output_spec gives it
  void remember(const std::string& signature, PyObject* specs) {
    auto outs = std::make_shared<Outs>();
    PyObject* seq = PySequence_Fast(specs, "specs");
    if (seq != nullptr && static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)) == results) {
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
        Out out;
        if (!read_spec(PySequence_Fast_GET_ITEM(seq, i), out)) break;
        outs->push_back(std::move(out));
      }
    }
    Py_XDECREF(seq);
    PyErr_Clear();  // (not specs: nothing learned)
    if (outs->size() != results) return;
    if (cache.size() >= 4096) cache.clear();  // (a program making endless new shapes)
    cache[signature] = std::move(outs);
  }

  static bool read_spec(PyObject* spec, Out& out) {
    PyObject *sizes, *strides, *dtype;
    int code;
    long long nbytes;
    if (!PyTuple_Check(spec) || !PyArg_ParseTuple(spec, "OOOiL", &sizes, &strides, &dtype, &code, &nbytes)) return false;
    if (!read_ints(sizes, out.sizes) || !read_ints(strides, out.strides) || code < 0 || nbytes < 0 ||
        out.sizes.size() != out.strides.size()) {
      return false;
    }
    int st = -1;
    for (int i = 0; i < kScalarTypes; ++i) {
      if (dtype_objects[i] == dtype && dtype_codes[i] == code) st = i;
    }
    if (st < 0) return false;
    out.dtype = static_cast<c10::ScalarType>(st);
    out.nbytes = nbytes;
    pack_int(out.tail, nbytes);
    pack_array_header(out.tail, out.sizes.size());
    for (auto size : out.sizes) pack_int(out.tail, size);
    pack_array_header(out.tail, out.strides.size());
    for (auto stride : out.strides) pack_int(out.tail, stride);
    pack_int(out.tail, code);
    return true;
  }

  static bool read_ints(PyObject* seq, std::vector<int64_t>& out) {
    if (!PyTuple_Check(seq)) return false;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); ++i) {
      const long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
      if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      out.push_back(value);
    }
    return true;
  }

  // The Python object a Python kernel gets for an argument (new reference; nullptr with an error)
  static PyObject* to_python(Kind kind, const c10::IValue& v) {
    if (v.isNone()) Py_RETURN_NONE;
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (!t.defined()) Py_RETURN_NONE;
      if (is_wrapped_number(t)) {  // a Python number, as PyTorch hands one to a Python kernel
        const auto st = t.scalar_type();
        if (st == c10::ScalarType::Bool) return PyBool_FromLong(t.item<bool>());
        if (c10::isIntegralType(st, false)) return PyLong_FromLongLong(t.item<int64_t>());
        if (c10::isComplexType(st)) {
          const auto z = t.item<c10::complex<double>>();
          return PyComplex_FromDoubles(z.real(), z.imag());
        }
        return PyFloat_FromDouble(t.item<double>());
      }
      return wrap_tensor(t);
    }
    if (kind == kScalarType && v.isInt()) {
      const int64_t st = v.toInt();
      if (st >= 0 && st < kScalarTypes && dtype_objects[st] != nullptr) {
        Py_INCREF(dtype_objects[st]);
        return dtype_objects[st];
      }
    }
    if ((kind == kMemoryFormat || kind == kLayout) && v.isInt()) {
      const int64_t value = v.toInt();
      PyObject* const* table = kind == kLayout ? layout_objects : memory_format_objects;
      if (value >= 0 && value < kEnums && table[value] != nullptr) {
        Py_INCREF(table[value]);
        return table[value];
      }
    }
    if (v.isDevice()) return PyObject_CallFunction(device_type_obj, "s", v.toDevice().str().c_str());
    if (v.isTensorList()) {
      const auto tensors = v.toTensorList();
      PyObject* list = PyList_New(static_cast<Py_ssize_t>(tensors.size()));
      for (size_t i = 0; list && i < tensors.size(); ++i) {
        const at::Tensor t = tensors[i];
        PyObject* item = t.defined() ? wrap_tensor(t) : (Py_INCREF(Py_None), Py_None);
        if (!item) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
      }
      return list;
    }
    if (kind == kOptionalTensorList && v.isList()) {
      const auto items = v.toListRef();
      PyObject* list = PyList_New(static_cast<Py_ssize_t>(items.size()));
      for (size_t i = 0; list && i < items.size(); ++i) {
        PyObject* item = to_python(kTensor, items[i]);
        if (!item) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
      }
      return list;
    }
    if (v.isBoolList()) {
      const auto values = v.toBoolList();
      PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
      for (size_t i = 0; list && i < values.size(); ++i) {
        PyObject* item = values[i] ? Py_True : Py_False;
        Py_INCREF(item);
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
      }
      return list;
    }
    if (v.isInt()) return PyLong_FromLongLong(v.toInt());
    if (v.isUnsigned()) return PyLong_FromUnsignedLongLong(v.toUInt());  // (a number past int64: uint64 fills)
    if (v.isSymInt()) {
      auto value = v.toSymInt().maybe_as_int();
      if (value) return PyLong_FromLongLong(*value);
      PyErr_SetString(PyExc_TypeError, "symbolic sizes cannot be sent to a gpuwire node");
      return nullptr;
    }
    if (v.isDouble()) return PyFloat_FromDouble(v.toDouble());
    if (v.isBool()) return PyBool_FromLong(v.toBool());
    if (v.isComplexDouble()) {
      const auto z = v.toComplexDouble();
      return PyComplex_FromDoubles(z.real(), z.imag());
    }
    if (v.isString()) return PyUnicode_FromStringAndSize(v.toStringRef().data(), static_cast<Py_ssize_t>(v.toStringRef().size()));
    if (v.isIntList() || v.isList()) {
      std::vector<int64_t> values;
      if (!int_list(v, values)) {
        PyErr_SetString(PyExc_TypeError, "gpuwire: a list argument of a kind the native kernel does not convert");
        return nullptr;
      }
      PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
      for (size_t i = 0; list && i < values.size(); ++i) {
        PyObject* item = PyLong_FromLongLong(values[i]);
        if (!item) { Py_CLEAR(list); break; }
        PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
      }
      return list;
    }
    PyErr_Format(PyExc_TypeError, "gpuwire: an argument of type %s the native kernel does not convert", v.tagKind().c_str());
    return nullptr;
  }

  static bool tensor_of(PyObject* obj, at::Tensor& out) {
    if (tensor_type == nullptr || !PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(tensor_type))) return false;
    PyObject* cdata = PyObject_GetAttr(obj, cdata_name);
    if (cdata == nullptr) return false;
    auto* impl = static_cast<c10::TensorImpl*>(PyLong_AsVoidPtr(cdata));
    Py_DECREF(cdata);
    if (impl == nullptr) return false;
    out = at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim_copy(impl));
    return true;
  }

  [[noreturn]] static void throw_python_error() {
    python_error error;
    error.persist();  // (raised again on the caller's thread: autograd's device thread hands it over)
    throw error;
  }

  struct GilHolder {
    PyGILState_STATE state = PyGILState_Ensure();
    ~GilHolder() { PyGILState_Release(state); }
  };
};

std::vector<OpKernel*> op_kernels;        // every registered kernel (cleared together)
torch::Library* op_library = nullptr;     // never freed, as view_library

// Reads {enum value: (msgpack bytes, object)} into the two tables; false with a Python error
bool read_enum_table(PyObject* table, std::string* bytes, PyObject** objects) {
  if (!PyDict_Check(table)) {
    PyErr_SetString(PyExc_TypeError, "an enum table must be a dict");
    return false;
  }
  PyObject *k, *v;
  Py_ssize_t pos = 0;
  while (PyDict_Next(table, &pos, &k, &v)) {
    const long index = PyLong_AsLong(k);
    const char* data;
    Py_ssize_t size;
    PyObject* object;
    if (index < 0 || index >= kEnums || !PyArg_ParseTuple(v, "y#O", &data, &size, &object)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "enum value out of range");
      return false;
    }
    bytes[index].assign(data, static_cast<size_t>(size));
    Py_INCREF(object);
    Py_XSETREF(objects[index], object);
  }
  return true;
}

// configure_ops(learn, submit, submit_many, EXT_TENSOR, (memory formats, layouts, torch.device,
// gpuwire:0 bytes, gpuwire bytes)) — see device._native_tables
PyObject* configure_ops(PyObject*, PyObject* args) {
  PyObject *learn, *submit, *submit_many, *memory_formats, *layouts, *device_type;
  long code;
  const char *device0, *device_any;
  Py_ssize_t device0_size, device_any_size;
  if (!PyArg_ParseTuple(args, "OOOl(OOOy#y#)", &learn, &submit, &submit_many, &code, &memory_formats, &layouts,
                        &device_type, &device0, &device0_size, &device_any, &device_any_size)) {
    return nullptr;
  }
  if (!read_enum_table(memory_formats, memory_format_bytes, memory_format_objects) ||
      !read_enum_table(layouts, layout_bytes, layout_objects)) {
    return nullptr;
  }
  Py_INCREF(device_type);
  Py_XSETREF(device_type_obj, device_type);
  device_bytes.assign(device0, static_cast<size_t>(device0_size));
  device_bytes_no_index.assign(device_any, static_cast<size_t>(device_any_size));
  for (PyObject** slot : {&learn_hook, &submit_hook, &submit_many_hook}) Py_CLEAR(*slot);
  Py_INCREF(learn);
  Py_INCREF(submit);
  Py_INCREF(submit_many);
  learn_hook = learn;
  submit_hook = submit;
  submit_many_hook = submit_many;
  tensor_ext_code = code;
  Py_RETURN_NONE;
}

// register_ops([(name, qualified name, plan, kinds: bytes, results, numbers as numbers, known values,
// functional, tiny first argument), ...])
PyObject* register_ops(PyObject*, PyObject* entries) {
  if (learn_hook == nullptr || tensor_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "configure and configure_ops first");
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(entries, "register_ops takes a list");
  if (!seq) return nullptr;
  struct Pending { std::string name; std::unique_ptr<OpKernel> kernel; };
  std::vector<Pending> pending;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char *name, *kinds;
    Py_ssize_t kinds_size;
    PyObject *qualified, *plan;
    int numbers, known, results, functional;
    long long tiny = 0;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sOOy#ipppL", &name, &qualified, &plan, &kinds, &kinds_size,
                          &results, &numbers, &known, &functional, &tiny) || results < 0) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a negative number of results");
      Py_DECREF(seq);
      return nullptr;
    }
    auto kernel = std::make_unique<OpKernel>();
    Py_INCREF(plan);
    Py_INCREF(qualified);
    kernel->plan = plan;
    kernel->name = qualified;
    kernel->numbers_as_numbers = numbers != 0;
    kernel->known_values = known != 0;
    kernel->tiny_first = static_cast<int64_t>(tiny);
    kernel->functional = functional != 0;
    kernel->results = static_cast<size_t>(results);
    for (Py_ssize_t k = 0; k < kinds_size; ++k) {
      kernel->kinds.push_back(static_cast<Kind>(kinds[k]));
      if (kinds[k] == kTensorList) kernel->has_lists = true;
    }
    pending.push_back({name, std::move(kernel)});
  }
  Py_DECREF(seq);
  try {
    if (!op_library) {
      op_library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
    }
    for (Pending& entry : pending) {
      op_kernels.push_back(entry.kernel.get());
      op_library->impl(entry.name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(entry.kernel)));
    }
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// clear_op_caches(): forget every learned signature (the node's device type changed)
PyObject* clear_op_caches(PyObject*, PyObject*) {
  for (OpKernel* kernel : op_kernels) kernel->cache.clear();
  Py_RETURN_NONE;
}

// op_cache_sizes() -> {qualified name: signatures learned} (for tests and diagnostics)
PyObject* op_cache_sizes(PyObject*, PyObject*) {
  PyObject* sizes = PyDict_New();
  for (OpKernel* kernel : op_kernels) {
    PyObject* count = PyLong_FromSize_t(kernel->cache.size());
    if (!count || PyDict_SetItem(sizes, kernel->name, count) < 0) {
      Py_XDECREF(count);
      Py_DECREF(sizes);
      return nullptr;
    }
    Py_DECREF(count);
  }
  return sizes;
}

// dead_storage_ids({storage id: weak ref}) -> [ids whose storage died]: the runtime's scan for
// storages to free (client/runtime.py ``_collect_garbage``). The same test as
// ``UntypedStorage._expired(ref)`` (no strong reference left), without a Python call per
// storage: the scan runs every few hundred allocations and at each synchronize over every
// live storage, ~65 ns each in Python (74 us a sync with 1,100 live).
PyObject* dead_storage_ids(PyObject*, PyObject* live) {
  if (!PyDict_Check(live)) {
    PyErr_SetString(PyExc_TypeError, "dead_storage_ids() takes a dict");
    return nullptr;
  }
  PyObject* dead = PyList_New(0);
  if (!dead) return nullptr;
  PyObject* key;
  PyObject* ref;
  Py_ssize_t pos = 0;
  while (PyDict_Next(live, &pos, &key, &ref)) {
    auto* storage = static_cast<c10::StorageImpl*>(PyLong_AsVoidPtr(ref));
    if (!storage && PyErr_Occurred()) {
      Py_DECREF(dead);
      return nullptr;
    }
    if (c10::raw::weak_intrusive_ptr::use_count(storage) == 0 && PyList_Append(dead, key) < 0) {
      Py_DECREF(dead);
      return nullptr;
    }
  }
  return dead;
}

PyMethodDef methods[] = {
    {"install_guard", install_guard, METH_O, "Install the C++ device guard for PrivateUse1; its argument waits for the node."},
    {"register_hooks", register_hooks, METH_NOARGS, "Register the C++ PrivateUse1 hooks; False if some are."},
    {"dead_storage_ids", dead_storage_ids, METH_O, "The ids in {id: weak storage ref} whose storage died."},
    {"configure", configure, METH_VARARGS, "Give the descriptor encoder its Python objects."},
    {"encode_default", encode_default, METH_O, "msgpack default hook: gpuwire tensors natively."},
    {"encode_device_tensors", encode_device_tensors, METH_O, "(key, encoded, storage ids) of a tensor list, or None."},
    {"scalar_type", gpuwire_common::scalar_type, METH_O, "The c10::ScalarType number of a tensor's dtype."},
    {"quiet_warnings", gpuwire_common::quiet_warnings, METH_O,
     "quiet_warnings(True) ... quiet_warnings(False): this thread's c10 warnings are dropped in between."},
    {"register_views", register_views, METH_O, "Register the C++ view kernel for these aten ops at PrivateUse1."},
    {"configure_ops", configure_ops, METH_VARARGS, "Give the op kernels their Python hooks."},
    {"register_ops", register_ops, METH_O, "Register C++ op kernels in front of these ops' Python plans."},
    {"clear_op_caches", clear_op_caches, METH_NOARGS, "Forget every signature the op kernels learned."},
    {"op_cache_sizes", op_cache_sizes, METH_NOARGS, "{op: signatures learned}."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuwire_native", "gpuwire's native client helpers", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_gpuwire_native() {
  cdata_name = PyUnicode_InternFromString("_cdata");
  for (int i = 0; i < kScalarTypes; ++i) dtype_codes[i] = -1;
  return PyModule_Create(&module);
}
