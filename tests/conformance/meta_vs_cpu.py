#!/usr/bin/env python
"""Which aten ops get other output metadata from their meta kernel than from their CPU kernel?

The client of a CPU node infers op outputs on meta tensors (fast) except for the ops listed in
``gpuwire.client.device._CPU_DIFFERS_FROM_META``, which it infers on fake CPU tensors (5-40x
slower, exact for the CPU backend). This script finds that list: it records every aten call
(forward and backward) of PyTorch's OpInfo samples (``opinfo``) and of training steps of the
Hugging Face, CNN and RNN models the tests use (``models``), runs each on meta and on fake CPU
tensors, and writes which ops agree and which differ (shape, strides, dtype) to a JSON file.

Usage::

    python tests/conformance/meta_vs_cpu.py /tmp/meta_vs_cpu.json opinfo models

Rerun it after a PyTorch upgrade and update the list. (Both can be wrong against the real CPU
kernel for mixed-dtype norms: ``_CPU_KERNEL_FIXES`` corrects those.)
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

FAKE = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
CALLS_PER_OP = 30


class Recorder(TorchDispatchMode):
    def __init__(self, limit: int):
        super().__init__()
        self.calls, self.limit = [], limit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if len(self.calls) < self.limit:
            self.calls.append((func, args, kwargs))
        return out


def to_meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return torch.device("meta") if isinstance(x, torch.device) and x.type == "cpu" else x


def to_fake(x):
    if isinstance(x, torch.Tensor):
        with FAKE:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    return x


def metadata(result):
    return [(tuple(t.shape), tuple(t.stride()) if t.numel() > 1 else None, t.dtype)
            if isinstance(t, torch.Tensor) else None for t in tree_flatten(result)[0]]


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout()


def bounded(fn, seconds: int = 5):
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)


class Scan:
    def __init__(self):
        self.agree: collections.Counter = collections.Counter()
        self.differ: dict = {}
        self.meta_error: collections.Counter = collections.Counter()
        self.seen: collections.Counter = collections.Counter()

    def record(self, fn, limit: int = 400) -> None:
        recorder = Recorder(limit)
        try:
            with recorder:
                bounded(fn, 10)
        except Exception:  # noqa: BLE001 - a sample that fails on CPU records what ran before
            pass
        for func, args, kwargs in recorder.calls:
            self.compare(func, args, kwargs)

    def compare(self, func, args, kwargs) -> None:
        name = str(func)
        if self.seen[name] >= CALLS_PER_OP or name in self.differ:
            return
        self.seen[name] += 1
        if any(isinstance(a, torch.Tensor) and (a.layout != torch.strided or a.is_quantized or a.is_nested)
               for a in tree_flatten((args, kwargs))[0]):
            return
        try:
            fake = bounded(lambda: _on_fake(func, args, kwargs))
        except Exception:  # noqa: BLE001 - CPU refuses these arguments: nothing to compare
            return
        try:
            meta = bounded(lambda: metadata(func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))))
        except Exception:  # noqa: BLE001
            self.meta_error[name] += 1
            return
        if meta != fake:
            self.differ[name] = {"meta": str(meta)[:300], "cpu": str(fake)[:300]}
        else:
            self.agree[name] += 1


def _on_fake(func, args, kwargs):
    with FAKE:
        return metadata(func(*tree_map(to_fake, args), **tree_map(to_fake, kwargs)))


def scan_opinfo(scan: Scan) -> None:
    from torch.testing._internal.common_methods_invocations import op_db
    for op in op_db:
        for dtype in (torch.float32, torch.bfloat16):
            if dtype not in op.supported_dtypes("cpu"):
                continue
            grad = dtype is torch.float32 and op.supports_autograd
            try:
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=grad))[:8]
            except Exception:  # noqa: BLE001
                continue
            for sample in samples:
                def run(sample=sample):
                    out = op(sample.input, *sample.args, **sample.kwargs)
                    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
                    if outs:
                        torch.autograd.backward([o.float().sum() if o.is_floating_point() else o.abs().sum()
                                                 for o in outs])
                scan.record(run)


def scan_models(scan: Scan) -> None:
    from tests.e2e.hf_zoo import CASES, loss_of
    from tests.e2e.models import LSTMLanguageModel, SmallResNet
    for build, make_inputs in CASES.values():
        for train in (True, False):
            def run(build=build, make_inputs=make_inputs, train=train):
                model = build()
                model.train(train)
                loss = loss_of(model(**make_inputs()))
                if train:
                    loss.backward()
            scan.record(run, limit=100_000)
    for make, batch in ((SmallResNet, lambda: torch.randn(4, 3, 16, 16)),
                        (LSTMLanguageModel, lambda: torch.randint(0, 50, (2, 7)))):
        scan.record(lambda make=make, batch=batch: make()(batch()).float().pow(2).mean().backward(), limit=100_000)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    signal.signal(signal.SIGALRM, _alarm)
    scan = Scan()
    if "opinfo" in argv:
        scan_opinfo(scan)
    if "models" in argv:
        scan_models(scan)
    with open(argv[0], "w") as out:
        json.dump({"agree": sorted(scan.agree), "differ": scan.differ, "meta_error": sorted(scan.meta_error)},
                  out, indent=1)
    print(f"{len(scan.agree)} ops agree; differ: {sorted(scan.differ)}; meta raised: {len(scan.meta_error)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
