"""Autocast for the gpuwire device, following CUDA's op lists.

Sits at the ``AutocastPrivateUse1`` dispatch key (``client.device`` registers a fallthrough
for every other op). A program that runs ``torch.autocast("cuda")`` on a real GPU gets the
same casts here, so the node runs each op in the dtype a CUDA run would use.

Two implementations of the same lists. From a program's first attach, ``autocast.cpp``
(module ``gpuwire_autocast``, built once per machine like the other helpers): PyTorch's own
CUDA lists and cast policies from ATen's ``autocast_mode.h``, with ATen's weight-cast cache, so
no Python runs per op (GPT-2 under bf16 autocast: the forward's issue time 14.4 -> 11.8 ms,
docs/performance.md). Before that, and where it cannot be built, the Python kernels below: the
lists copied from aten/src/ATen/autocast_mode.h. The RNN wrappers and the banned
``binary_cross_entropy`` stay Python in both (CUDA takes them from cuDNN's file, not the lists).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import _native
from .wire import DEVICE_TYPE, on_device

SOURCE = Path(__file__).with_name("autocast.cpp")
MODULE = "gpuwire_autocast"

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER_PRECISION = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv1d.padding", "conv2d.padding",
    "conv3d.padding", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# RNNs: on CUDA, cuDNN runs them and its autocast wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp)
# casts the input, hidden state and weights to float16 whatever the autocast dtype; here the
# whole RNN op is cast the same way, so outputs have the dtype a CUDA run gives
RNN_HALF = ("lstm.input", "lstm.data", "gru.input", "gru.data", "rnn_tanh.input", "rnn_tanh.data", "rnn_relu.input",
            "rnn_relu.data")
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
# overloads without a dtype, run as their dtype-taking sibling with float32 (CUDA's "fp32_append_dtype")
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

_library = None  # the Python kernels' library (all lists, or only the RNNs' and the ban)
_native_module = None  # the loaded C++ helper while its kernels serve the lists


def _eligible(value) -> bool:
    return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype is not torch.float64
            and on_device(value))


def _cast(value, dtype):
    if _eligible(value):
        return value.to(dtype) if value.dtype is not dtype else value
    if isinstance(value, (list, tuple)) and value and any(_eligible(v) for v in value):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _widest(values) -> torch.dtype | None:
    widest = None
    for v in values:
        items = v if isinstance(v, (list, tuple)) else (v,)
        for item in items:
            if _eligible(item):
                widest = item.dtype if widest is None else torch.promote_types(widest, item.dtype)
    return widest


def _op(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _kernel(op, policy: str):
    def lower(*args, **kwargs):
        dtype = torch.get_autocast_dtype(DEVICE_TYPE)
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    def fp32(*args, **kwargs):
        args = tuple(_cast(a, torch.float32) for a in args)
        kwargs = {k: _cast(v, torch.float32) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    names = [a.name for a in op._schema.arguments]
    dtype_index = names.index("dtype") if "dtype" in names else None

    def fp32_set_opt_dtype(*args, **kwargs):
        if args and _eligible(args[0]):  # (CUDA's test: the first argument)
            if dtype_index is not None and dtype_index < len(args):
                if args[dtype_index] is None:
                    args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
            elif kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    def promote(*args, **kwargs):
        widest = _widest(list(args) + list(kwargs.values()))
        if widest is not None:
            args = tuple(_cast(a, widest) for a in args)
            kwargs = {k: _cast(v, widest) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    def rnn_half(*args, **kwargs):
        args = tuple(_cast(a, torch.float16) for a in args)
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    return {"lower": lower, "fp32": fp32, "fp32_set_opt_dtype": fp32_set_opt_dtype, "promote": promote,
            "rnn_half": rnn_half}[policy]


def _banned_binary_cross_entropy(*args, **kwargs):
    raise RuntimeError(
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
        "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
        "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
        "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
        "safe to autocast.")


def _fp32_append_dtype(name: str, redispatch: str):
    """CUDA's "fp32_append_dtype": the inputs as they are, the dtype-taking overload asked for
    float32 results (the first argument's dtype where it is not eligible)."""
    target, positional = _op(redispatch), [a for a in _op(name)._schema.arguments if not a.kwarg_only]

    def kernel(*args, **kwargs):
        args = list(args)
        for argument in positional[len(args):]:  # (the redispatch takes them all: defaults filled in)
            args.append(kwargs.pop(argument.name) if argument.name in kwargs else argument.default_value)
        dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return target(*args, **kwargs, dtype=dtype)
    return kernel


def register() -> None:
    """Install the kernels once (the device itself registers a fallthrough for other ops):
    the C++ ones where ``use_native`` loaded them, else the Python ones."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    lists = (("rnn_half", RNN_HALF),)
    if _native_module is None:
        lists = (("lower", LOWER_PRECISION), ("fp32", FP32), ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE),
                 ("promote", PROMOTE), *lists)
        for name, redispatch in FP32_APPEND_DTYPE.items():
            library.impl(name, _fp32_append_dtype(name, redispatch), "AutocastPrivateUse1")
    for policy, names in lists:
        for name in names:
            try:
                op = _op(name)
            except AttributeError:
                continue  # not in this torch version
            library.impl(name, _kernel(op, policy), "AutocastPrivateUse1")
    library.impl("binary_cross_entropy", _banned_binary_cross_entropy, "AutocastPrivateUse1")
    _library = library


def use_native() -> str | None:
    """Serve CUDA's lists with the C++ kernels (``autocast.cpp``), building them first if this
    machine has none; None once they serve, else why not (the Python kernels stay). Called
    at a program's first attach (``client/native.py``), before any device tensor exists."""
    global _library, _native_module
    if _native_module is not None:
        return None
    loaded, failure = _native.install(SOURCE, MODULE, lambda module: None)
    if loaded is None:
        return failure
    if _library is not None:  # (first: two kernels for one op and key would only warn, the last winning)
        _library._destroy()
        _library = None
    try:
        loaded.register_kernels()
    except RuntimeError as exc:
        register()  # (all lists in Python again)
        return f"RuntimeError: {exc}"
    _native_module = loaded
    register()  # (the RNNs' kernels and the ban)
    return None


def use_python() -> None:
    """Serve every list with the Python kernels again (tests compare the two)."""
    global _library, _native_module
    if _native_module is None:
        return
    _library._destroy()
    _library = None
    _native_module.unregister_kernels()
    _native_module = None
    register()


def status() -> str:
    return "native" if _native_module is not None else "python"
