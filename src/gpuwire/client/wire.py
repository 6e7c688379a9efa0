"""Client-side value encoding: torch objects straight to the protocol's msgpack extensions.

Sits between the device layer and ``protocol.codec``: msgpack calls ``encode_default`` only
for values it cannot pack natively (tensors, dtypes, devices …), so argument trees of ints,
floats and lists are packed in C with no Python walk.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings

import msgpack
import torch

from ..protocol import codec

DTYPE_CODE: dict[torch.dtype, int] = {}
CODE_DTYPE: dict[int, torch.dtype] = {}
for _code, _name in enumerate(codec.DTYPE_NAMES):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_CODE[_dt] = _code
        CODE_DTYPE[_code] = _dt

_DTYPE_EXT = {dt: msgpack.ExtType(codec.EXT_DTYPE, bytes([code])) for dt, code in DTYPE_CODE.items()}
_MEMORY_FORMAT_EXT = {
    getattr(torch, name): msgpack.ExtType(codec.EXT_MEMORY_FORMAT, bytes([code]))
    for code, name in enumerate(codec.MEMORY_FORMAT_NAMES)
}
_LAYOUT_EXT = {
    getattr(torch, name): msgpack.ExtType(codec.EXT_LAYOUT, bytes([code]))
    for code, name in enumerate(codec.LAYOUT_NAMES) if hasattr(torch, name)
}
# gpuwire generators are CPU generator objects whose (never used) seed is a tag naming the
# generator on the node: the dispatcher hands the fallback a fresh Python wrapper, so the tag
# is the only thing that survives. tag -> remote generator id
generator_ids: dict[int, int] = {}
_pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
# ExtType without its Python-level argument checks (our codes and bytes are always valid)
_ext = functools.partial(tuple.__new__, msgpack.ExtType)
MAX_INLINE_BYTES = 1 << 20
_PRIVATE_USE1 = torch._C.DispatchKey.PrivateUse1
_dispatch_keys = torch._C._dispatch_keys


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is a gpuwire tensor, read from its dispatch keys: unlike ``t.device``,
    no TorchFunctionMode or CUDA-compatibility property can disguise them."""
    return _dispatch_keys(t).has(_PRIVATE_USE1)


DEVICE_TYPE = "gpuwire"


def called_by_pytorch(frames_up: int = 2, within: tuple = ("torch",)) -> bool:
    """Whether the function ``frames_up`` frames above this call's caller is in one of the
    packages ``within`` (PyTorch's own code, by default) or gpuwire's: answers under CUDA
    compatibility that tell the program what it asked for ("cuda", "nccl") must give those
    callers the real configuration, on which their code paths depend."""
    caller = sys._getframe(frames_up).f_globals.get("__name__", "")
    return any(caller == package or caller.startswith(package + ".") for package in (*within, "gpuwire"))


class UnsupportedArgument(TypeError):
    pass


class HostTensorArgument(UnsupportedArgument):
    """A host tensor with dimensions among an op's arguments. CUDA refuses one in all but a few
    ops (indices, lengths, copies); the caller decides (``Runtime.encode_op``) and, where CUDA
    takes it, encodes again under ``host_tensors_by_value``."""


_by_value = threading.local()


@contextlib.contextmanager
def host_tensors_by_value():
    """Encode host tensors with dimensions by value in this thread (``inline_ext``)."""
    before = getattr(_by_value, "on", False)
    _by_value.on = True
    try:
        yield
    finally:
        _by_value.on = before


def tensor_ext(t: torch.Tensor) -> msgpack.ExtType:
    """The wire descriptor of a gpuwire tensor: its storage id (the storage's virtual
    address), element offset, sizes, strides, dtype and conj/neg bits."""
    offset = t.storage_offset()
    flags = 0
    if t.is_conj():
        flags |= 1
    if t.is_neg():
        flags |= 2
    pointer = t.data_ptr()
    # an empty tensor reports a null data pointer; its storage still has its address
    storage_id = pointer - offset * t.element_size() if pointer else t.untyped_storage().data_ptr()
    return _ext((codec.EXT_TENSOR, _pack((storage_id, offset, t.shape, t.stride(), DTYPE_CODE[t.dtype], flags))))


# dtypes whose 0-dim tensors ``inline_ext`` packs through numpy directly
# the complex dtype whose parts are a real dtype (``torch.complex``, a complex Python number's tensor)
COMPLEX_OF = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}
_NUMPY_SCALAR_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool,
                                  torch.int16, torch.int8, torch.uint8, torch.complex64, torch.complex128))


