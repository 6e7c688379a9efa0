"""Patches to PyTorch's Python layer where it assumes a device is CPU/CUDA-like.

Sits beside ``client.device`` and is installed with it. Each patch is small, keeps the
original behaviour for everything that is not the gpuwire device, and says why it exists:

* ``Module.to/cpu/cuda`` across the gpuwire boundary swap parameters in place (PyTorch's
  ``param.data = …`` path refuses PrivateUse1, and the fallback of making new Parameter
  objects would silently untie tied weights, e.g. GPT-2's embedding and LM head).
* ``torch.UntypedStorage(n, device="gpuwire")`` (used by ``storage.to``, hence by
  ``torch.load(map_location=...)``) crashes in C++ for a Python backend with no allocator;
  it is routed to a remote allocation (``device="cuda"`` too under CUDA compatibility:
  ``storage.cuda()``).
* ``UntypedStorage.resize_`` (FSDP frees and re-allocates its flat parameters' storages so)
  needs a C++ hook a Python backend cannot provide; a remote storage moves to a fresh remote
  allocation of the new size, keeping its leading bytes, under the same storage object.
* ``t.data = other`` between the host and the device (``set_data`` refuses PrivateUse1) swaps
  the tensor onto ``other``'s storage, keeping the object.
* ``Tensor.pin_memory()`` (used by ``DataLoader(pin_memory=True)``, since torch's current
  accelerator is now gpuwire) needs a pinned allocator hook a Python backend cannot provide.
  Page-locked host memory buys nothing when bytes go through a socket, so it returns the
  tensor itself.
* ``torch.Generator(device="gpuwire")`` needs a C++ hook a Python backend cannot provide; it
  returns a generator that lives on the node (seeded, queried and passed to ops remotely).
* ``nn.TransformerEncoder`` in eval mode with a padding mask (the default
  ``enable_nested_tensor=True``) converts its batch to a nested tensor, which has no remote
  form. Where a local run would take that path, the encoder runs on the dense batch with the
  padding mask instead and zeroes the padded positions before its final norm, as the nested
  path's ``to_padded_tensor(0.0)`` does.
* safetensors' ``safe_open`` / ``load_file(..., device="gpuwire")``: its Rust parser knows a
  fixed list of device names and said "device gpuwire is invalid"; a device index it passes
  through to torch, which reads it as the current accelerator's, so a gpuwire device is given
  to it as its index (patched when safetensors is imported: ``_after_import``).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import secrets
import sys
import threading
import types

import torch

from .wire import DEVICE_TYPE, on_device

_local = threading.local()
_installed = False




def _is_gpuwire(device: torch.device) -> bool:
    """The gpuwire device, or "cuda" where CUDA compatibility makes it mean that."""
    if device.type == DEVICE_TYPE:
        return True
    if device.type == "cuda":
        from . import cuda_compat
        return cuda_compat.enabled()
    return False


def _crosses_gpuwire(module: torch.nn.Module, target: torch.device | None) -> bool:
    if target is not None and _is_gpuwire(target):
        return True
    for tensor in module.parameters():
        return on_device(tensor) and (target is None or target.type != DEVICE_TYPE)
    for tensor in module.buffers():
        return on_device(tensor) and (target is None or target.type != DEVICE_TYPE)
    return False


def _swapping(method, target_of):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if getattr(_local, "swap", False):
            return method(self, *args, **kwargs)
        try:
            target = target_of(*args, **kwargs)
        except Exception:  # noqa: BLE001 - let the original method report bad arguments
            target = None
        if not _crosses_gpuwire(self, target):
            return method(self, *args, **kwargs)
        lazy = _hide_uninitialized(self)
        _local.swap = True
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:
            if "Couldn't swap" not in str(exc):
                raise
            # a live autograd graph (e.g. from a forward pass on CPU) still holds a parameter;
            # fall back to PyTorch's default of new Parameter objects (tied weights get untied)
            import warnings
            warnings.warn(f"gpuwire: {exc}; moving with new Parameter objects instead, which unties shared "
                          "weights (drop references to earlier outputs before moving the module to keep them tied)",
                          stacklevel=2)
            _local.swap = False
            return method(self, *args, **kwargs)
        finally:
            _local.swap = False
            _move_uninitialized(lazy, method, args, kwargs)
    return wrapper


def _hide_uninitialized(module: torch.nn.Module) -> list:
    """A lazy module's parameters and buffers before its first forward, taken out of the way of
    ``module.to(...)``'s swap (which would make each a plain Parameter, an initialized one of no
    elements: ``nn.LazyLinear(4).to(device)`` then failed at its first forward); moved by
    ``_move_uninitialized``, keeping their class, as PyTorch's ``set_data`` path keeps it."""
    hidden = []
    for submodule in module.modules():
        for tensors in (submodule._parameters, submodule._buffers):
            for key, tensor in tensors.items():
                if isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin):
                    hidden.append((tensors, key, tensor))
                    tensors[key] = None  # (``_apply`` skips None; the key keeps its place)
    return hidden


