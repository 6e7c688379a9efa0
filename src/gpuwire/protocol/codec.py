"""Value codec for argument trees: msgpack extension types for tensors, dtypes, devices.

Sits under ``connection``: it turns the value types of ``events`` into msgpack ExtType and
back. Clients and nodes replace the two hooks with their own (``client.wire`` encodes torch
objects directly; ``node.materialize`` decodes straight into node tensors), keeping the same
extension codes and layouts defined here, so the wire format is fixed in one place.
"""

from __future__ import annotations

import struct

import msgpack

from .events import (
    Device,
    DType,
    InlineTensor,
    Layout,
    MemoryFormat,
    NewTensor,
    SessionGenerator,
    TensorRef,
)

# dtype names in a fixed order: the index is the wire code. Never reorder; append only.
DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16",
    "uint8", "int8", "int16", "int32", "int64", "bool",
    "complex64", "complex128", "complex32",
    "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
)
DTYPE_CODES = {name: code for code, name in enumerate(DTYPE_NAMES)}
DTYPE_ITEMSIZE = (4, 8, 2, 2, 1, 1, 2, 4, 8, 1, 8, 16, 4, 2, 4, 8, 1, 1, 1, 1)
_N_DTYPES = len(DTYPE_NAMES)

MEMORY_FORMAT_NAMES = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
LAYOUT_NAMES = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")

# extension type codes
EXT_TENSOR = 1
EXT_DTYPE = 2
EXT_DEVICE = 3
EXT_MEMORY_FORMAT = 4
EXT_LAYOUT = 5
EXT_COMPLEX = 6
EXT_GENERATOR = 7
EXT_INLINE_TENSOR = 8
EXT_NEW_TENSOR = 9

# dimensions a tensor descriptor may have. PyTorch tensors can have more than 64 (its kernels
# refuse them with their own error: "only tensors with up to 64 dims are supported"), and
# refusing one here drops the whole session, so the bound is far above any real tensor.
MAX_DIMS = 1024
_U64 = 2**64
_I62 = 2**62
_COMPLEX = struct.Struct("!dd")


class DecodeError(ValueError):
    """A value inside a frame is malformed (wrong type, out of range)."""


def pack_tensor_ref(storage_id: int, offset: int, sizes, strides, dtype_code: int, flags: int = 0) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb((storage_id, offset, sizes, strides, dtype_code, flags)))


def unpack_tensor_ref_fields(data: bytes) -> tuple:
    """Validated fields of a tensor descriptor: (storage_id, offset, sizes, strides, dtype, flags)."""
    try:
        fields = msgpack.unpackb(data, use_list=False, max_array_len=MAX_DIMS)
        storage_id, offset, sizes, strides, dtype, flags = fields
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise DecodeError(f"malformed tensor descriptor: {exc}") from None
    # every node op decodes a few of these: the common, valid case is checked inline; anything
    # else takes the checks below, which say what is wrong
    if (type(storage_id) is int and 0 <= storage_id < _U64 and type(offset) is int and 0 <= offset <= _I62
            and type(dtype) is int and 0 <= dtype < _N_DTYPES and type(flags) is int and 0 <= flags <= 3
            and type(sizes) is tuple and type(strides) is tuple and len(sizes) == len(strides)):
        for s in sizes:
            if type(s) is not int or not 0 <= s <= _I62:
                break
        else:
            for s in strides:
                if type(s) is not int or not -_I62 <= s <= _I62:
                    break
            else:
                return fields
    _check_int(storage_id, "storage id", 0, 2**64 - 1)
    _check_int(offset, "storage offset", 0, 2**62)
    _check_dims(sizes, strides)
    _check_int(dtype, "dtype code", 0, len(DTYPE_NAMES) - 1)
    _check_int(flags, "flags", 0, 3)
    return storage_id, offset, sizes, strides, dtype, flags


