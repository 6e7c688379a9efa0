#!/usr/bin/env python
"""Conformance of the gpuwire device against PyTorch's own OpInfo database.

For every OpInfo in ``torch.testing._internal.common_methods_invocations.op_db`` and each of
its float32 samples, the op runs on CPU and on the gpuwire device (every tensor of the sample
moved there with its exact layout and aliasing); the results must agree in structure, dtype,
shape and values: exactly (NaN == NaN), else within assert_close's float32 tolerance (counted
apart as ``passed_tol``). Only samples whose CPU run succeeds count.

Usage::

    python tests/conformance/opinfo_runner.py --full --out docs/opinfo_results.json
    python tests/conformance/opinfo_runner.py --sampled --out /tmp/opinfo.json   # CI subset
    python tests/conformance/opinfo_runner.py --ops add,mul,sort --out /tmp/x.json -v

Robustness: a coordinator process runs the ops in a worker process and watches it. The worker
bounds each sample's time (SIGALRM), restarts its node when the connection is lost (or attaches
again to ``GPUWIRE_NODE`` when set), and streams one JSON line per op to a progress file. If
the worker itself dies or hangs (a crash or a kernel that never returns), the coordinator
records that for the op and starts a new worker at the next op.
"""

from __future__ import annotations

import os

# compare what the node computed: no client-side copies of known small integer values
os.environ.setdefault("GPUWIRE_KNOWN_VALUES", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import signal
import subprocess
import sys
import time
import traceback
import warnings
import zlib

RUNNER = os.path.abspath(__file__)

# Ops that cannot pass, with the reason. Keys are OpInfo names (``name`` or ``name.variant``).
SKIP: dict[str, str] = {
    "to_sparse": "sparse layouts are not supported: gpuwire tensors and the wire format are strided only "
                 "(the node fails the conversion)",
    "sparse.sampled_addmm": "sparse CSR inputs: gpuwire has no SparseCsrPrivateUse1 kernels (strided tensors only)",
    "sparse.mm.reduce": "sparse CSR inputs: gpuwire has no SparseCsrPrivateUse1 kernels (strided tensors only)",
}

# Ops whose values are legitimately not comparable: dtype, shape (and structure) still are.
SHAPE_ONLY: dict[str, str] = {
    "empty": "uninitialized memory",
    "empty_like": "uninitialized memory",
    "new_empty": "uninitialized memory",
    "new_empty_strided": "uninitialized memory",
    "empty_strided": "uninitialized memory",
    "empty_permuted": "uninitialized memory",
    "resize_": "the grown part is uninitialized memory",
    "resize_as_": "the grown part is uninitialized memory",
}

# Random ops. Both runs are seeded identically (torch.manual_seed reaches the node's generator),
# so on a CPU node the values are compared too; where the streams differ (a CUDA node: another
# generator), only structure, dtype and shape are compared and the sample counts as ``shape_only``.
RANDOM_OPS = {
    "cauchy", "exponential", "geometric", "log_normal", "normal", "normal.in_place", "normal.number_mean",
    "uniform", "bernoulli", "multinomial", "randn", "randn_like", "rand_like", "randint", "randint_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "svd_lowrank", "pca_lowrank", "nn.functional.multi_head_attention_forward",
}

# Ops whose sample arguments (not the input) must stay CPU tensors, as on CUDA.
KEEP_ARGS_ON_CPU: dict[str, str] = {
    "tensor_split": "tensor_indices_or_sections must be a CPU tensor (CUDA requires the same)",
}

SAMPLED_OPS = 150
SAMPLED_MAX_SAMPLES = 3


def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def sampled_keys(keys: list[str], count: int = SAMPLED_OPS) -> list[str]:
    """A fixed subset: the ``count`` ops with the smallest crc32 of their name (stable across
    runs, machines and op_db order), minus skipped ones."""
    pool = sorted((k for k in keys if k not in SKIP), key=lambda k: (zlib.crc32(k.encode()), k))
    return sorted(pool[:count])


# ====================================================================== coordinator


def coordinate(args) -> dict:
    progress = args.out + ".progress.jsonl"
    if os.path.exists(progress):
        os.remove(progress)
    records: dict[str, dict] = {}
    order: list[str] = []
    start = 0
    started = time.time()
    restarts = 0
    while True:
        cmd = [sys.executable, RUNNER, "--worker", "--progress", progress, "--start", str(start),
               "--timeout", str(args.timeout), "--backend", args.backend]
        if args.full:
            cmd.append("--full")
        elif args.ops:
            cmd += ["--ops", args.ops]
        else:
            cmd.append("--sampled")
        if args.max_samples is not None:
            cmd += ["--max-samples", str(args.max_samples)]
        cmd += ["--dtype", args.dtype]
        if args.repeat:
            cmd += ["--repeat", str(args.repeat)]
        if args.verbose:
            cmd.append("-v")
        worker = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        last_size, last_change = -1, time.time()
        while worker.poll() is None:
            time.sleep(0.5)
            size = os.path.getsize(progress) if os.path.exists(progress) else 0
            if size != last_size:
                last_size, last_change = size, time.time()
            elif time.time() - last_change > args.hang_timeout:
                os.kill(worker.pid, signal.SIGKILL)  # the worker we started; its node exits with it
                worker.wait()
                break
        events = _read_events(progress)
        done = False
        current = partial = None
        for event in events:
            kind = event["event"]
            if kind == "ops":
                order = event["keys"]
            elif kind == "start":
                current, partial = event, None
            elif kind == "sample":
                partial = event
            elif kind == "op":
                records[event["record"]["op"]] = event["record"]
                current = None
            elif kind == "done":
                done = True
        if done:
            break
        if current is None or current["key"] in records:
            # died before its first op or between ops: go on after the last finished one
            finished = [i for i, k in enumerate(order) if k in records]
            start = (max(finished) + 1) if finished else start
            if not order or start >= len(order):
                break
            restarts += 1
            if restarts > 50:
                break
            continue
        key = current["key"]
        reason = (f"worker hung for more than {args.hang_timeout:g} s (a kernel that never returned)"
                  if worker.returncode == -signal.SIGKILL else
                  f"worker process died (exit status {worker.returncode}) while running this op")
        # the samples before the fatal one keep their outcome; the fatal one counts as failed
        # (its CPU run may not even have happened; the op's later samples are not run)
        record = dict(partial["record"]) if partial else {
            "op": key, "samples": 0, "passed": 0, "passed_tol": 0, "shape_only": 0, "failed": 0,
            "cpu_failed": 0, "no_device": 0, "timeouts": 0, "first_error": None}
        sample_index = partial["index"] if partial else 0
        record.update(samples=record["samples"] + 1, failed=record["failed"] + 1, crashed=True, seconds=None)
        record["first_error"] = record["first_error"] or f"sample {sample_index}: {reason}"
        record["notes"] = [f"sample {sample_index}: {reason}; later samples of this op were not run"]
        records[key] = record
        print(f"opinfo: {key}: {reason}", file=sys.stderr)
        start = current["index"] + 1
        restarts += 1
        if start >= len(order) or restarts > 50:
            break
    results = summarize([records[k] for k in order if k in records], time.time() - started, args)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1, sort_keys=False)
        fh.write("\n")
    if os.path.exists(progress):  # (a worker that refused its arguments wrote none)
        os.remove(progress)
    return results


