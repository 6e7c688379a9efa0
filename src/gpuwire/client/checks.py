"""Argument checks that PyTorch's meta kernels skip but its CPU and CUDA kernels make.

Sits in the client beside ``device.py``'s op plans, which infer an op's results from its meta
kernel and queue it without waiting for the node. Where a meta kernel accepts a call the real
kernel refuses, the node raised the error at the next sync point, charged to a later line (a
``try`` around the call never saw it; PyTorch's own ``test_errors`` expects it at the call).
Each check here raises the real kernel's error, word for word, at the call; nothing crosses
the wire. ``MISSED_BY_META`` maps an op's name to its check, which the op's plan runs on every
call (the checks read argument values, not only layouts). Found by running every OpInfo's
``error_inputs`` on the device without a sync (docs/opinfo.md).
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings

import torch

from .._aten import check_lu_unpack_pivots
from . import wire

# c10's ``ScalarType`` names (``toString``), as C++ error messages print a dtype
SCALAR_TYPE_NAMES = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
    torch.float16: "Half", torch.float32: "Float", torch.float64: "Double", torch.bool: "Bool",
    torch.bfloat16: "BFloat16", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}
# ``caffe2::TypeMeta`` names, as structured kernels print an out tensor's dtype
TYPE_META_NAMES = {
    torch.uint8: "unsigned char", torch.int8: "signed char", torch.int16: "short int", torch.int32: "int",
    torch.int64: "long int", torch.float16: "c10::Half", torch.float32: "float", torch.float64: "double",
    torch.bool: "bool", torch.bfloat16: "c10::BFloat16", torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}
# the C++ type names of ``Scalar::to<T>``'s overflow error
_CONVERTED_NAMES = {torch.float16: "at::Half", torch.bfloat16: "at::BFloat16", torch.float32: "float",
                    torch.float64: "double", torch.uint8: "uint8_t", torch.int8: "int8_t", torch.int16: "int16_t", torch.int32: "int",
                    torch.int64: "int64_t"}
INTERNAL_OVERLAP_MESSAGE = ("unsupported operation: more than one element of the written-to tensor refers to a "
                            "single memory location. Please clone() the tensor before performing the operation.")
OVERLAP_MESSAGE = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                   "single memory location. Please clone() the tensor before performing the operation.")


def _arg(args, kwargs, index: int, name: str, default=None):
    return args[index] if index < len(args) else kwargs.get(name, default)


def _cpp_double(value: float) -> str:
    """A double as C++'s ``operator<<`` prints it (six significant digits)."""
    return f"{value:g}"


def nonnegative_sizes(sizes) -> None:
    """``empty``'s check (ATen ``check_size_nonnegative``)."""
    for size in sizes:
        if size < 0:
            raise RuntimeError(f"Trying to create tensor with negative dimension {size}: {list(sizes)}")


def broadcast_into(out_shape: torch.Size, src_shape: torch.Size) -> None:
    """``copy_``'s shape check (TensorIterator's broadcast of ``src`` onto the written tensor):
    copies reach the gpuwire device through ``_copy_from``, before any shape is compared, and a
    mismatch raised at the next sync point ("output with shape ... doesn't match")."""
    broadcast = torch._C._infer_size(out_shape, src_shape)  # (ATen's own error where they cannot broadcast)
    if broadcast != out_shape:
        raise RuntimeError(f"output with shape {list(out_shape)} doesn't match the broadcast shape {list(broadcast)}")


_REAL_OF_COMPLEX = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}


def _uniform(args, kwargs) -> None:
    """``uniform_``'s checks (ATen ``uniform_impl_``, on the host): both ends within the dtype
    (a complex tensor's real one), ``from <= to``, and ``to - from`` within the dtype."""
    self = args[0]
    low, high = _arg(args, kwargs, 1, "from", 0.0), _arg(args, kwargs, 2, "to", 1.0)
    dtype = _REAL_OF_COMPLEX.get(self.dtype, self.dtype)
    if not dtype.is_floating_point:
        return  # (the kernel takes no such dtype: the node's dispatch says so)
    info = torch.finfo(dtype)
    for value, what in ((low, "from"), (high, "to")):
        if not float(info.min) <= value <= float(info.max):
            raise RuntimeError(f"{what} is out of bounds for {TYPE_META_NAMES[dtype]}")
    if low > high:
        raise RuntimeError(f"uniform_ expects to return a [from, to) range, but found from={_cpp_double(low)} > "
                           f"to={_cpp_double(high)}")
    if float(high) - float(low) > float(info.max):
        raise RuntimeError(f"uniform_ expects to-from <= std::numeric_limits<{SCALAR_TYPE_NAMES[dtype]}>::max(), but "
                           f"found to={_cpp_double(high)} and from={_cpp_double(low)} which result in to-from to "
                           "exceed the limit")


def _normal_std(std) -> None:
    """``normal``'s check of its standard deviation (ATen ``CHECK_NORMAL_STD`` /
    ``CHECK_NORMAL_TENSOR_STD``). A tensor's is checked by its smallest element, read back as
    CUDA reads it (one round trip, as CUDA's kernel syncs for it)."""
    if isinstance(std, torch.Tensor):
        if std.is_complex():
            raise RuntimeError("normal expects standard deviation to be non-complex")
        if std.numel() and not bool(std.min().ge(0)):
            raise RuntimeError("normal expects all elements of std >= 0.0")
    elif isinstance(std, (int, float)) and not std >= 0.0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {_cpp_double(std)}")


def _normal_second(args, kwargs) -> None:  # (normal_(self, mean, std), normal.Tensor_float(mean, std) ...)
    _normal_std(_arg(args, kwargs, 1, "std", 1.0))


def _normal_in_place(args, kwargs) -> None:
    _normal_std(_arg(args, kwargs, 2, "std", 1.0))


