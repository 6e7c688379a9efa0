"""Unit tests for the value codec (gpuwire.protocol.codec): msgpack extension types for
tensors, dtypes, devices …, used directly and through a Connection."""

from __future__ import annotations

import math
import struct

import msgpack
import pytest

from gpuwire.protocol import (
    DTYPE_CODES,
    DTYPE_ITEMSIZE,
    DTYPE_NAMES,
    Connection,
    DecodeError,
    ProtocolError,
    Role,
)
from gpuwire.protocol import codec
from gpuwire.protocol.events import (
    CallSync,
    Device,
    DType,
    Hello,
    InlineTensor,
    Layout,
    MemoryFormat,
    NewTensor,
    Op,
    Result,
    SessionGenerator,
    TensorRef,
    Welcome,
)


def pack(value) -> bytes:
    return msgpack.packb(value, default=codec.default, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, ext_hook=codec.ext_hook, strict_map_key=True)


def roundtrip(value):
    return unpack(pack(value))


def open_pair():
    client = Connection(Role.CLIENT)
    server = Connection(Role.SERVER)
    server.receive_data(client.send(Hello()))
    server.next_event()
    client.receive_data(server.send(Welcome()))
    client.next_event()
    return client, server


def via_connection(value):
    """Send ``value`` as the only Op argument and as a Result value; return both decodings."""
    client, server = open_pair()
    server.receive_data(client.send(Op(seq=1, name="aten::x", args=[value], kwargs={"v": value})))
    op = server.next_event()
    assert op.args[0] == op.kwargs["v"]
    client.receive_data(server.send(Result(seq=1, value=value)))
    result = client.next_event()
    return op.args[0], result.value


# ---------------------------------------------------------------- dtype tables


def test_dtype_tables_consistent():
    assert len(DTYPE_NAMES) == len(DTYPE_ITEMSIZE)
    assert len(set(DTYPE_NAMES)) == len(DTYPE_NAMES)
    for code, name in enumerate(DTYPE_NAMES):
        assert DTYPE_CODES[name] == code
    assert all(size in (1, 2, 4, 8, 16) for size in DTYPE_ITEMSIZE)


def test_dtype_wire_codes_are_stable():
    # the index is the wire code: these must never change
    expected = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "uint8": 4, "int8": 5,
                "int16": 6, "int32": 7, "int64": 8, "bool": 9, "complex64": 10, "complex128": 11,
                "complex32": 12, "uint16": 13, "uint32": 14, "uint64": 15, "float8_e4m3fn": 16,
                "float8_e5m2": 17, "float8_e4m3fnuz": 18, "float8_e5m2fnuz": 19}
    for name, code in expected.items():
        assert DTYPE_CODES[name] == code


def test_dtype_itemsizes_match_torch():
    torch = pytest.importorskip("torch")
    checked = 0
    for name, size in zip(DTYPE_NAMES, DTYPE_ITEMSIZE):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert dtype.itemsize == size, name
            checked += 1
    assert checked >= 10


def test_protocol_package_does_not_import_torch():
    import ast
    import pathlib

    package = pathlib.Path(codec.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "torch" or n.startswith("torch.") for n in names), path.name


# ---------------------------------------------------------------- round trips of each value type


