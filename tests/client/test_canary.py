"""Canary: the private torch APIs gpuwire is built on. A torch upgrade that changes one of
them fails here first, with the API named, instead of somewhere deep in a training run."""

import inspect

import pytest
import torch

import gpuwire  # noqa: F401 - registers the device


def _require(condition: bool, api: str, detail: str = ""):
    if not condition:
        pytest.fail(f"private torch API changed: {api} {detail}(torch {torch.__version__}); gpuwire needs updating")


def test_privateuse1_python_backend_registration():
    from torch.utils import backend_registration as br
    fn = getattr(br, "_setup_privateuseone_for_python_backend", None)
    _require(fn is not None, "torch.utils.backend_registration._setup_privateuseone_for_python_backend")
    params = list(inspect.signature(fn).parameters)
    _require(params[:4] == ["rename", "backend_module", "hook", "device_guard"],
             "_setup_privateuseone_for_python_backend", f"signature is now {params} ")
    for name in ("create_empty_tensor", "PrivateUse1Hooks", "DeviceGuard",
                 "register_python_privateuseone_hook", "register_python_privateuseone_device_guard"):
        _require(hasattr(torch._C._acc, name), f"torch._C._acc.{name}")
    _require(torch._C._get_privateuse1_backend_name() == "gpuwire", "torch.utils.rename_privateuse1_backend")


def test_storage_from_a_virtual_address():
    _require(hasattr(torch._C, "_construct_storage_from_data_pointer"), "torch._C._construct_storage_from_data_pointer")
    storage = torch._C._construct_storage_from_data_pointer(0x5000_0000, torch.device("gpuwire", 0), 48)
    _require(storage.data_ptr() == 0x5000_0000 and storage.nbytes() == 48,
             "torch._C._construct_storage_from_data_pointer", "no longer keeps the pointer and size ")
    t = torch._C._acc.create_empty_tensor([3, 4], torch.float32)
    _require(t.device.type == "gpuwire", "torch._C._acc.create_empty_tensor", "no longer makes a PrivateUse1 tensor ")
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(cpu, t, storage, 0, [3, 4], [4, 1])
    _require(t.untyped_storage().data_ptr() == 0x5000_0000 and t.stride() == (4, 1),
             "aten.set_.source_Storage_storage_offset.redispatch(CPU)", "no longer sets metadata locally ")
    view = torch.ops.aten.as_strided.default.redispatch(cpu, t, [2, 2], [4, 1], 1)
    _require(view.untyped_storage().data_ptr() == 0x5000_0000 and view.storage_offset() == 1,
             "aten.as_strided.default.redispatch(CPU)", "views no longer share storage ")


def test_boxed_fallback_and_liveness():
    _require("with_keyset" in inspect.signature(torch.library.Library.fallback).parameters,
             "torch.library.Library.fallback")
    from torch.multiprocessing.reductions import StorageWeakRef
    storage = torch.UntypedStorage(8)
    ref = StorageWeakRef(storage)
    _require(not ref.expired(), "StorageWeakRef.expired")
    del storage
    _require(ref.expired(), "StorageWeakRef.expired", "does not report a freed storage ")


def test_dispatcher_introspection_used_for_whole_op_routing():
    for name in ("_dispatch_has_kernel_for_dispatch_key", "_dispatch_get_all_op_names"):
        _require(hasattr(torch._C, name), f"torch._C.{name}")
    _require(torch._C._dispatch_has_kernel_for_dispatch_key("aten::native_layer_norm", "CPU"),
             "torch._C._dispatch_has_kernel_for_dispatch_key")
    _require(hasattr(torch.ops.aten.lstm.input, "decompose"), "OpOverload.decompose")


def test_module_conversion_and_generator_hooks():
    _require(callable(getattr(torch.__future__, "get_swap_module_params_on_conversion", None)),
             "torch.__future__.get_swap_module_params_on_conversion")
    _require("get_swap_module_params_on_conversion" in inspect.getsource(torch.nn.Module._apply),
             "torch.nn.Module._apply", "no longer consults the swap flag ")
    _require(hasattr(torch._C._nn, "_parse_to"), "torch._C._nn._parse_to")
    _require(isinstance(torch._C.Generator, type) and torch._C.Generator.__flags__ & (1 << 10),
             "torch._C.Generator", "is no longer subclassable ")
    source = inspect.getsource(torch._utils._to)
    _require("UntypedStorage(" in source, "torch._utils._to", "no longer builds device storages with UntypedStorage ")


def test_disable_dynamo_caches_its_wrapper_on_the_function():
    """client/meta_kernels.defer_dynamo_import relies on ``_disable_dynamo``'s ``inner`` calling
    ``fn.__dynamo_disable`` when set (instead of importing dynamo to build it)."""
    called = []

    def fn(x):
        return x + 1

    wrapped = torch._compile._disable_dynamo(fn)
    cells = dict(zip(wrapped.__code__.co_freevars, (cell.cell_contents for cell in wrapped.__closure__)))
    assert cells["fn"] is fn and cells["recursive"] is True  # (how the client finds the function)
    fn.__dynamo_disable = lambda x: called.append(x) or 7
    assert wrapped(1) == 7 and called == [1]