def _degrees_of_freedom(fname: str):
    """``std``/``var``/``var_mean``/``std_mean``'s warning (ATen ``warn_invalid_degrees_of_freedom``,
    raised on the host): the correction is not below the number of elements reduced into each
    result element. The node's kernel says it too, in its own log; a program sees it here."""
    def check(args, kwargs) -> None:
        self = args[0]
        if not isinstance(self, torch.Tensor):
            return
        dim, correction = _arg(args, kwargs, 1, "dim"), kwargs.get("correction")
        correction = 1 if correction is None else correction
        try:
            reduced = (set(range(self.dim())) if not dim else
                       {d % max(self.dim(), 1) for d in ((dim,) if isinstance(dim, int) else dim)})
        except TypeError:
            return
        out_numel = math.prod(size for d, size in enumerate(self.shape) if d not in reduced)
        factor = 0 if out_numel == 0 else self.numel() // out_numel
        if factor - correction <= 0:
            for _ in range(2 if self.is_complex() else 1):  # (a complex input's real and imaginary parts)
                warnings.warn(f"{fname}(): degrees of freedom is <= 0. Correction should be strictly less than the "
                              "reduction factor (input numel divided by output numel).", UserWarning,
                              stacklevel=caller_stacklevel())
    return check


def _reduction_dims(args, kwargs) -> None:
    """A reduction's dims checked as ATen's ``make_dim_mask`` checks them (the ``nansum`` meta
    kernel does not): at most 64 dims, none listed twice."""
    self, dim = args[0], _arg(args, kwargs, 1, "dim")
    if not isinstance(self, torch.Tensor):
        return
    if self.dim() > 64:
        raise RuntimeError("only tensors with up to 64 dims are supported")
    if isinstance(dim, (list, tuple)) and len(dim) > 1:
        seen = set()
        for d in dim:
            if isinstance(d, int) and -max(self.dim(), 1) <= d < max(self.dim(), 1):
                wrapped = d % max(self.dim(), 1)
                if wrapped in seen:
                    raise RuntimeError(f"dim {wrapped} appears multiple times in the list of dims")
                seen.add(wrapped)


def _nonempty_reduction_dim(label: str, dim_index: int):
    """ATen's ``zero_numel_check_dims`` for a selection along one dim (``median``, ``kthvalue``,
    ``mode``): an empty dim has nothing to select, refused on the host before the kernel (the
    meta kernels size the result instead, so the refusal came at the next sync point)."""
    def check(args, kwargs) -> None:
        self, dim = args[0], _arg(args, kwargs, dim_index, "dim", -1)
        if not isinstance(self, torch.Tensor) or self.dim() == 0 or not isinstance(dim, int):
            return
        if -self.dim() <= dim < self.dim() and self.shape[dim] == 0:
            raise IndexError(f"{label}(): Expected reduction dim {dim % self.dim()} to have non-zero size.")
    return check


def _bytebool_out(name: str):
    """``all``/``any``'s out= dtype (ATen ``check_result_is_bytebool``; their meta kernels skip it)."""
    def check(args, kwargs) -> None:
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor) and out.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"{name} only supports bool tensor for result, got: "
                               f"{SCALAR_TYPE_NAMES.get(out.dtype, out.dtype)}")
    return check


def _mode_out(args, kwargs) -> None:
    """``mode``'s out= dtypes (checked on the host by ATen's ``mode_out``)."""
    self, values, indices = args[0], kwargs.get("values"), kwargs.get("indices")
    if isinstance(values, torch.Tensor) and values.dtype != self.dtype:
        raise RuntimeError(f"expected scalar type '{SCALAR_TYPE_NAMES[self.dtype]}' but got "
                           f"'{SCALAR_TYPE_NAMES.get(values.dtype, values.dtype)}' for values output")
    if isinstance(indices, torch.Tensor) and indices.dtype != torch.int64:
        raise RuntimeError(f"expected scalar type 'Long' but got '{SCALAR_TYPE_NAMES.get(indices.dtype, indices.dtype)}' "
                           "for indices output")


def _randperm_out(args, kwargs) -> None:
    """``randperm``'s checks of ``n`` against its out tensor (ATen ``randperm_out_cpu`` and
    ``check_supported_max_int_with_precision``), made on the host before the kernel."""
    n, out = args[0], kwargs.get("out")
    if isinstance(n, int) and isinstance(out, torch.Tensor):
        if n < 0:
            raise RuntimeError(f"n must be non-negative, got{n}")
        _randperm_n(n, out.dtype)


def _randperm(args, kwargs) -> None:
    """``torch.randperm(n, dtype=...)``: ``empty``'s size check, then ``_randperm_out``'s."""
    n = args[0]
    if isinstance(n, int):
        nonnegative_sizes((n,))
        _randperm_n(n, kwargs.get("dtype") or torch.int64)


# the largest n whose permutation a floating dtype holds exactly (bits of mantissa, as ATen says it)
_RANDPERM_PRECISION = {torch.float16: (11, "2049", "Half"), torch.float32: (24, "2^24+1", "Float"),
                       torch.float64: (53, "2^53+1", "Double")}


def _randperm_n(n: int, dtype) -> None:
    if not dtype.is_floating_point:  # (``scalar_tensor(n - 1)`` of a floating type does not check)
        _fits_dtype(n - 1 if n > 0 else n, dtype)
    if dtype in _RANDPERM_PRECISION:
        bits, said, name = _RANDPERM_PRECISION[dtype]
        if n > (1 << bits) + 1:
            raise RuntimeError(f"n cannot be greater than {said} for {name} type.")


def _fits_dtype(value, dtype) -> None:
    """c10's ``checked_convert`` of a number to ``dtype`` (a ``Scalar`` made into a tensor of it)."""
    name = _CONVERTED_NAMES.get(dtype)
    if name is not None and not isinstance(value, bool) and _overflows(value, dtype):
        raise RuntimeError(f"value cannot be converted to type {name} without overflow")


