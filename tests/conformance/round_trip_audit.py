#!/usr/bin/env python
"""Which ops make a round trip every call: an audit over PyTorch's OpInfo database.

A gpuwire op should be streamed (queued, no reply awaited) unless its result's size depends on
tensor values (``nonzero``, ``unique``, ``masked_select`` ...) or PyTorch's own code reads a value
(``.item()`` in linalg error checks, ``cov``'s degrees of freedom ...). An op that makes a round
trip on every call for no such reason costs one network latency per call, which a program feels
at once on a real network (session 8 found ``x % 2`` and ``torch.fmod(x, 1.5)`` doing this).

For each OpInfo op, its first float32 samples run twice on the gpuwire device (the first pass
learns output layouts); the round trips of the second pass are counted, per sample. With
``--backward`` the samples require grad and each pass also runs the backward of every floating
output; the round trips of the backward alone are reported.

    python tests/conformance/round_trip_audit.py [--backward] [--samples 5] [--ops add,remainder]

Prints ``trips/sample op variant`` for every op above zero, highest first. Not a test (no
threshold: most of what it lists is inherent); a tool for finding ops to fix. OpInfo's
``wrapper_set_seed`` (which reseeds around random ops) is bypassed: reseeding is not the op.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("GPUWIRE_KNOWN_VALUES", "0")  # count what the node is asked, not client copies


def _float_outputs(result) -> list:
    import torch
    if isinstance(result, torch.Tensor):
        return [result] if result.requires_grad and result.dtype.is_floating_point else []
    if isinstance(result, (list, tuple)):
        return [t for value in result for t in _float_outputs(value)]
    return []


def audit(backward: bool, samples_per_op: int, only: set[str] | None) -> list[tuple]:
    import torch
    import torch.testing._internal.common_methods_invocations as cmi

    import gpuwire
    from gpuwire.client import device as client_device

    cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    device = torch.device("gpuwire")

    def alarm(*_):
        raise TimeoutError

    signal.signal(signal.SIGALRM, alarm)

    def to_device(t):
        if not isinstance(t, torch.Tensor):
            return t
        moved = t.detach().to(device)
        return moved.requires_grad_(t.requires_grad) if backward else moved

    found = []
    for op in cmi.op_db:
        if only and op.name not in only:
            continue
        if backward and not op.supports_autograd:
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=backward))[:samples_per_op]
        except Exception:  # noqa: BLE001 - an OpInfo that cannot make samples here
            continue
        moved = []
        for sample in samples:
            try:
                moved.append(sample.transform(to_device))
            except Exception:  # noqa: BLE001
                pass
        if not moved:
            continue
        trips = forward_trips = 0
        for _ in range(2):
            try:
                gpuwire.synchronize()
            except Exception:  # noqa: BLE001 - an earlier sample's deferred error
                pass
            runtime = client_device.current_runtime()
            start, forward_trips = runtime.round_trips, 0
            for sample in moved:
                signal.alarm(10)
                try:
                    before = runtime.round_trips
                    outputs = op(sample.input, *sample.args, **sample.kwargs)
                    forward_trips += runtime.round_trips - before
                    if backward:
                        floating = _float_outputs(outputs)
                        if floating:
                            torch.autograd.backward([t.sum() for t in floating])
                except Exception:  # noqa: BLE001 - errors are the conformance tests' business
                    pass
                finally:
                    signal.alarm(0)
            trips = client_device.current_runtime().round_trips - start
        counted = trips - forward_trips if backward else trips
        if counted > 0:
            found.append((counted / len(moved), op.name, op.variant_test_name, len(moved)))
    return sorted(found, reverse=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backward", action="store_true", help="count the round trips of the backward pass")
    parser.add_argument("--samples", type=int, default=5, help="samples per op (default 5)")
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    args = parser.parse_args(argv)
    only = {name for name in args.ops.split(",") if name} or None
    what = "backward round trips" if args.backward else "round trips"
    for per_sample, name, variant, count in audit(args.backward, args.samples, only):
        print(f"{per_sample:.1f} {what}/sample  {name} {variant} ({count} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
