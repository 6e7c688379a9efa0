"""Every OpInfo ``error_inputs`` sample on the gpuwire device: is the error raised at the call?

PyTorch's ``test_ops.py`` (``TestCommon.test_errors``) calls each op with inputs it must refuse
and expects the error, with its message, inside the ``with``. On the device, ops are queued
without waiting for the node, so a check that only the node's kernel makes surfaced at the next
sync point, charged to a later line. Each sample here is built on the CPU (the samples whose
CPU call does not raise as declared are skipped: they are device-specific), moved to the device
with its aliasing kept (``out=`` tensors that overlap an input are the point of several), called
without a sync, then synchronized; each is counted as:

- ``ok``: raised at the call, of the declared type and message;
- ``late``: raised only by the sync (the node's kernel refused it);
- ``message``: raised at the call, but another error or message;
- ``none``: never raised.

Run it: ``python tests/conformance/error_inputs.py`` (starts a CPU node of its own, or uses
``GPUWIRE_NODE``); ``tests/conformance/test_error_inputs.py`` runs it in CI.
"""

from __future__ import annotations

import re
import warnings

import torch

# raised late here as on a CUDA GPU, where these are device-side (asynchronous) errors: they
# depend on the values of the inputs, which only the node holds
DATA_DEPENDENT = (
    ("gather", "out of bounds"), ("scatter", "out of bounds"), ("scatter_add", "out of bounds"),
    ("multinomial", "probability tensor contains"), ("multinomial", "invalid multinomial distribution"),
)
# the CPU kernel's own wording; CUDA runs the composite (``narrow`` + ``clone``), whose errors
# the device raises
CPU_ONLY_MESSAGES = (("narrow_copy", "self_sizes.size"), ("narrow_copy", "exceeds dimension size"))


class Mover:
    """CPU sample -> device sample, keeping which tensors share memory (by storage)."""

    def __init__(self, device):
        self.device, self.storages, self.objects = device, {}, {}

    def __call__(self, value):
        from torch.utils._pytree import tree_map
        return tree_map(self._move, value)

    def _move(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        if id(t) in self.objects:
            return self.objects[id(t)]
        storage = t.untyped_storage()
        moved = None
        if storage.nbytes() and not storage.nbytes() % t.element_size():
            key = (storage.data_ptr(), storage.nbytes())
            if key not in self.storages:
                raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
                self.storages[key] = raw.to(self.device)
            try:
                moved = self.storages[key].view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
            except RuntimeError:  # (a layout the device's storage cannot hold as the CPU's did)
                moved = None
        if moved is None:
            moved = t.to(self.device)
        if t.requires_grad:
            moved.requires_grad_()
        self.objects[id(t)] = moved
        return moved


def _name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _raises_as_declared(call, error) -> bool:
    try:
        call()
    except error.error_type as exc:
        return re.search(error.error_regex, str(exc)) is not None
    except Exception:  # noqa: BLE001 - another error: the sample is not for this device
        return False
    return False


def survey(device) -> dict:
    """{"ok": count, "late" / "message" / "none": [(op, regex, what happened)]}."""
    import gpuwire
    from torch.testing._internal.common_methods_invocations import op_db
    found = {"ok": 0, "late": [], "message": [], "none": []}
    for op in op_db:
        if op.error_inputs_func is None:
            continue
        try:
            errors = list(op.error_inputs("cpu"))
        except Exception:  # noqa: BLE001 - a generator that needs another device
            continue
        for error in errors:
            sample = error.sample_input
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if not _raises_as_declared(lambda: op(sample.input, *sample.args, **sample.kwargs), error):
                    continue
                move = Mover(device)
                x, args, kwargs = move(sample.input), move(sample.args), move(sample.kwargs)
                raised = late = None
                try:
                    op(x, *args, **kwargs)
                except Exception as exc:  # noqa: BLE001
                    raised = exc
                try:
                    gpuwire.synchronize()
                except Exception as exc:  # noqa: BLE001
                    late = exc
            where = (_name(op), error.error_regex)
            if raised is None:
                found["late" if late is not None else "none"].append((*where, str(late or "")[:200]))
            elif isinstance(raised, error.error_type) and re.search(error.error_regex, str(raised)):
                found["ok"] += 1
            else:
                found["message"].append((*where, f"{type(raised).__name__}: {str(raised)[:200]}"))
    return found


def unexpected(found: dict) -> list:
    """The outcomes that are not ``ok`` and not explained by ``DATA_DEPENDENT`` / ``CPU_ONLY_MESSAGES``."""
    def listed(entry, table):
        return any(entry[0] == op and part in entry[1] + entry[2] for op, part in table)
    return ([("late", *e) for e in found["late"] if not listed(e, DATA_DEPENDENT)]
            + [("message", *e) for e in found["message"] if not listed(e, CPU_ONLY_MESSAGES)]
            + [("none", *e) for e in found["none"]])


def main() -> int:
    import os
    import sys
    from pathlib import Path
    ctx = None
    if not os.environ.get("GPUWIRE_NODE"):
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from bench.common import Context  # (starts a CPU node and kills it at the end)
        ctx = Context(quick=True, threads=1)
        ctx.attach(backend="cpu")
    try:
        found = survey(torch.device("gpuwire"))
    finally:
        if ctx is not None:
            ctx.kill_all()
    print(f"error inputs: {found['ok']} raised at the call; {len(found['late'])} only at the next sync; "
          f"{len(found['message'])} with another error; {len(found['none'])} never")
    for kind, op, regex, what in unexpected(found):
        print(f"  {kind}: {op}: expected /{regex}/: {what}")
    return 1 if unexpected(found) else 0


if __name__ == "__main__":
    raise SystemExit(main())