# the integral dtypes ``random_`` checks its bounds for (ATen names them by ``TYPE_META_NAMES``)
_RANDOM_BOUNDED_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _random_range(self: torch.Tensor, low: int, high: int | None) -> None:
    """``random_(from, to)``'s checks, which ATen makes on the host before its kernel (meta
    kernels do not): ``from < to``; for integral tensors both ends within the dtype; for floating
    ones the ends rounded to the dtype (``_random_float_range``)."""
    if high is not None and low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    if self.dtype in _RANDOM_FLOAT_DIGITS:
        _random_float_range(self.dtype, low, high)
        return
    if self.dtype not in _RANDOM_BOUNDED_DTYPES or (high is None and low == -2**63):
        return  # (the full 64-bit range: the kernel decides)
    name = TYPE_META_NAMES[self.dtype]
    info = (0, 1) if self.dtype is torch.bool else (torch.iinfo(self.dtype).min, torch.iinfo(self.dtype).max)
    if not info[0] <= low <= info[1]:
        raise RuntimeError(f"from is out of bounds for {name}")
    if high is not None and not info[0] <= high - 1 <= info[1]:
        raise RuntimeError(f"to - 1 is out of bounds for {name}")


def caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside gpuwire's client and torch's op wrappers: a
    warning ATen raises is attributed to the program's line, and Python's default filter shows
    it once per such line."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (frame.f_code.co_filename.startswith(_CLIENT_DIR)
                                 or frame.f_code.co_filename.endswith(_TORCH_OP_WRAPPERS)):
        frame, level = frame.f_back, level + 1
    return level


# warnings this client says itself at the op's line (the checks here, ``device._warn_resized``):
# the node's kernel saying them again is not passed on
_SAID_BY_THE_CLIENT = re.compile(
    r"An output with one or more elements was resized|The number of elements in the out tensor"
    r"|torch\.searchsorted\(\): [a-z ]+ tensor is non-contiguous|(std|var|var_mean|std_mean)\(\): degrees of freedom"
    r"|(from|to - 1) is out of bounds \[-\(2\^|Use of (index_put_|index_fill_|masked_fill_) on expanded tensors")


def say_node_warnings(said: list) -> None:
    """Warn the program of what the node's kernels said (``[category, text]`` pairs of a
    "warnings" Notice), at the first line of the program up the stack: a streamed op's warning
    comes with the reply the program waits for, at its next sync point."""
    level = caller_stacklevel()
    for category, text in said:
        if isinstance(text, str) and not _SAID_BY_THE_CLIENT.match(text):
            warnings.warn(text, DeprecationWarning if category == "DeprecationWarning" else UserWarning,
                          stacklevel=level)


_CLIENT_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_OP_WRAPPERS = (os.path.join("torch", "_ops.py"),)
_RANDOM_FLOAT_DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def _wrap64(value: int) -> int:
    """``value`` as int64 arithmetic leaves it (two's complement wrap-around)."""
    return (value + 2**63) % 2**64 - 2**63


def _through_dtype(value: int, dtype: torch.dtype) -> int:
    """``static_cast<int64_t>(static_cast<scalar_t>(value))``, by torch's own CPU conversions
    (the same C++ casts: round to nearest, through float for half types; out of range or
    infinite gives int64's minimum on x86)."""
    return int(torch.tensor([value], dtype=torch.int64).to(dtype).to(torch.int64)[0])


def _rounded_end(value: int, dtype: torch.dtype, step: int) -> int:
    """ATen's ``update_from`` (``step`` 1) / ``update_to`` (-1): an end the dtype cannot hold
    moved to the next representable integer inside the range."""
    neighbour = _wrap64(value + step)
    cast = _through_dtype(neighbour, dtype)
    if (cast < value) if step == 1 else (cast >= value):
        magnitude = _wrap64(abs(neighbour))
        if magnitude < 0:  # (ATen's bit count of ``abs(INT64_MIN)`` never ends: it hangs there)
            raise RuntimeError(f"random_: {'from' if step == 1 else 'to'}={value} cannot be rounded to "
                               f"{TYPE_META_NAMES[dtype]}")
        bits = magnitude.bit_length() - 1
        shift = 1 << (bits - _RANDOM_FLOAT_DIGITS[dtype] + 1)
        value = _wrap64(cast + shift if step == 1 else cast - shift)
    return value


def _random_float_range(dtype: torch.dtype, low: int, high: int | None) -> None:
    """``random_from_to_impl`` for a floating tensor: the ends rounded to the dtype, then checked
    (``from`` below ``to``, within the dtype's range) and warned of beyond 2^digits, as ATen says."""
    digits = _RANDOM_FLOAT_DIGITS[dtype]
    if high is not None:
        low, high = _rounded_end(low, dtype, 1), _rounded_end(high, dtype, -1)
        if not low < high:
            raise RuntimeError(f"random_ expects 'from' casted to dtype to be less than 'to' casted to dtype, but got "
                               f"from={low} >= to={high}")
        top = high - 1
    elif low != _INT64_MIN:
        top = min(1 << digits, _INT64_MAX)
        low = _rounded_end(low, dtype, 1)
        if not low < top:
            raise RuntimeError(f"random_ expects 'from' casted to dtype to be less than or equal to 'to_inc' casted "
                               f"to dtype, but got from={low} > to_inc={top}")
    else:
        return  # (the full 64-bit range: the kernel decides)
    name = TYPE_META_NAMES[dtype]
    info = torch.finfo(dtype)
    for value, what in ((low, "from"), (top, "to - 1")):
        if not float(info.min) <= float(value) <= float(info.max):
            raise RuntimeError(f"{what} is out of bounds for {name}")
    for value, what in ((low, "from"), (top, "to - 1")):
        if value < -(1 << digits) or value > (1 << digits):
            warnings.warn(f"{what} is out of bounds [-(2^{digits}), 2^{digits}]. Due to precision limitations {name} "
                          "can support discrete uniform distribution only within this range. This warning will "
                          "become an error in version 1.7 release, please fix the code in advance",
                          UserWarning, stacklevel=caller_stacklevel())


def _random_from(args, kwargs) -> None:
    _random_range(args[0], _arg(args, kwargs, 1, "from"), _arg(args, kwargs, 2, "to"))


def _random_to(args, kwargs) -> None:
    _random_range(args[0], 0, _arg(args, kwargs, 1, "to"))