def inline_ext(t: torch.Tensor) -> msgpack.ExtType:
    """A host tensor passed by value (e.g. a 0-dim CPU scalar tensor in ``x + torch.tensor(2.)``)."""
    if (not t.shape and t.dtype in _NUMPY_SCALAR_DTYPES and not t.requires_grad and not t.is_conj()
            and not t.is_neg()):
        # the hot case: the wrapped number C++ passes for ``x.add_(1)`` or ``x * 0.5`` (1.4 us, not 5.7)
        return _ext((codec.EXT_INLINE_TENSOR, _pack((DTYPE_CODE[t.dtype], (), t.numpy().tobytes()))))
    c = t.detach().resolve_conj().resolve_neg().contiguous()
    nbytes = c.numel() * c.element_size()
    if nbytes > MAX_INLINE_BYTES:
        raise UnsupportedArgument(
            f"a CPU tensor of {nbytes} bytes was passed to an op on the gpuwire device; move it to the "
            "device first (tensor.to('gpuwire'))")
    data = bytes(c.view(-1).view(torch.uint8).numpy()) if nbytes else b""
    return msgpack.ExtType(codec.EXT_INLINE_TENSOR, _pack((DTYPE_CODE[c.dtype], c.shape, data)))


# raw dispatch key set bits: one ``raw_repr()`` answers "on our device?", is_conj() and is_neg()
_RAW_PRIVATE_USE1 = torch._C.DispatchKeySet(_PRIVATE_USE1).raw_repr()
_RAW_CONJ = torch._C.DispatchKeySet(torch._C.DispatchKey.Conjugate).raw_repr()
_RAW_NEG = torch._C.DispatchKeySet(torch._C.DispatchKey.Negative).raw_repr()
_EXT_TENSOR = codec.EXT_TENSOR


def _described(t: torch.Tensor, raw: int) -> tuple:
    """(storage id, key, wire descriptor) of a gpuwire tensor whose raw dispatch keys are ``raw``:
    the key holds its dtype, sizes, strides and conj/neg bits (what decides an op's output
    metadata), the descriptor packs (storage id, offset, sizes, strides, dtype code, bits)."""
    offset = t.storage_offset()
    pointer = t.data_ptr()
    if not pointer:  # an empty tensor reports a null data pointer; its storage has its address
        pointer = t.untyped_storage().data_ptr()
    elif offset:
        pointer -= offset * t.element_size()
    # tuple(shape): msgpack packs a plain tuple faster than torch.Size
    shape, strides, dtype = tuple(t.shape), t.stride(), t.dtype
    bits = (raw & _RAW_CONJ == _RAW_CONJ) | ((raw & _RAW_NEG == _RAW_NEG) << 1)
    return (pointer, (dtype, shape, strides, bits),
            _ext((_EXT_TENSOR, _pack((pointer, offset, shape, strides, DTYPE_CODE[dtype], bits)))))


def encode_device_tensors(items):
    """One pass over a list of gpuwire tensors (a ``_foreach_`` op's ``Tensor[]``: an
    optimizer's parameters, gradients and states): ``(key, encoded, storage_ids)``, each
    tensor's key and wire descriptor (the bytes ``encode_default`` makes, so the node's view
    cache sees the same keys) and its storage. None when an item is anything else (a host
    tensor, another device's, a number): the caller then takes the general path, which raises
    or encodes it as usual.

    Why: the general path reads every tensor's metadata twice (the signature, then msgpack's
    ``default`` hook once per tensor); an AdamW step over 148 parameters passes ~2,000 tensors
    in lists. (``client/native.py`` replaces this with the same in C++.)"""
    key, encoded, storage_ids = [], [], []
    for t in items:
        if not isinstance(t, torch.Tensor) or t.is_cpu:
            return None
        raw = _dispatch_keys(t).raw_repr()
        if raw & _RAW_PRIVATE_USE1 != _RAW_PRIVATE_USE1:
            return None
        storage_id, item_key, descriptor = _described(t, raw)
        key.append(item_key)
        encoded.append(descriptor)
        storage_ids.append(storage_id)
    return tuple(key), encoded, storage_ids


python_encode_device_tensors = encode_device_tensors
_native_default = None


def use_native(native) -> None:
    """Take gpuwire tensors' descriptors from the native module (``client/native.py``), which
    packs the same bytes as the Python functions here; anything else it hands back to them."""
    global encode_device_tensors, _native_default
    table = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("ComplexHalf support is experimental")
        for dtype, code in DTYPE_CODE.items():
            try:
                table[native.scalar_type(torch.empty(0, dtype=dtype))] = (code, dtype)
            except (RuntimeError, TypeError):
                continue  # (a dtype this torch cannot make: never on the wire either)
    native.configure(torch.Tensor, msgpack.ExtType, _EXT_TENSOR, encode_default, table)
    _native_default = native.encode_default
    encode_device_tensors = native.encode_device_tensors


def packer_default():
    """The msgpack ``default`` hook a new connection uses: the native one once installed."""
    return _native_default or encode_default