def _check_int(value, what: str, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise DecodeError(f"{what} must be an integer in [{low}, {high}], got {value!r}")


def dense_layout(sizes, strides) -> bool:
    """Whether ``strides`` lay ``sizes`` out without gaps or overlaps (a permuted contiguous
    layout, as a memory format is): what a storage of exactly ``numel`` elements can hold."""
    expected = 1
    for size, stride in sorted(zip(sizes, strides), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_dims(sizes, strides) -> None:
    if type(sizes) is not tuple or type(strides) is not tuple or len(sizes) != len(strides):
        raise DecodeError("tensor sizes and strides must be lists of equal length")
    for s in sizes:
        _check_int(s, "tensor size", 0, 2**62)
    for s in strides:
        _check_int(s, "tensor stride", -(2**62), 2**62)


def check_dtype_code(code) -> int:
    _check_int(code, "dtype code", 0, len(DTYPE_NAMES) - 1)
    return code


def pack_complex(value: complex) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_COMPLEX, _COMPLEX.pack(value.real, value.imag))


def unpack_complex(data: bytes) -> complex:
    if len(data) != _COMPLEX.size:
        raise DecodeError("malformed complex number")
    real, imag = _COMPLEX.unpack(data)
    return complex(real, imag)


def unpack_small(data: bytes, what: str):
    try:
        return msgpack.unpackb(data, use_list=False, max_array_len=MAX_DIMS, max_str_len=64, max_bin_len=1 << 16)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise DecodeError(f"malformed {what}: {exc}") from None


# ---------------------------------------------------------------- neutral hooks (tests, tools)


def default(obj):
    """msgpack ``default`` hook for the neutral value types of ``events``."""
    if isinstance(obj, TensorRef):
        return pack_tensor_ref(obj.storage_id, obj.offset, tuple(obj.sizes), tuple(obj.strides), obj.dtype, obj.flags)
    if isinstance(obj, DType):
        return msgpack.ExtType(EXT_DTYPE, bytes([obj.code]))
    if isinstance(obj, Device):
        return msgpack.ExtType(EXT_DEVICE, msgpack.packb((obj.type, obj.index)))
    if isinstance(obj, MemoryFormat):
        return msgpack.ExtType(EXT_MEMORY_FORMAT, bytes([obj.code]))
    if isinstance(obj, Layout):
        return msgpack.ExtType(EXT_LAYOUT, bytes([obj.code]))
    if isinstance(obj, complex):
        return pack_complex(obj)
    if isinstance(obj, SessionGenerator):
        return msgpack.ExtType(EXT_GENERATOR, b"")
    if isinstance(obj, InlineTensor):
        return msgpack.ExtType(EXT_INLINE_TENSOR, msgpack.packb((obj.dtype, tuple(obj.sizes), obj.data)))
    if isinstance(obj, NewTensor):
        return msgpack.ExtType(EXT_NEW_TENSOR, msgpack.packb(
            (obj.storage_id, obj.nbytes, obj.offset, tuple(obj.sizes), tuple(obj.strides), obj.dtype)))
    raise TypeError(f"cannot encode a value of type {type(obj).__name__} in a gpuwire frame")


def ext_hook(code: int, data: bytes):
    """msgpack ``ext_hook`` producing the neutral value types of ``events``."""
    if code == EXT_TENSOR:
        return TensorRef(*unpack_tensor_ref_fields(data))
    if code == EXT_DTYPE:
        if len(data) != 1:
            raise DecodeError("malformed dtype")
        return DType(check_dtype_code(data[0]))
    if code == EXT_DEVICE:
        return Device(*unpack_device_fields(data))
    if code == EXT_MEMORY_FORMAT:
        if len(data) != 1 or data[0] >= len(MEMORY_FORMAT_NAMES):
            raise DecodeError("malformed memory format")
        return MemoryFormat(data[0])
    if code == EXT_LAYOUT:
        if len(data) != 1 or data[0] >= len(LAYOUT_NAMES):
            raise DecodeError("malformed layout")
        return Layout(data[0])
    if code == EXT_COMPLEX:
        return unpack_complex(data)
    if code == EXT_GENERATOR:
        return SessionGenerator()
    if code == EXT_INLINE_TENSOR:
        dtype, sizes, payload = unpack_inline_tensor_fields(data)
        return InlineTensor(dtype, sizes, payload)
    if code == EXT_NEW_TENSOR:
        value = unpack_small(data, "new tensor")
        if not (isinstance(value, tuple) and len(value) == 6):
            raise DecodeError("malformed new tensor")
        storage_id, nbytes, offset, sizes, strides, dtype = value
        _check_int(storage_id, "storage id", 0, 2**64 - 1)
        _check_int(nbytes, "storage size", 0, 2**62)
        _check_int(offset, "storage offset", 0, 2**62)
        _check_dims(sizes, strides)
        check_dtype_code(dtype)
        return NewTensor(*value)
    raise DecodeError(f"unknown extension type {code}")


def unpack_device_fields(data: bytes) -> tuple:
    """(type, index) of a device value; index is None or a small non-negative integer."""
    value = unpack_small(data, "device")
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)):
        raise DecodeError("malformed device")
    if value[1] is not None:
        _check_int(value[1], "device index", 0, 1 << 16)
    return value


def unpack_inline_tensor_fields(data: bytes) -> tuple:
    value = unpack_small(data, "inline tensor")
    if not (isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], bytes)):
        raise DecodeError("malformed inline tensor")
    dtype, sizes, payload = value
    check_dtype_code(dtype)
    _check_dims(sizes, sizes)
    numel = 1
    for s in sizes:
        numel *= s
    if numel * DTYPE_ITEMSIZE[dtype] != len(payload):
        raise DecodeError("inline tensor bytes do not match its sizes and dtype")
    return dtype, sizes, payload