def _masked_fill(args, kwargs) -> None:
    self, value = args[0], _arg(args, kwargs, 2, "value")
    name = _CONVERTED_NAMES.get(self.dtype)
    if name is None or isinstance(value, bool):
        return
    if isinstance(value, complex):
        if value.imag != 0:  # (to a real type: ``Scalar::to`` refuses a nonzero imaginary part)
            raise RuntimeError(f"value cannot be converted to type {name} without overflow")
        value = value.real
    if isinstance(value, (int, float)):
        _fits_dtype(value, self.dtype)


def _overflows(value, dtype) -> bool:
    """c10's ``overflows<To>(value)``: beyond a floating type's finite range (inf and nan convert),
    beyond an integral type's; an unsigned type takes negative numbers down to ``-max`` (they wrap)."""
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        return math.isfinite(value) and (float(value) > info.max or float(value) < info.min)
    if not math.isfinite(value):
        return True
    info = torch.iinfo(dtype)
    low = -info.max if info.min == 0 else info.min
    return value > info.max or value < low


def _masked_scatter(args, kwargs) -> None:
    mask = _arg(args, kwargs, 1, "mask")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        raise RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with dtype "
                           f"{SCALAR_TYPE_NAMES.get(mask.dtype, mask.dtype)}")
    self = args[0]
    if isinstance(mask, torch.Tensor) and not _expandable(tuple(mask.shape), tuple(self.shape)):
        mask.expand(self.shape)  # (ATen's ``expand_inplace``: raises its error, as a local run does)


def _complex_out(args, kwargs) -> None:
    real, imag, out = _arg(args, kwargs, 0, "real"), _arg(args, kwargs, 1, "imag"), kwargs.get("out")
    if not all(isinstance(t, torch.Tensor) for t in (real, imag)):
        return
    if real.dtype != imag.dtype:
        raise RuntimeError(f"Expected object of scalar type {SCALAR_TYPE_NAMES.get(real.dtype, real.dtype)} but got "
                           f"scalar type {SCALAR_TYPE_NAMES.get(imag.dtype, imag.dtype)} for second argument")
    expected = wire.COMPLEX_OF.get(real.dtype)
    if isinstance(out, torch.Tensor) and expected is not None and out.dtype != expected:
        raise RuntimeError(f"Expected object of scalar type {SCALAR_TYPE_NAMES.get(expected, expected)} but got "
                           f"scalar type {SCALAR_TYPE_NAMES.get(out.dtype, out.dtype)} for argument 'out'")


def _aminmax_out(args, kwargs) -> None:
    self = args[0]
    for name in ("min", "max"):
        out = kwargs.get(name)
        if isinstance(out, torch.Tensor) and out.dtype != self.dtype:
            raise RuntimeError(f"Expected out tensor to have dtype {TYPE_META_NAMES.get(self.dtype, self.dtype)}, "
                               f"but got {TYPE_META_NAMES.get(out.dtype, out.dtype)} instead")


def _frexp_out(args, kwargs) -> None:
    """``frexp``'s out= dtypes (ATen ``frexp_out``, on the host; the meta kernel takes any
    floating exponent)."""
    self, mantissa, exponent = args[0], kwargs.get("mantissa"), kwargs.get("exponent")
    if not isinstance(self, torch.Tensor) or not self.is_floating_point():
        return  # (the meta kernel refuses it in ATen's words)
    if isinstance(mantissa, torch.Tensor) and mantissa.dtype != self.dtype:
        raise RuntimeError(f"torch.frexp() expects mantissa to have dtype {TYPE_META_NAMES[self.dtype]} but got "
                           f"{TYPE_META_NAMES.get(mantissa.dtype, mantissa.dtype)}")
    if isinstance(exponent, torch.Tensor) and exponent.dtype != torch.int32:
        raise RuntimeError("torch.frexp() expects exponent to have int dtype but got "
                           f"{TYPE_META_NAMES.get(exponent.dtype, exponent.dtype)}")


def _vector_norm_identity(args, kwargs) -> None:
    """``linalg.vector_norm``'s refusal of an order without an identity (negative, or inf) over an
    empty reduction, which ATen checks before its kernel (the meta kernel does not)."""
    self, order = args[0], _arg(args, kwargs, 1, "ord")
    order = 2 if order is None else order
    if not isinstance(self, torch.Tensor) or isinstance(order, complex) or self.numel() \
            or not (order < 0 or order == math.inf):
        return
    text = f"{order:g}" if isinstance(order, float) else str(order)
    dims = _arg(args, kwargs, 2, "dim")
    dims = [dims] if isinstance(dims, int) else list(dims or ())
    if not dims:
        raise RuntimeError(f"linalg.vector_norm cannot compute the {text} norm on an empty tensor because the "
                           "operation does not have an identity")
    for dim in dims:
        wrapped = dim + self.dim() if dim < 0 else dim
        if 0 <= wrapped < self.dim() and self.shape[wrapped] == 0:  # (ATen says the dim as given)
            raise RuntimeError(f"linalg.vector_norm cannot compute the {text} norm on the dimension {dim}because "
                               "this dimension is empty and the operation does not have an identity")


def _cross_out(args, kwargs) -> None:
    """``linalg_cross``'s out may not share memory with an input (ATen ``assert_no_overlap``, on the
    host before the kernel; the meta kernel does not check it)."""
    out = kwargs.get("out")
    if not isinstance(out, torch.Tensor):
        return
    for operand in (_arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "other")):
        if isinstance(operand, torch.Tensor) and overlap(out, operand):
            raise RuntimeError(OVERLAP_MESSAGE)


def _lu_unpack(args, kwargs) -> None:
    check_lu_unpack_pivots(_arg(args, kwargs, 0, "LU_data"), _arg(args, kwargs, 1, "LU_pivots"))


def _lstsq_driver(args, kwargs) -> None:
    """``linalg.lstsq``'s driver, as CUDA's kernel checks it on the host: only ``gels`` (a CPU
    node's LAPACK has more, which a program written for a GPU cannot rely on; the device acts
    as one GPU whatever its node's backend)."""
    driver = kwargs.get("driver")
    if driver is not None and driver != "gels":
        raise RuntimeError("torch.linalg.lstsq: `driver` other than `gels` is not supported on CUDA")