def _read_events(path: str) -> list[dict]:
    events = []
    if not os.path.exists(path):
        return events
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a half-written last line of a killed worker
    return events


def summarize(records: list[dict], seconds: float, args) -> dict:
    counted = [r for r in records if not r.get("skipped")]
    samples = sum(r["samples"] for r in counted)
    passed = sum(r["passed"] for r in counted)
    totals = {
        "ops": len(records),
        "ops_run": len(counted),
        "ops_skipped": len(records) - len(counted),
        "ops_all_passed": sum(1 for r in counted if r["samples"] and r["failed"] == 0),
        "ops_with_failures": sum(1 for r in counted if r["failed"]),
        "ops_without_cpu_samples": sum(1 for r in counted if not r["samples"] and not r["failed"]),
        "samples": samples,
        "passed": passed,
        "passed_exact": passed - sum(r["passed_tol"] for r in counted) - sum(r["shape_only"] for r in counted),
        "passed_tol": sum(r["passed_tol"] for r in counted),
        "shape_only": sum(r["shape_only"] for r in counted),
        "failed": sum(r["failed"] for r in counted),
        "timeouts": sum(r["timeouts"] for r in counted),
        "crashed_ops": sum(1 for r in counted if r.get("crashed")),
        "cpu_failed_samples": sum(r["cpu_failed"] for r in counted),
        "no_device_samples": sum(r.get("no_device", 0) for r in counted),
        "pass_rate": (passed / samples) if samples else 1.0,
        "seconds": round(seconds, 1),
    }
    import platform
    return {
        "mode": "full" if args.full else ("ops" if args.ops else "sampled"),
        "backend": args.backend,
        "max_samples": args.max_samples,
        "repeat": args.repeat,
        "sample_timeout_s": args.timeout,
        "python": platform.python_version(),
        "totals": totals,
        "skip_list": SKIP,
        "shape_only_ops": SHAPE_ONLY,
        "failures": {r["op"]: r["first_error"] for r in counted if r["failed"]},
        "ops": {r["op"]: r for r in records},
    }