def _move_uninitialized(hidden: list, method, args, kwargs) -> None:
    for tensors, key, tensor in hidden:
        tensors[key] = tensor
    for _, _, tensor in hidden:
        holder = torch.nn.Module()  # (the same method moves a plain tensor as it moves the module's)
        holder.register_buffer("moved", tensor.data)
        method(holder, *args, **kwargs)
        tensor.data = holder.moved


def _target_of_to(*args, **kwargs):
    device = torch._C._nn._parse_to(*args, **kwargs)[0]
    return torch.device(device) if device is not None else None


def _target_cpu(*args, **kwargs):
    return torch.device("cpu")


def _target_cuda(device=None, *args, **kwargs):
    return torch.device("cuda")


def _cuda_compat():
    from . import cuda_compat
    return cuda_compat


def _patch_untyped_storage() -> None:
    original_new = torch.UntypedStorage.__new__

    def __new__(cls, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and _cuda_compat().enabled():
            # ``storage.cuda()`` / ``storage.to(device="cuda")``, hence ``torch.load(...,
            # map_location=lambda storage, loc: storage.cuda())`` of older scripts
            device = kwargs["device"] = _cuda_compat()._map_device(device)
        if device is not None and torch.device(device).type == DEVICE_TYPE:
            from . import device as _device
            if args and not isinstance(args[0], int):
                host = original_new(cls, *args, **{k: v for k, v in kwargs.items() if k != "device"})
                remote = __new__(cls, host.nbytes(), device=device)
                remote.copy_(host)
                return remote
            nbytes = args[0] if args else 0
            rt = _device.runtime()
            with rt.lock:
                return _device.new_empty(rt, (nbytes,), (1,), torch.uint8).untyped_storage()
        return original_new(cls, *args, **kwargs)

    torch.UntypedStorage.__new__ = __new__
    original_resize = torch.UntypedStorage.resize_

    @functools.wraps(original_resize)
    def resize_(self, size):
        if self.device.type == DEVICE_TYPE:
            from . import device as _device
            _device.resize_storage(self, int(size))
            return self
        return original_resize(self, size)

    torch.UntypedStorage.resize_ = resize_


class RemoteGenerator(torch._C.Generator):
    """A random generator on the node. The CPU generator underneath is never used to draw
    numbers: its seed is a tag that ``client.wire`` maps to the node-side generator."""

    _next_id = 1

    def __new__(cls, device=None):
        from . import wire
        self = super().__new__(cls)
        self._remote_id = RemoteGenerator._next_id
        RemoteGenerator._next_id += 1
        tag = secrets.randbits(63) | (1 << 62)
        torch._C.Generator.manual_seed(self, tag)
        wire.generator_ids[tag] = self._remote_id
        self._initial_seed = 67280421310721
        return self

    def __init__(self, device=None):
        pass

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, 0)

    def _submit(self, name: str, *args) -> None:
        from . import device as _device
        rt = _device.runtime()
        with rt.lock:
            rt.submit(rt.encode_op(name, (self, *args), {}, ()))

    def manual_seed(self, seed: int) -> "RemoteGenerator":
        seed = int(seed) & ((1 << 64) - 1)
        self._submit("gpuwire::generator_manual_seed", seed)
        self._initial_seed = seed
        return self

    def seed(self) -> int:
        seed = secrets.randbits(63)
        self.manual_seed(seed)
        return seed

    def initial_seed(self) -> int:
        return self._initial_seed

    def get_state(self) -> torch.Tensor:
        from . import device as _device
        state = _device.runtime().call_sync("gpuwire::generator_get_state", [self], {})
        return torch.frombuffer(bytearray(state), dtype=torch.uint8).clone()

    def set_state(self, new_state: torch.Tensor) -> "RemoteGenerator":
        self._submit("gpuwire::generator_set_state", new_state.detach().cpu().contiguous())
        return self