def _sub_of_bool(args, kwargs) -> None:
    """``sub``'s refusal of a bool operand (ATen ``sub_check``; the Python meta kernel that
    shape inference runs takes ``mask - 1`` and ``1 - mask``)."""
    self, other = args[0], _arg(args, kwargs, 1, "other")
    bools = [isinstance(operand, bool) or (isinstance(operand, torch.Tensor) and operand.dtype is torch.bool)
             for operand in (self, other)]
    if all(bools):
        raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. Use the `^` or "
                           "`logical_xor()` operator instead.")
    if any(bools):
        raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. If you are trying to "
                           "invert a mask, use the `~` or `logical_not()` operator instead.")


def _ctc_log_probs(args, kwargs) -> None:
    """``ctc_loss``'s refusal of empty ``log_probs`` (ATen's, on the host before its kernel; the
    meta kernel sizes the result without it, so the refusal came at the next sync point)."""
    if isinstance(args[0], torch.Tensor) and args[0].numel() == 0:
        raise RuntimeError("log_probs tensor must not be empty")


def _histc(args, kwargs) -> None:
    """``histc``'s range check (ATen's, on the host): with ``min == max`` (the default) the range
    is the data's, read back as both CPU and CUDA read it (one round trip); a range that is not
    finite is refused at the call rather than at the next sync point."""
    self = args[0]
    if not (isinstance(self, torch.Tensor) and self.is_floating_point()):
        return  # (integer histograms are counted by the node's CUDA-like kernel)
    low, high = _arg(args, kwargs, 2, "min", 0), _arg(args, kwargs, 3, "max", 0)
    if low == high and self.numel():
        low, high = torch.stack(torch.aminmax(self.detach())).tolist()
    if low == high:
        low, high = low - 1, high + 1
    if not all(math.isfinite(end) for end in (low, high)):
        raise RuntimeError(f"torch.histc: range of [{_cpp_double(low)}, {_cpp_double(high)}] is not finite")


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """ATen's ``get_overlap_status`` is Full or Partial: the same storage and intersecting byte
    ranges, judged only for dense tensors (else "too hard", and ATen lets it pass)."""
    if a is b:
        return True
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False  # (first: the usual answer, and the cheapest)
    if not a.numel() or not b.numel() or not _dense(a) or not _dense(b):
        return False
    a_start, b_start = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def _dense(t: torch.Tensor) -> bool:
    """ATen's ``is_non_overlapping_and_dense``: the elements fill a block of memory in some
    order of the dims (a transpose, channels-last ...); ATen judges any other layout "too hard"
    and lets it pass."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def internal_overlap(t: torch.Tensor) -> bool:
    """ATen's ``has_internal_overlap`` is YES: a stride of 0 over more than one element (of a
    tensor with elements: an empty one is dense to ATen, whatever its strides; ``(2, 2, 0)`` with
    a stride of 0, an empty batch of matrices, was refused)."""
    strides = t.stride()
    return 0 in strides and any(stride == 0 and size > 1 for size, stride in zip(t.shape, strides)) and t.numel() > 0


def _no_overlap(inputs: tuple, outputs: tuple, partial_only: tuple = ()):
    """``assert_no_overlap`` of each written tensor (by keyword) with each input (by position
    and name; a list's every tensor); ``partial_only`` inputs may be the very tensor written."""
    def check(args, kwargs) -> None:
        ins = []
        for index, name in inputs:
            value = _arg(args, kwargs, index, name)
            ins.extend((t, name in partial_only) for t in (value if isinstance(value, (list, tuple)) else (value,)))
        for name in outputs:
            out = kwargs.get(name)
            if not isinstance(out, torch.Tensor):
                continue
            for t, partial in ins:
                if isinstance(t, torch.Tensor) and overlap(out, t) and not (partial and same_memory(out, t)):
                    raise RuntimeError(OVERLAP_MESSAGE)
    return check


def _written_in_place(name: str, expanded_warns: bool = False, disjoint: tuple = (), partial_only: tuple = ()):
    """An in-place op's overlap checks (ATen's, on the host, at the call; the meta kernels of
    these ops make none): ``self`` must not repeat elements (``assert_no_internal_overlap``; for
    ops that only warn of an expanded ``self``, the deprecation warning), ``disjoint`` arguments
    (position, name) must not overlap it at all, ``partial_only`` ones may be the very tensor."""
    expanded = (f"Use of {name} on expanded tensors is deprecated. Please clone() the tensor before performing "
                "this operation. This also applies to advanced indexing e.g. tensor[" +
                ("indices] = tensor" if name == "index_put_" else "mask] = scalar"))

    def check(args, kwargs) -> None:
        self = args[0]
        if not isinstance(self, torch.Tensor):
            return
        if internal_overlap(self):
            if not expanded_warns:
                raise RuntimeError(INTERNAL_OVERLAP_MESSAGE)
            warnings.warn(expanded, UserWarning, stacklevel=caller_stacklevel())
        for slots, partial in ((disjoint, False), (partial_only, True)):
            for index, arg_name in slots:
                value = _arg(args, kwargs, index, arg_name)
                for t in (value if isinstance(value, (list, tuple)) else (value,)):
                    if isinstance(t, torch.Tensor) and overlap(self, t) and not (partial and same_memory(self, t)):
                        raise RuntimeError(OVERLAP_MESSAGE)
    return check


def _checks(*checks):
    """Several checks of one op, in order."""
    def check(args, kwargs) -> None:
        for each in checks:
            each(args, kwargs)
    return check


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """ATen's Full overlap: the same bytes, element for element (a transpose of the same block
    overlaps it partially)."""
    return a is b or (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                      and a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size()
                      and a.numel() * a.element_size() == b.numel() * b.element_size()
                      and (a.stride() == b.stride() or a.numel() <= 1))


def _heaviside(args, kwargs) -> None:
    """``heaviside``'s dtype check (ATen's, on the host; its meta kernel promotes instead)."""
    self, values = args[0], _arg(args, kwargs, 1, "values")
    if not isinstance(self, torch.Tensor) or not isinstance(values, torch.Tensor):
        return
    if self.is_complex() or values.is_complex():
        raise RuntimeError("heaviside is not yet implemented for complex tensors.")
    if self.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")


def _gelu(args, kwargs) -> None:
    approximate = kwargs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise RuntimeError("approximate argument must be either none or tanh.")


def _multinomial(args, kwargs) -> None:
    """``multinomial_out``'s checks of layouts and sizes (those of the probabilities' values
    stay with the kernel: a CUDA GPU raises them asynchronously too)."""
    self, n_sample = args[0], _arg(args, kwargs, 1, "num_samples")
    replacement, out = _arg(args, kwargs, 2, "replacement", False), kwargs.get("out")
    if not 0 < self.dim() <= 2:
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not self.dtype.is_floating_point:
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: "
                           f"{SCALAR_TYPE_NAMES.get(self.dtype, self.dtype)}")
    if isinstance(out, torch.Tensor) and out.dtype != torch.int64:
        raise RuntimeError(f"multinomial expects Long tensor out, got: {SCALAR_TYPE_NAMES.get(out.dtype, out.dtype)}")
    if n_sample <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and n_sample > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if self.shape[-1] > 2 ** 24:
        raise RuntimeError("number of categories cannot exceed 2^24")