# ====================================================================== worker


class SampleTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise SampleTimeout()


class Node:
    """The node the worker talks to: its own ``gpuwire serve`` child (restarted when it dies),
    or ``GPUWIRE_NODE`` (attached again after a lost connection)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.address = os.environ.get("GPUWIRE_NODE")
        self.token = os.environ.get("GPUWIRE_TOKEN")
        self.owned = not self.address
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        if self.owned:
            self._spawn()
        self._attach()

    def _spawn(self) -> None:
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        env.pop("GPUWIRE_NODE", None)
        env.pop("GPUWIRE_NODE_TOKEN", None)
        cmd = [sys.executable, "-m", "gpuwire", "serve", "--host", "127.0.0.1", "--port", "0",
               "--backend", self.backend, "--exit-with-stdin", "--log-level", "error"]
        # --exit-with-stdin: the node exits when this worker does, even when it is SIGKILLed
        # the node's stderr (kernel warnings from the samples) would drown the runner's report
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"the gpuwire node did not start: {line!r}")
        self.address = line.split()[4]
        self.token = None

    def _attach(self) -> None:
        import gpuwire
        gpuwire.attach(self.address, token=self.token)

    def restart(self) -> None:
        """After a lost connection or a timeout inside a device call: a fresh session (and, for
        an owned node, a fresh node: it may be dead or still busy with the timed-out kernel)."""
        import gpuwire
        self.restarts += 1
        try:
            gpuwire.detach()
        except Exception:  # noqa: BLE001
            pass
        if self.owned:
            self.stop()
            self._spawn()
        self._attach()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def worker(args) -> None:
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    import gpuwire

    signal.signal(signal.SIGALRM, _on_alarm)
    warnings.filterwarnings("ignore")
    by_key = {}
    for op in op_db:
        by_key.setdefault(op_key(op), op)
    if args.full:
        keys = list(by_key)
    elif args.ops:
        keys = [k for k in args.ops.split(",") if k]
        missing = [k for k in keys if k not in by_key]
        if missing:
            raise SystemExit(f"unknown OpInfo names: {missing}")
    else:
        keys = sampled_keys(list(by_key))
    max_samples = args.max_samples
    if max_samples is None and not args.full and not args.ops:
        max_samples = SAMPLED_MAX_SAMPLES

    node = Node(args.backend)
    node.start()
    ctx = Context(torch, gpuwire, node, args.timeout, max_samples, args.verbose, getattr(torch, args.dtype))
    ctx.repeat = args.repeat
    with open(args.progress, "a") as progress:
        def emit(event):
            progress.write(json.dumps(event) + "\n")
            progress.flush()

        if args.start == 0:
            emit({"event": "ops", "keys": keys})
        for index in range(args.start, len(keys)):
            key = keys[index]
            emit({"event": "start", "index": index, "key": key})
            record = ctx.run_op(key, by_key[key], emit)
            emit({"event": "op", "record": record})
            if args.verbose or record["failed"]:
                status = "skipped: " + record["skipped"] if record.get("skipped") else \
                    f"{record['passed']}/{record['samples']}"
                first = f"  {record['first_error'][:300]}" if record["failed"] else ""
                print(f"opinfo: {key}: {status}{first}", file=sys.stderr, flush=True)
        emit({"event": "done"})
    gpuwire.detach()
    node.stop()


class Context:
    def __init__(self, torch, gpuwire, node: Node, timeout: float, max_samples: int | None, verbose: bool,
                 dtype=None):
        self.torch = torch
        self.dtype = dtype or torch.float32
        self.gpuwire = gpuwire
        self.node = node
        self.timeout = timeout
        self.max_samples = max_samples
        self.verbose = verbose
        self.device = torch.device("gpuwire", 0)
        self.repeat = 0  # run each device call this many times first, each on its own copy (``--repeat``)

    # ------------------------------------------------------------ one op

    def run_op(self, key: str, op, emit=None) -> dict:
        torch = self.torch
        record = {"op": key, "samples": 0, "passed": 0, "passed_tol": 0, "shape_only": 0, "failed": 0,
                  "cpu_failed": 0, "no_device": 0, "timeouts": 0, "first_error": None, "seconds": 0.0}
        reason = SKIP.get(key) or SKIP.get(op.name)
        if reason is None and self.dtype not in op.supported_dtypes("cpu"):
            reason = f"the op does not support {self.dtype} on CPU (no such samples)"
        if reason is not None:
            record["skipped"] = reason
            return record
        started = time.time()
        shape_only = SHAPE_ONLY.get(key) or SHAPE_ONLY.get(op.name)
        random_op = key in RANDOM_OPS or op.name in RANDOM_OPS
        self.keep_args_on_cpu = key in KEEP_ARGS_ON_CPU or op.name in KEEP_ARGS_ON_CPU
        torch.manual_seed(0)
        samples = None
        index = 0
        while self.max_samples is None or index < self.max_samples:
            try:
                with Deadline(self.timeout):
                    if samples is None:
                        samples = iter(op.sample_inputs("cpu", self.dtype, requires_grad=False))
                    sample = next(samples)
            except StopIteration:
                break
            except SampleTimeout:
                record["cpu_failed"] += 1
                record.setdefault("notes", []).append(f"sample {index}: generating it took over {self.timeout:g} s")
                break
            except Exception as exc:  # noqa: BLE001 - the sample generator itself failed: nothing to compare
                record.setdefault("notes", []).append(f"sample generation failed: {_describe(exc)}")
                break
            if emit is not None:
                # where a crash of this sample leaves the op (the coordinator reads it back)
                emit({"event": "sample", "index": index, "record": record})
            outcome, detail = self.run_sample(op, sample, index, shape_only, random_op)
            index += 1
            if outcome == "cpu_failed" or outcome == "no_device":
                record[outcome] += 1
                continue
            record["samples"] += 1
            if outcome == "failed" or outcome == "timeout":
                record["failed"] += 1
                if outcome == "timeout":
                    record["timeouts"] += 1
                if record["first_error"] is None:
                    record["first_error"] = f"sample {index - 1}: {detail}"
            else:
                record["passed"] += 1
                if outcome == "passed_tol":
                    record["passed_tol"] += 1
                elif outcome == "shape_only":
                    record["shape_only"] += 1
        record["seconds"] = round(time.time() - started, 3)
        return record

    # ------------------------------------------------------------ one sample

    def run_sample(self, op, sample, index: int, shape_only: str | None, random_op: bool):
        torch = self.torch
        seed = 1000 + index
        # the device copy first: the CPU run may mutate the sample
        device_error = None
        try:
            with Deadline(self.timeout):
                memo: dict = {}
                self.moved = False
                d_input = self.to_device(sample.input, memo)
                d_args = sample.args if self.keep_args_on_cpu else self.to_device(sample.args, memo)
                d_kwargs = self.to_device(sample.kwargs, memo, top_kwargs=True)
        except SampleTimeout:
            self._recover()
            return "timeout", f"copying the sample to the device took over {self.timeout:g} s"
        except Exception as exc:  # noqa: BLE001
            device_error = f"copying the sample to the device failed: {_describe(exc)}"
            self._after_error(exc)
        try:
            with Deadline(self.timeout):
                torch.manual_seed(seed)
                expected = op(sample.input, *sample.args, **sample.kwargs)
        except SampleTimeout:
            return "cpu_failed", None
        except Exception:  # noqa: BLE001 - the CPU reference fails: the sample does not count
            return "cpu_failed", None
        if device_error is not None:
            return "failed", device_error
        if not self.moved:
            return "no_device", None  # no tensor and no device in the sample: both runs are CPU runs
        try:
            with Deadline(self.timeout):
                for _ in range(self.repeat):  # (the compared call then takes the paths of a signature seen before)
                    memo = {}
                    first = (self.to_device(sample.input, memo),
                             sample.args if self.keep_args_on_cpu else self.to_device(sample.args, memo),
                             self.to_device(sample.kwargs, memo, top_kwargs=True))
                    torch.manual_seed(seed)
                    try:
                        op(first[0], *first[1], **first[2])
                        self.gpuwire.synchronize()
                    except Exception:  # noqa: BLE001 - the compared call raises it again
                        pass
                torch.manual_seed(seed)
                actual = op(d_input, *d_args, **d_kwargs)
                self.gpuwire.synchronize()
                actual = self.to_host(actual)
        except SampleTimeout:
            self._recover()
            return "timeout", f"the device run took over {self.timeout:g} s"
        except Exception as exc:  # noqa: BLE001
            self._after_error(exc)
            return "failed", f"device run raised {_describe(exc)}"
        try:
            return self.compare(expected, actual, shape_only is not None, random_op)
        except Exception as exc:  # noqa: BLE001
            return "failed", f"comparison raised {_describe(exc)}"

    def _after_error(self, exc) -> None:
        if isinstance(exc, (self.gpuwire.ConnectionLost, self.gpuwire.NodeUnreachable)):
            self._recover()
            return
        try:
            with Deadline(self.timeout):
                self.gpuwire.synchronize()  # an error left queued must not land on the next sample
        except SampleTimeout:
            self._recover()
        except Exception as exc2:  # noqa: BLE001
            if isinstance(exc2, (self.gpuwire.ConnectionLost, self.gpuwire.NodeUnreachable)):
                self._recover()

    def _recover(self) -> None:
        try:
            self.node.restart()
        except Exception as exc:  # noqa: BLE001
            print(f"opinfo: restarting the node failed: {_describe(exc)}; retrying", file=sys.stderr)
            time.sleep(1)
            self.node.restart()

    # ------------------------------------------------------------ moving values

    def to_device(self, value, memo: dict, top_kwargs: bool = False):
        """``value`` with every CPU tensor replaced by a gpuwire tensor of the same sizes, strides,
        offset and values; tensors that share a CPU storage share a device storage."""
        torch = self.torch
        if isinstance(value, torch.Tensor):
            self.moved = True
            if value.layout != torch.strided or value.device.type != "cpu":
                return value.to(self.device)
            storage = value.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes(), value.dtype)
            flat = memo.get(key)
            if flat is None:
                count = storage.nbytes() // value.element_size()
                host = torch.empty(0, dtype=value.dtype).set_(storage, 0, (count,), (1,))
                if value.is_conj():
                    host = host.conj()
                flat = memo[key] = host.resolve_neg().resolve_conj().to(self.device)
            if value.is_conj() or value.is_neg():
                # lazy conj/neg bits: move the materialized values (layout is kept by ``to``)
                return value.resolve_conj().resolve_neg().to(self.device)
            return flat.as_strided(value.shape, value.stride(), value.storage_offset())
        if isinstance(value, str) and value == "cpu":  # a device argument (``x.to("cpu", ...)``)
            self.moved = True
            return "gpuwire"
        if isinstance(value, torch.device):
            if value.type == "cpu":
                self.moved = True
                return self.device
            return value
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if top_kwargs and k == "device" and (v == "cpu" or (isinstance(v, torch.device) and v.type == "cpu")):
                    self.moved = True
                    out[k] = self.device
                else:
                    out[k] = self.to_device(v, memo)
            return out
        if isinstance(value, list):
            return [self.to_device(v, memo) for v in value]
        if isinstance(value, tuple) and not isinstance(value, torch.Size):
            moved = [self.to_device(v, memo) for v in value]
            return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
        return value

    def to_host(self, value):
        """Download device results (kept as Host(tensor, device_type) to check the device)."""
        torch = self.torch
        if isinstance(value, torch.Tensor):
            device_type = value.device.type
            if value.layout != torch.strided:
                return Host(value.to_dense().cpu(), device_type)
            return Host(value.cpu(), device_type)
        if isinstance(value, list):
            return [self.to_host(v) for v in value]
        if isinstance(value, tuple) and not isinstance(value, torch.Size):
            moved = [self.to_host(v) for v in value]
            return type(value)(moved) if _is_structseq(value) else (
                type(value)(*moved) if hasattr(value, "_fields") else tuple(moved))
        if isinstance(value, dict):
            return {k: self.to_host(v) for k, v in value.items()}
        return value

    # ------------------------------------------------------------ comparing

    def compare(self, expected, actual, shape_only: bool, random_op: bool):
        torch = self.torch
        e_leaves, e_path = _flatten(expected, torch)
        a_leaves, a_path = _flatten(actual, torch)
        if e_path != a_path:
            return "failed", f"result structure differs: expected {_short(e_path)}, got {_short(a_path)}"
        tolerant = False
        values_differ = False
        for position, (e, a) in enumerate(zip(e_leaves, a_leaves)):
            where = f"output {position}" if len(e_leaves) > 1 else "output"
            if isinstance(e, torch.Tensor):
                if not isinstance(a, Host):
                    return "failed", f"{where}: expected a tensor, got {type(a).__name__}"
                expected_type = "gpuwire" if e.device.type == "cpu" else e.device.type
                if a.device_type != expected_type:
                    return "failed", f"{where}: result on device {a.device_type!r}, expected {expected_type!r}"
                t = a.tensor
                if e.layout != torch.strided:
                    e = e.to_dense()
                if t.dtype != e.dtype:
                    return "failed", f"{where}: dtype {t.dtype}, expected {e.dtype}"
                if t.shape != e.shape:
                    return "failed", f"{where}: shape {tuple(t.shape)}, expected {tuple(e.shape)}"
                if shape_only:
                    continue
                try:
                    torch.testing.assert_close(t, e, rtol=0, atol=0, equal_nan=True, check_device=False)
                    continue
                except AssertionError as exc:
                    exact_error = str(exc)
                if random_op:
                    values_differ = True
                    continue
                try:
                    torch.testing.assert_close(t, e, equal_nan=True, check_device=False)
                    tolerant = True
                except AssertionError:
                    return "failed", f"{where}: values differ: {_first_lines(exact_error)}"
            else:
                if isinstance(a, Host):
                    return "failed", f"{where}: expected {type(e).__name__} {e!r}, got a tensor"
                if shape_only:
                    continue
                if not _same_value(e, a):
                    return "failed", f"{where}: expected {e!r}, got {a!r}"
        if shape_only or values_differ:
            return "shape_only", None
        return ("passed_tol" if tolerant else "passed"), None


class Host:
    """A downloaded device result and the device it was on."""

    __slots__ = ("tensor", "device_type")

    def __init__(self, tensor, device_type: str):
        self.tensor = tensor
        self.device_type = device_type


class Deadline:
    """SIGALRM after ``seconds`` raises SampleTimeout in the main thread (a blocking socket
    read is interrupted; a long C++ kernel only when it returns: the coordinator's hang
    watchdog covers that)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        return False