class _GeneratorMeta(type(torch._C.Generator)):
    """``torch.Generator`` stays the type of every generator for isinstance checks; calling
    it with the gpuwire device makes a RemoteGenerator."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch._C.Generator)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, torch._C.Generator)

    def __call__(cls, device="cpu"):
        if device is not None and _is_gpuwire(torch.device(device)):
            return RemoteGenerator(DEVICE_TYPE)
        return torch._C.Generator(device)



class Generator(torch._C.Generator, metaclass=_GeneratorMeta):
    __doc__ = torch._C.Generator.__doc__


class _DenseInstead(Exception):
    """``TransformerEncoder`` reached its nested-tensor path with a gpuwire batch."""


def _patch_transformer_encoder() -> None:
    original_from_mask = torch._nested_tensor_from_mask

    @functools.wraps(original_from_mask)
    def nested_tensor_from_mask(t, mask, mask_check=True):
        if on_device(t):
            raise _DenseInstead
        return original_from_mask(t, mask, mask_check=mask_check)

    torch._nested_tensor_from_mask = nested_tensor_from_mask
    # (TorchScript compiles a call of it, in the forward below, as the ATen op it replaces)
    torch.jit._builtins._register_builtin(nested_tensor_from_mask, "aten::_nested_tensor_from_mask")
    encoder = torch.nn.TransformerEncoder
    original_forward = encoder.forward
    dense_instead = _DenseInstead

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        try:
            return original_forward(self, src, mask=mask, src_key_padding_mask=src_key_padding_mask,
                                    is_causal=is_causal)
        except dense_instead:
            pass
        norm, nested = self.norm, self.use_nested_tensor
        self.norm, self.use_nested_tensor = None, False
        try:
            out = original_forward(self, src, mask=mask, src_key_padding_mask=src_key_padding_mask,
                                   is_causal=is_causal)
        finally:
            self.norm, self.use_nested_tensor = norm, nested
        padded = src_key_padding_mask if src_key_padding_mask.dtype == torch.bool else src_key_padding_mask != 0
        if not self.layers[0].self_attn.batch_first:
            padded = padded.transpose(0, 1)
        out = out.masked_fill(padded.unsqueeze(-1), 0.0)
        return norm(out) if norm is not None else out

    # ``torch.jit.script`` compiles the source it finds behind ``__wrapped__`` (the original
    # forward) but resolves its names in the globals of the function it was handed: this one runs
    # in the transformer module's globals (its own names are closure cells), or scripting any
    # TransformerEncoder failed with "undefined value F" wherever gpuwire was installed
    forward = types.FunctionType(forward.__code__, sys.modules[original_forward.__module__].__dict__,
                                 forward.__name__, forward.__defaults__, forward.__closure__)
    encoder.forward = functools.update_wrapper(forward, original_forward)


def _patch_accelerator() -> None:
    """``torch.accelerator.synchronize()`` asks the C++ device guard, which a Python backend
    cannot give; the gpuwire device waits for its node instead."""
    original = torch.accelerator.synchronize

    @functools.wraps(original)
    def synchronize(device=None):
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None and accelerator.type == DEVICE_TYPE:
            from . import device as _device
            rt = _device.current_runtime()
            if rt is not None:
                rt.synchronize()
            return None
        return original(device)

    torch.accelerator.synchronize = synchronize


def _patch_data_assignment() -> None:
    """``t.data = other`` across the gpuwire boundary (FSDP2 moves a CPU model's parameters so:
    ``param.data = param.to(device)``): PyTorch's ``set_data`` takes only the devices it lists as
    dense backends, and raised "incompatible tensor type" for PrivateUse1. There the tensor object
    takes ``other``'s storage by ``torch.utils.swap_tensors`` instead, keeping its identity, its
    Parameter class and ``requires_grad``, as ``set_data`` does."""
    descriptor = torch._C.TensorBase.data

    def get_data(self):
        return descriptor.__get__(self)

    def set_data(self, value):
        try:
            descriptor.__set__(self, value)
        except RuntimeError as exc:
            if "incompatible tensor type" not in str(exc) or not isinstance(value, torch.Tensor) \
                    or not (on_device(self) or on_device(value)):
                raise
            replacement = value.detach()
            if isinstance(self, torch.nn.parameter.UninitializedTensorMixin):  # (a lazy module's: no data yet)
                replacement = type(self)(requires_grad=self.requires_grad, device=value.device, dtype=value.dtype)
            elif isinstance(self, torch.nn.Parameter):
                replacement = type(self)(replacement, requires_grad=self.requires_grad)
            else:
                replacement.requires_grad_(self.requires_grad)
            try:
                torch.utils.swap_tensors(self, replacement)
            except RuntimeError as swap_error:
                raise RuntimeError(
                    f"{exc} gpuwire moves a tensor between the host and the gpuwire device in place by swapping "
                    f"it, which this one refuses ({swap_error}). Use `tensor.to(...)` and keep the new tensor, "
                    "or move the module with `module.to(...)`.") from exc

    def delete_data(self):  # PyTorch's own refusal, not property's "has no deleter"
        descriptor.__delete__(self)

    torch.Tensor.data = property(get_data, set_data, delete_data, doc=descriptor.__doc__)


_PRINT_LOCK = threading.Lock()


def _patch_tensor_printing() -> None:
    """``print(x)`` of a device tensor in one round trip. PyTorch's formatter reads the tensor
    piece by piece (the finite values' range, then each printed row with ``tolist()``): 7
    round trips for a scalar loss, 25 for a 20x20 matrix, each a network round trip to the
    node. The values it prints are downloaded at once and formatted by PyTorch's own code on
    the host: the whole tensor when PyTorch would print it whole; else, along every dimension
    PyTorch elides, its edge items around one placeholder slice, printed with the same
    elision (the placeholder is what ``...`` stands for), so the text is PyTorch's own."""
    from torch import _tensor_str as printing
    original = printing._tensor_str
    options = printing.PRINT_OPTS

    @functools.wraps(original)
    def tensor_str(self, indent):
        if not on_device(self) or self.numel() == 0 or self._is_zerotensor():
            return original(self, indent)
        if self.numel() <= options.threshold:
            return original(self.cpu(), indent)
        edge = options.edgeitems
        if edge <= 0:
            return original(self, indent)
        shown = self
        for dim, size in enumerate(self.shape):
            if size > 2 * edge:
                kept = [*range(edge), edge - 1, *range(size - edge, size)]  # (``edge - 1``: the placeholder)
                shown = shown.index_select(dim, torch.tensor(kept, device=DEVICE_TYPE))
        shown = shown.cpu()
        with _PRINT_LOCK:
            threshold = options.threshold
            options.threshold = min(threshold, shown.numel() - 1)  # (elided as ``self`` is)
            try:
                return original(shown, indent)
            finally:
                options.threshold = threshold

    printing._tensor_str = tensor_str


def _patch_data_parallel() -> None:
    """``nn.DataParallel`` over the gpuwire device, natively or as ``"cuda"`` under ``gpuwire run``:
    its scatter and gather are CUDA-only C++ kernels (``torch._C._scatter``: an AttributeError
    here), and every device index of a session is the same GPU, so the module runs once on the
    whole batch, after host inputs move to the device as scatter would move them. PyTorch picks
    the device itself: with gpuwire installed, ``DataParallel(cpu_model)`` moves the model to the
    gpuwire device, as it moves it to ``cuda:0`` on a machine with a GPU."""
    from torch.nn.parallel import DataParallel
    from torch.utils._pytree import tree_map
    original_forward = DataParallel.forward

    def served_here(device: torch.device) -> bool:
        if device.type == DEVICE_TYPE:
            return True
        from . import cuda_compat
        return device.type == "cuda" and cuda_compat.enabled()

    @functools.wraps(original_forward)
    def forward(self, *inputs, **kwargs):
        if not self.device_ids or not served_here(self.src_device_obj):
            return original_forward(self, *inputs, **kwargs)
        device = self.src_device_obj

        def to_device(value):
            return value.to(device) if isinstance(value, torch.Tensor) and value.is_cpu else value

        return self.module(*tree_map(to_device, inputs), **tree_map(to_device, kwargs))

    DataParallel.forward = forward


def _after_import(name: str, patch) -> None:
    """Run ``patch(module)`` once module ``name`` is imported: now if it is, else right after
    its import, which is where patches of third-party code must go without importing it
    (and its cost) into every program that imports torch."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return

    class PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            original_exec = spec.loader.exec_module

            def exec_module(module):
                original_exec(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, PatchAfterImport())


def _patch_safetensors(safetensors: types.ModuleType) -> None:
    rust_safe_open = getattr(safetensors, "safe_open", None)
    if rust_safe_open is None or getattr(rust_safe_open, "_gpuwire_index_for_device", False):
        return

    def safe_open(filename, framework, device="cpu", **kwargs):
        if isinstance(device, torch.device) or isinstance(device, str) and device.startswith(("gpuwire", "cuda")):
            named = torch.device(device)
            if _is_gpuwire(named):
                device = named.index or 0
        return rust_safe_open(filename, framework=framework, device=device, **kwargs)

    safe_open._gpuwire_index_for_device = True
    safe_open.__doc__ = rust_safe_open.__doc__
    safetensors.safe_open = safe_open
    loader = sys.modules.get("safetensors.torch")  # (already imported: it took the Rust one by name)
    if loader is not None and getattr(loader, "safe_open", None) is rust_safe_open:
        loader.safe_open = safe_open


def install() -> None:
    global _installed
    if _installed:
        return
    _patch_untyped_storage()
    _patch_data_assignment()
    _patch_transformer_encoder()
    _patch_accelerator()
    _patch_data_parallel()
    _patch_tensor_printing()
    _after_import("safetensors", _patch_safetensors)
    from . import distributed, sharing
    distributed.install()
    sharing.install()
    torch.Generator = Generator
    original_pin_memory = torch.Tensor.pin_memory

    @functools.wraps(original_pin_memory)
    def pin_memory(self, device=None):
        if device is None or torch.device(device).type in (DEVICE_TYPE, "cuda"):
            return self
        return original_pin_memory(self, device)

    torch.Tensor.pin_memory = pin_memory
    original_flag = torch.__future__.get_swap_module_params_on_conversion

    def get_swap_module_params_on_conversion() -> bool:
        return getattr(_local, "swap", False) or original_flag()

    torch.__future__.get_swap_module_params_on_conversion = get_swap_module_params_on_conversion
    Module = torch.nn.Module
    Module.to = _swapping(Module.to, _target_of_to)
    Module.cpu = _swapping(Module.cpu, _target_cpu)
    Module.cuda = _swapping(Module.cuda, _target_cuda)
    _installed = True