def _bucketize(args, kwargs) -> None:
    boundaries = _arg(args, kwargs, 1, "boundaries")
    if isinstance(boundaries, torch.Tensor) and boundaries.dim() != 1:
        raise RuntimeError(f"boundaries tensor must be 1 dimension, but got dim({boundaries.dim()})")
    _noncontiguous_search(args[0], boundaries)


def _searchsorted(args, kwargs) -> None:
    _noncontiguous_search(_arg(args, kwargs, 1, "self"), args[0], kwargs.get("sorter"))


_WARNED_ONCE: set = set()


def warn_once(message: str) -> None:
    """ATen's ``TORCH_WARN_ONCE`` said by the client: once per message in this program, or every
    time under ``torch.set_warn_always``, at the program's line."""
    if message in _WARNED_ONCE and not torch.is_warn_always_enabled():
        return
    _WARNED_ONCE.add(message)
    warnings.warn(message, UserWarning, stacklevel=caller_stacklevel())


def _noncontiguous_search(values, boundaries, sorter=None) -> None:
    """``searchsorted``/``bucketize``'s warnings of a non-contiguous operand (ATen
    ``searchsorted_maybe_trim_input_tensors``, a ``TORCH_WARN_ONCE`` each, or every time under
    ``torch.set_warn_always``): the node's kernel says them in its own log, a program sees them here."""
    for what, operand in (("input value", values), ("boundary", boundaries), ("sorter", sorter)):
        if not isinstance(operand, torch.Tensor) or operand.is_contiguous():
            continue
        message = (f"torch.searchsorted(): {what} tensor is non-contiguous, this will lower the performance due to "
                   f"extra data copy when converting non-contiguous tensor to contiguous, please use contiguous {what} "
                   "tensor if possible. This message will only appear once per program.")
        warn_once(message)


_INDEX_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)
_MASK_INDEX_DTYPES = (torch.bool, torch.uint8)  # (an index of these selects by value: ``expandTensors``)


def _index_put(args, kwargs) -> None:
    """``index_put_``'s shape checks (``x[i] = v``; ATen ``_index_put_impl_``, ``make_info``,
    ``expandTensors``, ``make_index_put_iterator``), which its meta kernel skips: they need the
    shapes only, and CPU and CUDA make them on the host at the call. A mask's number of selected
    elements is data: that dimension matches any size here (CUDA reads it with a sync; the node
    finds a mismatch there at the next sync point), except where the value cannot fit whatever
    the count is; then the masks are counted (an error path only), to raise ATen's own error."""
    self, indices, values = args[0], _arg(args, kwargs, 1, "indices"), _arg(args, kwargs, 2, "values")
    if not isinstance(self, torch.Tensor) or not isinstance(values, torch.Tensor) or indices is None:
        return
    try:  # (shapes and dtypes decide: a signature that passed passes again; 5.6 -> 0.9 us a call)
        signature = (self.shape, values.shape, tuple(None if i is None else (i.dtype, i.shape) for i in indices))
    except AttributeError:
        signature = None  # (not tensors: ATen's own error, from the meta kernel)
    if signature is not None and signature in _INDEX_PUT_PASSED:
        return
    _index_put_shapes(self, indices, values)
    if signature is not None:
        if len(_INDEX_PUT_PASSED) >= 4096:
            _INDEX_PUT_PASSED.clear()
        _INDEX_PUT_PASSED.add(signature)


_INDEX_PUT_PASSED: set = set()


def _index_put_shapes(self, indices, values) -> None:
    shape = tuple(self.shape)
    if len(indices) > len(shape):
        raise IndexError(f"too many indices for tensor of dimension {len(shape)} (got {len(indices)})")
    result = _index_put_result(shape, indices, None)
    if result is None or _expandable(tuple(values.shape), result):
        return
    counts = [int(i.count_nonzero()) if i is not None and i.dtype in _MASK_INDEX_DTYPES else None for i in indices]
    if any(count is not None for count in counts):
        result = _index_put_result(shape, indices, counts)
    raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to "
                       f"indexing result of shape {list(result)}")