VALUES = [
    pytest.param(TensorRef(1, 0, (2, 3), (3, 1), 0), id="tensor-ref"),
    pytest.param(TensorRef(2**64 - 1, 2**62, (2**62,), (-(2**62),), 19, 3), id="tensor-ref-extremes"),
    pytest.param(TensorRef(5, 3, (), (), 9, 1), id="tensor-ref-0dim"),
    pytest.param(TensorRef(5, 0, (4, 0, 2), (0, 2, -1), 11, 2), id="tensor-ref-odd-strides"),
    pytest.param(TensorRef(5, 0, (1,) * codec.MAX_DIMS, (1,) * codec.MAX_DIMS, 8), id="tensor-ref-max-dims"),
    pytest.param(InlineTensor(0, (), struct.pack("<f", 2.5)), id="inline-0dim"),
    pytest.param(InlineTensor(8, (2, 2), struct.pack("<4q", 1, 2, 3, 4)), id="inline-int64"),
    pytest.param(InlineTensor(9, (3,), b"\x01\x00\x01"), id="inline-bool"),
    pytest.param(InlineTensor(11, (1,), b"\x00" * 16), id="inline-complex128"),
    pytest.param(InlineTensor(0, (0, 5), b""), id="inline-empty"),
    pytest.param(NewTensor(10, 96, 0, (4, 6), (6, 1), 0), id="new-tensor"),
    pytest.param(NewTensor(10, 0, 0, (0,), (1,), 8), id="new-tensor-empty"),
    pytest.param(SessionGenerator(), id="generator"),
    pytest.param(Device("cuda", 0), id="device-cuda0"),
    pytest.param(Device("cuda", 7), id="device-cuda7"),
    pytest.param(Device("cpu"), id="device-cpu"),
    pytest.param(Device("meta", None), id="device-meta"),
    pytest.param(complex(1.5, -2.25), id="complex"),
    pytest.param(complex(0, 0), id="complex-zero"),
    pytest.param(complex(-0.0, 1e-300), id="complex-tiny"),
    pytest.param(complex(math.inf, -math.inf), id="complex-inf"),
] + [pytest.param(DType(code), id=f"dtype-{name}") for code, name in enumerate(DTYPE_NAMES)] \
  + [pytest.param(MemoryFormat(code), id=f"memory-format-{name}") for code, name in enumerate(codec.MEMORY_FORMAT_NAMES)] \
  + [pytest.param(Layout(code), id=f"layout-{name}") for code, name in enumerate(codec.LAYOUT_NAMES)]


@pytest.mark.parametrize("value", VALUES)
def test_value_round_trip_codec(value):
    got = roundtrip(value)
    assert type(got) is type(value)
    assert got == value


@pytest.mark.parametrize("value", VALUES)
def test_value_round_trip_connection(value):
    as_arg, as_result = via_connection(value)
    assert type(as_arg) is type(value) and as_arg == value
    assert type(as_result) is type(value) and as_result == value


def test_complex_nan_round_trip():
    got = roundtrip(complex(math.nan, 1.0))
    assert isinstance(got, complex)
    assert math.isnan(got.real) and got.imag == 1.0


def test_complex_exact_bits():
    value = complex(0.1, 1 / 3)
    got = roundtrip(value)
    assert struct.pack("!dd", got.real, got.imag) == struct.pack("!dd", value.real, value.imag)


def test_tensor_ref_fields_are_tuples():
    got = roundtrip(TensorRef(1, 0, [2, 3], [3, 1], 0))  # lists in, tuples out
    assert got.sizes == (2, 3) and got.strides == (3, 1)
    assert type(got.sizes) is tuple and type(got.strides) is tuple


def test_new_tensor_fields_are_tuples():
    got = roundtrip(NewTensor(1, 24, 0, [2, 3], [3, 1], 0))
    assert got == NewTensor(1, 24, 0, (2, 3), (3, 1), 0)


def test_inline_tensor_data_is_bytes():
    got = roundtrip(InlineTensor(4, (3,), b"abc"))
    assert type(got.data) is bytes and got.data == b"abc"
    assert got.sizes == (3,)


def test_values_hashable_after_decode():
    values = [roundtrip(v) for v in (TensorRef(1, 0, (2,), (1,), 0), DType(3), Device("cuda", 0),
                                     MemoryFormat(1), Layout(0), SessionGenerator(),
                                     NewTensor(1, 8, 0, (2,), (1,), 0), InlineTensor(0, (1,), b"\0" * 4))]
    assert len(set(values)) == len(values)