def _flatten(value, torch, path="r"):
    leaves, paths = [], []

    def walk(v, p):
        if isinstance(v, (list, tuple)) and not isinstance(v, torch.Size):
            paths.append(f"{p}:{'list' if isinstance(v, list) else 'tuple'}[{len(v)}]")
            for i, item in enumerate(v):
                walk(item, f"{p}.{i}")
        elif isinstance(v, dict):
            paths.append(f"{p}:dict{sorted(v)}")
            for k in sorted(v):
                walk(v[k], f"{p}.{k}")
        else:
            leaves.append(v)
            kind = "tensor" if isinstance(v, (torch.Tensor, Host)) else "value"
            paths.append(f"{p}:{kind}")

    walk(value, path)
    return leaves, paths


def _is_structseq(value) -> bool:
    return type(value).__module__ == "torch.return_types"


def _same_value(e, a) -> bool:
    if isinstance(e, float) and isinstance(a, float) and math.isnan(e) and math.isnan(a):
        return True
    if isinstance(e, complex) and isinstance(a, complex):
        return _same_value(e.real, a.real) and _same_value(e.imag, a.imag)
    try:
        return bool(e == a) and type(e) is type(a)
    except Exception:  # noqa: BLE001
        return False


def _short(paths) -> str:
    text = ",".join(paths)
    return text if len(text) < 200 else text[:200] + "…"