def _index_put_result(shape: tuple, indices, counts) -> tuple | None:
    """The shape ``self[indices]`` has (ATen's ``restride_src``), with None for a mask's count
    where ``counts`` does not give it; None where ATen raises an error of its own for them."""
    expanded = []  # one entry a dimension of ``self``: None (a slice) or the index's shape
    for k, index in enumerate(indices):
        if index is None:
            expanded.append(None)
        elif index.dtype not in _INDEX_DTYPES:
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        elif index.dtype in _MASK_INDEX_DTYPES:  # a mask: one index a dimension it covers
            for j, size in enumerate(index.shape):
                dim = len(expanded) + j
                if dim >= len(shape):
                    return None
                if size != shape[dim]:
                    raise IndexError(f"The shape of the mask {list(index.shape)} at index {j} does not match "
                                     f"the shape of the indexed tensor {list(shape)} at index {dim}")
            expanded.extend([(counts[k] if counts else None,)] * index.dim())
        else:
            expanded.append(tuple(index.shape))
    if len(expanded) > len(shape):
        return None
    expanded += [None] * (len(shape) - len(expanded))
    where = [i for i, e in enumerate(expanded) if e is not None]
    if not where:
        return shape
    broadcast = _broadcast_indices([expanded[i] for i in where])
    if where == list(range(where[0], where[-1] + 1)):  # adjacent: the result dims take their place
        return shape[:where[0]] + broadcast + shape[where[-1] + 1:]
    return broadcast + tuple(shape[i] for i, e in enumerate(expanded) if e is None)  # (NumPy's rule)


def _broadcast_indices(shapes) -> tuple:
    """The index tensors' broadcast shape (a mask's count, None, matches any size)."""
    ndim = max(len(s) for s in shapes)
    out = []
    for dim in range(ndim):
        sizes = [s[dim - ndim + len(s)] for s in shapes if dim >= ndim - len(s)]
        known = {size for size in sizes if size is not None and size != 1}
        if len(known) > 1:
            raise IndexError("shape mismatch: indexing tensors could not be broadcast together with shapes "
                             + ", ".join(str(list(s)) for s in shapes))
        out.append(known.pop() if known else (None if None in sizes else 1))
    return tuple(out)


def _expandable(shape: tuple, to: tuple) -> bool:
    """ATen's ``is_expandable_to``, where None (a mask's count) takes any size."""
    if len(shape) > len(to):
        return False
    return all(size == 1 or target is None or size == target
               for size, target in zip(reversed(shape), reversed(to)))


def _index_fill(args, kwargs) -> None:
    """``index_fill_``'s checks of the index's dtype and a complex fill of a real tensor."""
    self, index, value = args[0], _arg(args, kwargs, 2, "index"), _arg(args, kwargs, 3, "value")
    if isinstance(index, torch.Tensor) and index.dtype != torch.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")
    complex_value = isinstance(value, complex) or (isinstance(value, torch.Tensor) and value.is_complex())
    if isinstance(self, torch.Tensor) and not self.is_complex() and complex_value:
        raise RuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not supported")


def sparse_refusal(op) -> NotImplementedError:
    """Sparse layouts have no remote form (a tensor on the wire is a strided view of one storage)."""
    return NotImplementedError(
        f"gpuwire: sparse tensors are not supported on the gpuwire device ({op}). Keep sparse work on the CPU, "
        "or use dense ones: nn.Embedding(..., sparse=False) / EmbeddingBag(sparse=False) and an optimizer other "
        "than SparseAdam")


def _embedding_bag_dimensions(args, kwargs) -> None:
    """``_embedding_bag``'s checks of its arguments' dimensions (ATen's ``check_arguments``; the
    meta kernel makes none of them, and a 3-d weight came back at the next sync point)."""
    weight, indices, offsets = args[0], _arg(args, kwargs, 1, "indices"), _arg(args, kwargs, 2, "offsets")
    if not all(isinstance(t, torch.Tensor) for t in (weight, indices, offsets)):
        return
    if indices.dim() not in (1, 2):
        raise RuntimeError(f"input has to be a 1D or 2D Tensor, but got Tensor of dimension {indices.dim()}")
    if indices.dim() == 1 and offsets.dim() != 1:
        raise RuntimeError(f"offsets has to be a 1D Tensor, but got Tensor of dimension {offsets.dim()}")
    if weight.dim() != 2:
        raise RuntimeError(f"weight has to be a 2D Tensor, but got Tensor of dimension {weight.dim()}")


_INDEX_PUT_IN_PLACE = _checks(_index_put, _written_in_place("index_put_", expanded_warns=True,
                                                               disjoint=((1, "indices"),), partial_only=((2, "values"),)))
_INDEX_FILL_IN_PLACE = _checks(_index_fill, _written_in_place("index_fill_", expanded_warns=True, disjoint=((2, "index"),)))
_MASKED_FILL_IN_PLACE = _written_in_place("masked_fill_", expanded_warns=True, partial_only=((1, "mask"),))