def test_nested_in_lists_and_dicts():
    ref = TensorRef(3, 1, (4,), (1,), 0)
    value = {
        "tensors": [ref, [ref, {"deep": [DType(1), Device("cuda", 1)]}]],
        "opts": {"layout": Layout(0), "memory_format": MemoryFormat(2), "gen": SessionGenerator()},
        "scalars": [1, -1, 2.5, complex(3, 4), True, None, "s", b"b"],
        "inline": InlineTensor(2, (2,), b"\x00\x3c\x00\x3c"),
        "new": [NewTensor(9, 8, 0, (2,), (1,), 7)],
        "empty": {"list": [], "dict": {}},
    }
    assert roundtrip(value) == value
    as_arg, as_result = via_connection(value)
    assert as_arg == value
    assert as_result == value


def test_tuples_decode_as_lists_outside_descriptors():
    assert roundtrip((1, (2, 3))) == [1, [2, 3]]


def test_default_rejects_unknown_types():
    with pytest.raises(TypeError):
        pack(object())
    with pytest.raises(TypeError):
        pack({"x": {1, 2}})


def test_send_of_unencodable_argument_raises_type_error():
    client, _ = open_pair()
    with pytest.raises(TypeError):
        client.send(Op(seq=1, name="aten::x", args=[object()]))


def test_extension_codes_are_stable():
    assert unpack_ext_code(TensorRef(1, 0, (), (), 0)) == 1
    assert unpack_ext_code(DType(0)) == 2
    assert unpack_ext_code(Device("cuda", 0)) == 3
    assert unpack_ext_code(MemoryFormat(0)) == 4
    assert unpack_ext_code(Layout(0)) == 5
    assert unpack_ext_code(complex(1, 2)) == 6
    assert unpack_ext_code(SessionGenerator()) == 7
    assert unpack_ext_code(InlineTensor(0, (), b"\0" * 4)) == 8
    assert unpack_ext_code(NewTensor(1, 4, 0, (), (), 0)) == 9


def unpack_ext_code(value) -> int:
    ext = msgpack.unpackb(pack(value))
    assert isinstance(ext, msgpack.ExtType)
    return ext.code


def test_custom_hooks_are_used_by_connection():
    seen = []

    class Marker:
        pass

    def default(obj):
        if isinstance(obj, Marker):
            return msgpack.ExtType(2, b"\x05")  # same wire form as DType(5)
        return codec.default(obj)

    def ext_hook(code, data):
        seen.append(code)
        return codec.ext_hook(code, data)

    client = Connection(Role.CLIENT, default=default)
    server = Connection(Role.SERVER, ext_hook=ext_hook)
    server.receive_data(client.send(Hello()))
    server.next_event()
    client.receive_data(server.send(Welcome()))
    client.next_event()
    server.receive_data(client.send(CallSync(seq=1, name="aten::x", args=[Marker()])))
    assert server.next_event().args == [DType(5)]
    assert seen == [2]


# ---------------------------------------------------------------- validation of descriptors


def tensor_ext(fields) -> bytes:
    return msgpack.packb(fields)