def encode_default(obj):
    """msgpack ``default`` hook for the client."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cpu:
            if obj.dim() and not getattr(_by_value, "on", False):
                raise HostTensorArgument(f"a host tensor of shape {list(obj.shape)} among the arguments")
            return inline_ext(obj)
        raw = _dispatch_keys(obj).raw_repr()
        if raw & _RAW_PRIVATE_USE1 == _RAW_PRIVATE_USE1:  # (natively in client/native.cpp where built)
            return _described(obj, raw)[2]
        raise UnsupportedArgument(f"a tensor on device {obj.device} cannot be used in an op on the gpuwire device")
    ext = _DTYPE_EXT.get(obj) if isinstance(obj, torch.dtype) else None
    if ext is not None:
        return ext
    if isinstance(obj, torch.device):
        return msgpack.ExtType(codec.EXT_DEVICE, _pack((obj.type, obj.index)))
    if isinstance(obj, torch.memory_format):
        return _MEMORY_FORMAT_EXT[obj]
    if isinstance(obj, torch.layout):
        return _LAYOUT_EXT[obj]
    if isinstance(obj, complex):
        return codec.pack_complex(obj)
    if isinstance(obj, torch._C.Generator):
        remote_id = generator_ids.get(torch._C.Generator.initial_seed(obj))
        if remote_id is None:
            raise RuntimeError(f"Expected a '{DEVICE_TYPE}' device type for generator but found "
                               f"'{obj.device.type}'; create it with torch.Generator(device='{DEVICE_TYPE}')")
        return msgpack.ExtType(codec.EXT_GENERATOR, _pack(remote_id))
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise UnsupportedArgument("symbolic sizes cannot be sent to a gpuwire node")
    raise UnsupportedArgument(f"cannot send a value of type {type(obj).__name__} to a gpuwire node")


# aten ops whose CUDA kernels take host tensors with dimensions: indices (converted on the
# device), copies between devices, packed-sequence bookkeeping and CTC lengths (read on the host)
HOST_TENSOR_OPS = frozenset({
    "aten::index.Tensor", "aten::_unsafe_index.Tensor", "aten::index_put_", "aten::index_put",
    "aten::_index_put_impl_", "aten::_unsafe_index_put", "aten::copy_", "aten::_copy_from",
    "aten::_copy_from_and_resize", "aten::_to_copy", "aten::to.device", "aten::to.dtype_layout", "aten::to.other",
    "aten::_pack_padded_sequence", "aten::_pack_padded_sequence_backward", "aten::_pad_packed_sequence",
    "aten::_ctc_loss.Tensor", "aten::_ctc_loss_backward.Tensor", "aten::ctc_loss.Tensor",
    "aten::_nested_from_padded",
    # only the other tensor's metadata is read
    "aten::is_same_size", "aten::is_set_to", "aten::expand_as", "aten::view_as", "aten::reshape_as",
    # the out= forms the client runs structured ops as
    "aten::index.Tensor_out", "aten::index_put.out", "aten::_index_put_impl.out",
    "aten::copy.out", "aten::_copy_from.out", "aten::_copy_from_and_resize.out",
    "aten::_to_copy.out", "aten::_pack_padded_sequence.out", "aten::_ctc_loss.Tensor_out",
})
# arguments CUDA reads on the host whatever the op (``lstm.data``'s batch_sizes, CTC lengths,
# ``_foreach_addcmul.Tensor``'s scalars: "Expected scalars to be on CPU")
HOST_TENSOR_ARGUMENTS = frozenset({"batch_sizes", "lengths", "input_lengths", "target_lengths", "scalars"})


def shown_device() -> str:
    """The device as the program knows it, for messages: ``cuda:0`` under CUDA compatibility."""
    from . import cuda_compat
    return "cuda:0" if cuda_compat.enabled() else f"{DEVICE_TYPE}:0"


def refuse_host_tensors(name: str, args, kwargs) -> None:
    """Raise as CUDA does when op ``name`` is given a host tensor with dimensions where CUDA's
    kernel refuses one; return when CUDA takes it (``HOST_TENSOR_OPS``/``_ARGUMENTS``, gpuwire's
    own ops). Sending it by value instead would work for small tensors only (up to
    ``MAX_INLINE_BYTES``), so a program would pass its tests and fail on real data, or pass here
    and fail on a real GPU; and it would pay the upload on every call."""
    if not name.startswith("aten::") or name in HOST_TENSOR_OPS:
        return
    base, _, overload = name[len("aten::"):].partition(".")
    try:
        schema = getattr(getattr(torch.ops.aten, base), overload or "default")._schema
    except AttributeError:
        return  # (not an op of this torch: the node decides)
    for index, argument in enumerate(schema.arguments):
        if argument.name in HOST_TENSOR_ARGUMENTS:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or index >= len(args) else args[index]
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.is_cpu and t.dim():
                device = shown_device()
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but got {argument.name} is on cpu, different "
                    f"from other tensors on {device} (when checking argument in method {name}); move it to the "
                    f"device first (.to('{device.split(':')[0]}'))")