def _first_lines(text: str, n: int = 4) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[:n] if line.strip())


def _describe(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()
    first = message[0] if message else ""
    text = f"{type(exc).__name__}: {first}"
    if os.environ.get("OPINFO_TRACEBACK"):
        text += "\n" + "".join(traceback.format_exception(exc))
    return text[:1000] if not os.environ.get("OPINFO_TRACEBACK") else text


# ====================================================================== entry point


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="every OpInfo, every float32 sample")
    mode.add_argument("--sampled", action="store_true",
                      help=f"the fixed CI subset ({SAMPLED_OPS} ops, {SAMPLED_MAX_SAMPLES} samples each); the default")
    mode.add_argument("--ops", help="comma-separated OpInfo names (name or name.variant)")
    parser.add_argument("--out", required=False, help="path of the JSON results")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16", "float64", "complex64",
                                                             "int64", "int32", "int8", "uint8", "bool"),
                        help="dtype of the samples (default float32; half precision finds where shape "
                             "inference and the node's kernels disagree on mixed-precision outputs)")
    parser.add_argument("--max-samples", type=int, default=None, help="at most this many samples per op")
    parser.add_argument("--repeat", nargs="?", type=int, const=1, default=0, metavar="N",
                        help="run each device call N times (default 1) before the compared one, each on its own "
                             "copy of the sample, so the compared call takes the paths of a signature seen before "
                             "(once: the client's caches and C++ op kernels; twice: the node's native op loop too)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per sample (default 30)")
    parser.add_argument("--hang-timeout", type=float, default=180.0,
                        help="kill and restart a worker that reports nothing for this long (default 180 s)")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "auto"),
                        help="backend of the node this runner starts (ignored with GPUWIRE_NODE)")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and not args.out:
        parser.error("--out is required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results = coordinate(args)
    totals = results["totals"]
    print(f"opinfo ({results['mode']}): {totals['passed']}/{totals['samples']} samples passed "
          f"({100 * totals['pass_rate']:.2f}%; {totals['passed_tol']} within tolerance, "
          f"{totals['shape_only']} shape-only), {totals['ops_with_failures']} of {totals['ops_run']} ops with "
          f"failures, {totals['ops_skipped']} skipped, {totals['seconds']} s; results in {args.out}")
    for name, error in results["failures"].items():
        print(f"  FAIL {name}: {error[:400]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