@pytest.mark.parametrize("fields", [
    pytest.param((1, 0, (2,), (1,), 0), id="five-fields"),
    pytest.param((1, 0, (2,), (1,), 0, 0, 0), id="seven-fields"),
    pytest.param((1, 0, (-1,), (1,), 0, 0), id="negative-size"),
    pytest.param((1, 0, (2**62 + 1,), (1,), 0, 0), id="huge-size"),
    pytest.param((1, 0, (2,), (2**62 + 1,), 0, 0), id="huge-stride"),
    pytest.param((1, 0, (2,), (-(2**62) - 1,), 0, 0), id="huge-negative-stride"),
    pytest.param((1, 0, (2, 3), (1,), 0, 0), id="length-mismatch"),
    pytest.param((1, 0, (2,), (1, 1), 0, 0), id="length-mismatch-2"),
    pytest.param((1, 0, (2,), (1,), len(DTYPE_NAMES), 0), id="dtype-out-of-range"),
    pytest.param((1, 0, (2,), (1,), -1, 0), id="dtype-negative"),
    pytest.param((1, 0, (2,), (1,), 0.0, 0), id="dtype-float"),
    pytest.param((-1, 0, (2,), (1,), 0, 0), id="negative-storage-id"),
    pytest.param((1, -1, (2,), (1,), 0, 0), id="negative-offset"),
    pytest.param((1, 2**62 + 1, (2,), (1,), 0, 0), id="huge-offset"),
    pytest.param((1, 0, (2,), (1,), 0, 4), id="flags-4"),
    pytest.param((1, 0, (2,), (1,), 0, -1), id="flags-negative"),
    pytest.param((1, 0, (2.0,), (1,), 0, 0), id="float-size"),
    pytest.param((1, 0, (None,), (1,), 0, 0), id="nil-size"),
    pytest.param((1, 0, (True,), (1,), 0, 0), id="bool-size"),
    pytest.param((1, 0, (2,), ("1",), 0, 0), id="str-stride"),
    pytest.param((1, 0, {"a": 1}, (1,), 0, 0), id="map-sizes"),
    pytest.param((1, 0, 2, 1, 0, 0), id="scalar-sizes"),
    pytest.param((True, 0, (2,), (1,), 0, 0), id="bool-storage"),
    pytest.param((1, 0, (1,) * (codec.MAX_DIMS + 1), (1,) * (codec.MAX_DIMS + 1), 0, 0), id="too-many-dims"),
    pytest.param(None, id="nil"),
    pytest.param("abcdef", id="str"),
    pytest.param({"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}, id="map-with-six-keys"),
])
def test_malformed_tensor_descriptor(fields):
    with pytest.raises(DecodeError):
        codec.ext_hook(codec.EXT_TENSOR, tensor_ext(fields))
    with pytest.raises(DecodeError):
        codec.unpack_tensor_ref_fields(tensor_ext(fields))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x96", b"\x96\x01", tensor_ext((1, 0, (2,), (1,), 0, 0)) + b"\x00",
                                  b"\x91" * 3000 + b"\xc0"],
                         ids=["empty", "invalid", "truncated", "truncated-2", "trailing", "deep"])
def test_garbage_tensor_descriptor(data):
    with pytest.raises(DecodeError):
        codec.ext_hook(codec.EXT_TENSOR, data)


def test_unpack_tensor_ref_fields_valid():
    data = tensor_ext((4, 2, (3, 4), (4, 1), 8, 1))
    assert codec.unpack_tensor_ref_fields(data) == (4, 2, (3, 4), (4, 1), 8, 1)


def test_decode_error_is_value_error():
    assert issubclass(DecodeError, ValueError)


@pytest.mark.parametrize("code,data", [
    pytest.param(codec.EXT_DTYPE, b"", id="dtype-empty"),
    pytest.param(codec.EXT_DTYPE, b"\x00\x00", id="dtype-2-bytes"),
    pytest.param(codec.EXT_DTYPE, bytes([len(DTYPE_NAMES)]), id="dtype-out-of-range"),
    pytest.param(codec.EXT_DTYPE, b"\xff", id="dtype-255"),
    pytest.param(codec.EXT_MEMORY_FORMAT, bytes([len(codec.MEMORY_FORMAT_NAMES)]), id="memory-format-range"),
    pytest.param(codec.EXT_MEMORY_FORMAT, b"", id="memory-format-empty"),
    pytest.param(codec.EXT_MEMORY_FORMAT, b"\x00\x00", id="memory-format-2-bytes"),
    pytest.param(codec.EXT_LAYOUT, bytes([len(codec.LAYOUT_NAMES)]), id="layout-range"),
    pytest.param(codec.EXT_LAYOUT, b"", id="layout-empty"),
    pytest.param(codec.EXT_COMPLEX, b"", id="complex-empty"),
    pytest.param(codec.EXT_COMPLEX, b"\x00" * 8, id="complex-8-bytes"),
    pytest.param(codec.EXT_COMPLEX, b"\x00" * 24, id="complex-24-bytes"),
    pytest.param(codec.EXT_DEVICE, b"", id="device-empty"),
    pytest.param(codec.EXT_DEVICE, msgpack.packb("cuda"), id="device-str"),
    pytest.param(codec.EXT_DEVICE, msgpack.packb(("cuda", 0, 1)), id="device-3-fields"),
    pytest.param(codec.EXT_DEVICE, msgpack.packb((0, 0)), id="device-int-type"),
    pytest.param(codec.EXT_DEVICE, msgpack.packb(("x" * 65, 0)), id="device-long-name"),
    pytest.param(codec.EXT_NEW_TENSOR, msgpack.packb((1, 2, 3, (4,), (1,))), id="new-tensor-5-fields"),
    pytest.param(codec.EXT_NEW_TENSOR, msgpack.packb(None), id="new-tensor-nil"),
    pytest.param(codec.EXT_NEW_TENSOR, b"\xc1", id="new-tensor-garbage"),
    pytest.param(0, b"", id="ext-0"),
    pytest.param(10, b"", id="ext-10"),
    pytest.param(127, b"abc", id="ext-127"),
    pytest.param(-5, b"", id="ext-negative"),
])
def test_malformed_value_extension(code, data):
    with pytest.raises(DecodeError):
        codec.ext_hook(code, data)