MISSED_BY_META = {
    "aten::_embedding_bag": _embedding_bag_dimensions,
    "aten::_embedding_bag_forward_only": _embedding_bag_dimensions,
    "aten::sub.Tensor": _sub_of_bool,
    "aten::sub_.Tensor": _sub_of_bool,
    "aten::sub.out": _sub_of_bool,
    "aten::_index_put_impl_": _INDEX_PUT_IN_PLACE,
    "aten::index_put_": _INDEX_PUT_IN_PLACE,
    "aten::index_put": _index_put,
    "aten::index_fill_.int_Scalar": _INDEX_FILL_IN_PLACE,
    "aten::index_fill_.int_Tensor": _INDEX_FILL_IN_PLACE,
    "aten::bernoulli_.float": _written_in_place("bernoulli_"),
    "aten::bernoulli_.Tensor": _written_in_place("bernoulli_", partial_only=((1, "p"),)),
    "aten::put_": _written_in_place("put_", disjoint=((1, "index"), (2, "source"))),
    **{f"aten::{name}": _written_in_place(name) for name in ("hardswish_", "relu_", "hardtanh_",
                                                              "rrelu_with_noise_")},
    "aten::masked_fill_.Tensor": _MASKED_FILL_IN_PLACE,
    "aten::index_fill.int_Scalar": _index_fill,
    "aten::index_fill.int_Tensor": _index_fill,
    "aten::gelu": _gelu,
    "aten::gelu.out": _gelu,
    "aten::gelu_": _gelu,
    "aten::multinomial": _multinomial,
    "aten::multinomial.out": _multinomial,
    "aten::bucketize.Tensor": _bucketize,
    "aten::bucketize.Scalar": _bucketize,
    "aten::bucketize.Tensor_out": _bucketize,
    "aten::searchsorted.Tensor": _searchsorted,
    "aten::searchsorted.Tensor_out": _searchsorted,
    "aten::searchsorted.Scalar": _searchsorted,
    "aten::searchsorted.Scalar_out": _searchsorted,
    "aten::uniform_": _uniform,
    "aten::normal_": _normal_in_place,
    "aten::normal.Tensor_float": _normal_second,
    "aten::normal.Tensor_float_out": _normal_second,
    "aten::normal.float_Tensor": _normal_second,
    "aten::normal.float_Tensor_out": _normal_second,
    "aten::normal.Tensor_Tensor": _normal_second,
    "aten::normal.Tensor_Tensor_out": _normal_second,
    "aten::normal.float_float": _normal_second,
    "aten::normal.float_float_out": _normal_second,
    **{f"aten::{fname}.{overload}": _degrees_of_freedom(fname) for fname in ("std", "var", "var_mean", "std_mean")
       for overload in ("correction", "correction_out")},
    "aten::linalg_vector_norm": _vector_norm_identity,
    "aten::linalg_vector_norm.out": _vector_norm_identity,
    "aten::linalg_cross.out": _cross_out,
    "aten::lu_unpack": _lu_unpack,
    "aten::lu_unpack.out": _lu_unpack,
    "aten::linalg_lstsq": _lstsq_driver,
    "aten::linalg_lstsq.out": _lstsq_driver,
    "aten::nansum": _reduction_dims,
    "aten::nansum.out": _reduction_dims,
    "aten::mode.values": _checks(_nonempty_reduction_dim("mode", 1), _mode_out),
    "aten::mode": _nonempty_reduction_dim("mode", 1),
    "aten::median.dim": _nonempty_reduction_dim("median", 1),
    "aten::median.dim_values": _nonempty_reduction_dim("median", 1),
    "aten::nanmedian.dim": _nonempty_reduction_dim("median", 1),
    "aten::nanmedian.dim_values": _nonempty_reduction_dim("median", 1),
    "aten::kthvalue": _nonempty_reduction_dim("kthvalue", 2),
    **{f"aten::{name}.{overload}": _bytebool_out(name) for name in ("all", "any")
       for overload in ("out", "dims_out", "all_out")},
    "aten::randperm": _randperm,
    "aten::randperm.generator": _randperm,
    "aten::randperm.out": _randperm_out,
    "aten::randperm.generator_out": _randperm_out,
    "aten::random_.from": _random_from,
    "aten::random_.to": _random_to,
    "aten::random.from": _random_from,
    "aten::random.to": _random_to,
    "aten::masked_fill_.Scalar": _checks(_masked_fill, _MASKED_FILL_IN_PLACE),
    "aten::masked_fill.Scalar": _masked_fill,
    "aten::_ctc_loss": _ctc_log_probs,
    "aten::_ctc_loss.Tensor": _ctc_log_probs,
    "aten::masked_scatter_": _checks(_masked_scatter, _written_in_place("masked_scatter_",
                                                                       partial_only=((1, "mask"), (2, "source")))),
    "aten::complex.out": _complex_out,
    "aten::aminmax.out": _aminmax_out,
    "aten::histc": _histc,
    "aten::frexp.Tensor_out": _frexp_out,
    "aten::histc.out": _histc,
    "aten::masked_select.out": _no_overlap(((0, "self"), (1, "mask")), ("out",)),
    "aten::kthvalue.values": _checks(_nonempty_reduction_dim("kthvalue", 2),
                                     _no_overlap(((0, "self"),), ("values", "indices"))),
    "aten::gather.out": _no_overlap(((0, "self"), (2, "index")), ("out",), partial_only=("index",)),
    "aten::index_select.out": _no_overlap(((0, "self"), (2, "index")), ("out",)),
    "aten::take.out": _no_overlap(((0, "self"), (1, "index")), ("out",)),
    "aten::cat.out": _no_overlap(((0, "tensors"),), ("out",)),
    "aten::bernoulli.out": _no_overlap(((0, "self"),), ("out",)),
    "aten::pow.Tensor_Scalar_out": _no_overlap(((0, "self"),), ("out",), partial_only=("self",)),
    "aten::pow.Scalar_out": _no_overlap(((1, "exponent"),), ("out",), partial_only=("exponent",)),
    "aten::pow.Tensor_Tensor_out": _no_overlap(((0, "self"), (1, "exponent")), ("out",),
                                               partial_only=("self", "exponent")),
    "aten::heaviside": _heaviside,
    "aten::heaviside_": _heaviside,
    "aten::heaviside.out": _heaviside,
}

# checks of a number's value for structured ops, whose cached signatures hold numbers by kind,
# that can fail only for an empty first argument: they run on every call of the Python path
# (``DirectPlan.check_every_call``), and a call with an empty input is never left to the C++ kernels
BY_VALUE = frozenset({"aten::linalg_vector_norm", "aten::linalg_vector_norm.out"})

# checks that read only what an op's call signature holds (dtypes, shapes, strides; numbers by
# their kind): the client's C++ op kernels may serve these ops' later calls, a signature's first
# call running the check through the op's plan (``_native_learn``)
BY_SIGNATURE = frozenset({"aten::sub.Tensor", "aten::sub_.Tensor",
                          "aten::_embedding_bag", "aten::_embedding_bag_forward_only",  # (dimensions)
                          # (its value against the dtype: a FunctionalPlan's C++ key holds Scalars by value)
                          "aten::masked_fill.Scalar",
                          "aten::_ctc_loss", "aten::_ctc_loss.Tensor",  # (a size)
                          "aten::kthvalue", "aten::mode", "aten::median.dim", "aten::nanmedian.dim",  # (a dim's size)
                          # (an expanded ``self`` is a matter of strides, which a signature holds)
                          "aten::relu_", "aten::hardtanh_", "aten::hardswish_"})