@pytest.mark.parametrize("fields", [
    pytest.param((0, (2,), b"\x00" * 7), id="too-few-bytes"),
    pytest.param((0, (2,), b"\x00" * 9), id="too-many-bytes"),
    pytest.param((1, (), b"\x00" * 4), id="float64-0dim-4-bytes"),
    pytest.param((11, (2,), b"\x00" * 16), id="complex128-2-elems-16-bytes"),
    pytest.param((0, (0,), b"\x00"), id="empty-with-bytes"),
    pytest.param((0, (3,), b""), id="bytes-missing"),
    pytest.param((0, (2**40, 2**40), b""), id="huge-sizes"),
    pytest.param((len(DTYPE_NAMES), (1,), b"\x00"), id="dtype-out-of-range"),
    pytest.param((-1, (1,), b"\x00"), id="dtype-negative"),
    pytest.param((0, (-1,), b""), id="negative-size"),
    pytest.param((0, (1.0,), b"\x00" * 4), id="float-size"),
    pytest.param((0, [1], "abcd"), id="str-data"),
    pytest.param((0, 1, b"\x00" * 4), id="scalar-sizes"),
    pytest.param((0, (1,)), id="two-fields"),
    pytest.param((0, (1,), b"\x00" * 4, 0), id="four-fields"),
    pytest.param((0, (1,) * (codec.MAX_DIMS + 1), b"\x00" * 4), id="too-many-dims"),
])
def test_malformed_inline_tensor(fields):
    data = msgpack.packb(fields, use_bin_type=True)
    with pytest.raises(DecodeError):
        codec.ext_hook(codec.EXT_INLINE_TENSOR, data)


@pytest.mark.parametrize("dtype", range(len(DTYPE_NAMES)), ids=DTYPE_NAMES)
def test_inline_tensor_byte_count_per_dtype(dtype):
    size = DTYPE_ITEMSIZE[dtype]
    good = InlineTensor(dtype, (2, 3), b"\x00" * (6 * size))
    assert roundtrip(good) == good
    for wrong in (6 * size - 1, 6 * size + 1, size):
        data = msgpack.packb((dtype, (2, 3), b"\x00" * wrong), use_bin_type=True)
        with pytest.raises(DecodeError, match="do not match"):
            codec.ext_hook(codec.EXT_INLINE_TENSOR, data)


def test_inline_tensor_mismatch_in_frame_is_protocol_error():
    client, server = open_pair()
    bad = msgpack.ExtType(codec.EXT_INLINE_TENSOR, msgpack.packb((0, (2,), b"\x00" * 5), use_bin_type=True))

    def default(obj):
        return bad

    sender = Connection(Role.CLIENT, default=default)
    sender.send(Hello())
    sender.receive_data(Connection(Role.SERVER).send(Welcome()))
    sender.next_event()
    server.receive_data(sender.send(Op(seq=1, name="aten::x", args=[object()])))
    with pytest.raises(ProtocolError, match="bad value"):
        server.next_event()
