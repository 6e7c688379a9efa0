"""Remote CUDA equals local CUDA: ``python -m bench.gpu_check [--out DIR]`` on a machine with a GPU.

Sits beside ``bench.gpu`` (which times the same pair): it starts a ``gpuwire serve --backend cuda``
node on this machine, runs the same work on the local GPU and through gpuwire over loopback, and
says, section by section, whether the two agree bit for bit. Both sides run the same CUDA kernels
on the same card, so any difference is gpuwire's (a wrong layout, a lost flag, an RNG stream out of
step), not rounding. Each section is independent: one that raises is reported and the rest go on.
The local side runs first, in a child process that never imports gpuwire (PyTorch's autograd
serves one accelerator per process: pytorch/pytorch#161129), and hands its results over in a file.
Writes ``gpu_check.json`` (section -> verdict) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.utils._python_dispatch

from .common import Context

RESULTS: dict[str, object] = {}


def _cpu(t):
    return t.detach().to("cpu") if isinstance(t, torch.Tensor) else t


def _same(a, b) -> tuple[bool, float]:
    a, b = _cpu(a), _cpu(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False, float("inf")
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype == torch.bool or not a.is_floating_point():
        return bool(torch.equal(a, b)), float((a != b).sum())
    equal = bool(torch.equal(a, b) or (torch.isnan(a) == torch.isnan(b)).all() and
                 torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
    return equal, float((a.double() - b.double()).abs().nan_to_num().max()) if a.numel() else 0.0


def _syncer(dev: torch.device):
    import gpuwire
    return {"cuda": torch.cuda.synchronize, "gpuwire": gpuwire.synchronize}.get(dev.type, lambda: None)


CHECKS: dict = {}  # name -> (work(device) -> value on the host, compare(local, remote) -> verdict)


def _equal_verdict(local, remote):
    if isinstance(local, dict):
        bad = {}
        for key, value in local.items():
            same = _same(value, remote.get(key))[0] if isinstance(value, torch.Tensor) else value == remote.get(key)
            if not same:
                bad[key] = (_same(value, remote.get(key))[1] if isinstance(value, torch.Tensor)
                            and isinstance(remote.get(key), torch.Tensor) else (value, remote.get(key)))
        return f"all {len(local)} equal" if not bad else f"{len(local) - len(bad)}/{len(local)} equal; differ: {bad}"
    if isinstance(local, list):
        verdict = [(_same(a, b)[0] if isinstance(a, torch.Tensor) else a == b) for a, b in zip(local, remote)]
        return "all equal" if all(verdict) and len(local) == len(remote) else f"equal per item: {verdict}"
    return "equal" if local == remote else f"differ: local {local} remote {remote}"


def _both(local, remote):
    return {"local": local, "remote": remote}


def check(name, compare=_equal_verdict):
    def register(work):
        CHECKS[name] = (work, compare)
        return work
    return register


def _run_side(device: torch.device) -> dict:
    """Every check's work on ``device``: name -> value, or ("error", message)."""
    values = {}
    for name, (work, _) in CHECKS.items():
        try:
            values[name] = work(device)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next check
            traceback.print_exc()
            values[name] = ("error", f"{type(exc).__name__}: {exc}"[:500])
    return values


_G = torch.Generator().manual_seed(0)
X_H = torch.randn(64, 128, generator=_G)
W_H = torch.randn(128, 96, generator=_G)
IMG_H = torch.randn(4, 3, 32, 32, generator=_G)
K_H = torch.randn(8, 3, 3, 3, generator=_G)
IDX_H = torch.randint(0, 64, (200,), generator=_G)
F = torch.nn.functional

OPS = {
    "add": lambda x, w, img, k, idx: x + 1.5,
    "matmul fp32": lambda x, w, img, k, idx: x @ w,
    "matmul bf16": lambda x, w, img, k, idx: x.bfloat16() @ w.bfloat16(),
    "matmul fp16": lambda x, w, img, k, idx: x.half() @ w.half(),
    "softmax": lambda x, w, img, k, idx: torch.softmax(x, -1),
    "layer_norm": lambda x, w, img, k, idx: F.layer_norm(x, (128,)),
    "conv2d": lambda x, w, img, k, idx: F.conv2d(img, k, padding=1),
    "conv2d channels_last": lambda x, w, img, k, idx: F.conv2d(img.contiguous(memory_format=torch.channels_last), k,
                                                               padding=1),
    "sum/mean/var": lambda x, w, img, k, idx: torch.stack([x.sum(0), x.mean(0), x.var(0)]),
    "cumsum": lambda x, w, img, k, idx: x.cumsum(1),
    "sort": lambda x, w, img, k, idx: torch.sort(x, 1)[0],
    "topk": lambda x, w, img, k, idx: torch.topk(x, 5, 1)[1],
    "gelu tanh": lambda x, w, img, k, idx: F.gelu(x, approximate="tanh"),
    "index_select": lambda x, w, img, k, idx: x.index_select(0, idx),
    "embedding": lambda x, w, img, k, idx: F.embedding(idx, x),
    "cross_entropy": lambda x, w, img, k, idx: F.cross_entropy(x, idx[:64] % 128),
    "sdpa": lambda x, w, img, k, idx: F.scaled_dot_product_attention(*(x.view(2, 4, 8, 128),) * 3, is_causal=True),
    "sdpa bf16": lambda x, w, img, k, idx: F.scaled_dot_product_attention(*(x.bfloat16().view(2, 4, 8, 128),) * 3,
                                                                          is_causal=True),
    "fft": lambda x, w, img, k, idx: torch.fft.rfft(x),
    "linalg.solve": lambda x, w, img, k, idx: torch.linalg.solve(x[:, :64] + 64 * torch.eye(64, device=x.device),
                                                                 x[:, 64:]),
    "nonzero": lambda x, w, img, k, idx: (x > 1).nonzero(),
    "masked_select": lambda x, w, img, k, idx: x[x > 0.5],
}


def _small_cnn(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 8, 3), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 10)).to(dev, memory_format=torch.channels_last)


def _tiny_gpt2(dev):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128, bos_token_id=0,
                     eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(dev)
    torch.manual_seed(1)  # the draws after init: on --cpu, init and dropout share one generator
    return model, torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1)).to(dev)


def _train(model, loss_of, opt, steps: int, amp: bool = False) -> list:
    losses = []
    for _ in range(steps):
        with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=amp):
            loss = loss_of(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@check("ops: remote == local, bit for bit")
def _ops(dev):
    args = [t.to(dev) for t in (X_H, W_H, IMG_H, K_H, IDX_H)]
    out = {}
    for name, fn in OPS.items():
        try:
            out[name] = _cpu(fn(*args))
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


@check("op result strides: as local CUDA gives them")
def _op_strides(dev):
    args = [t.to(dev) for t in (X_H, W_H, IMG_H, K_H, IDX_H)]
    out = {}
    for name, fn in OPS.items():
        try:
            out[name] = fn(*args).stride()
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


@check("CNN channels-last: conv/bn/relu/pool, SGD 5 steps (cuDNN deterministic), losses bit for bit")
def _cnn(dev):
    with torch.backends.cudnn.flags(deterministic=True):
        model = _small_cnn(dev)
        xs = IMG_H.to(dev).contiguous(memory_format=torch.channels_last)
        ys = (IDX_H[:4] % 10).to(dev)
        return _train(model, lambda m: F.cross_entropy(m(xs), ys), torch.optim.SGD(model.parameters(), lr=0.1), 5)


@check("CNN channels-last: each gradient of one step (cuDNN deterministic), bit for bit")
def _cnn_grads(dev):
    with torch.backends.cudnn.flags(deterministic=True):
        model = _small_cnn(dev)
        xs = IMG_H.to(dev).contiguous(memory_format=torch.channels_last).requires_grad_()
        F.cross_entropy(model(xs), (IDX_H[:4] % 10).to(dev)).backward()
        grads = {name: _cpu(p.grad) for name, p in model.named_parameters()}
        grads.update({f"{name} strides": p.grad.stride() for name, p in model.named_parameters() if p.dim() == 4})
        return {**grads, "input": _cpu(xs.grad), "input strides": xs.grad.stride()}


class _OpTrace(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op on ``device_type``: its name, result strides and float64 checksum, in order
    (the client's own meta and host work, which the mode sees too, is left out)."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type
        self.entries = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        first = result[0] if isinstance(result, (tuple, list)) and result else result
        if isinstance(first, torch.Tensor) and first.device.type != self.device_type:
            return result
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            self.entries.append((str(func), tuple(first.stride()), float(first.detach().double().sum())))
        elif isinstance(first, torch.Tensor):
            self.entries.append((str(func), tuple(first.stride()), None))
        else:
            self.entries.append((str(func), None, None))
        return result


def _first_divergence(local, remote):
    """The first op, of those both sides ran (aligned by name: a fused op on one side may be
    several on the other), whose result differs in strides or checksum."""
    import difflib
    matcher = difflib.SequenceMatcher(a=[e[0] for e in local], b=[e[0] for e in remote], autojunk=False)
    aligned = 0
    for block in matcher.get_matching_blocks():
        for i, j in zip(range(block.a, block.a + block.size), range(block.b, block.b + block.size)):
            a, b = local[i], remote[j]
            if a[0].startswith(("aten.empty", "aten.new_empty")):
                a, b = a[:2], b[:2]  # (uninitialised memory)
            if a != b and not (a[:2] == b[:2] and a[2] != a[2] and b[2] != b[2]):  # (NaN checksums)
                return (f"{len(local)} vs {len(remote)} ops, {aligned} aligned and equal before: first difference "
                        f"at local op {i} / remote op {j}: local {a} remote {b}; before it: {local[max(0, i - 3):i]}")
            aligned += 1
    return f"all {aligned} aligned ops equal ({len(local)} local, {len(remote)} remote)"


@check("trace: a channels-last CNN step and 3 GPT-2 tiny fp32 steps op by op (strides, checksums)",
       compare=lambda a, b: {k: _first_divergence(a[k], b[k]) for k in a})
def _trace(dev):
    out = {}
    with torch.backends.cudnn.flags(deterministic=True):
        model = _small_cnn(dev)
        xs = IMG_H.to(dev).contiguous(memory_format=torch.channels_last)
        with _OpTrace(dev.type) as trace:
            F.cross_entropy(model(xs), (IDX_H[:4] % 10).to(dev)).backward()
        out["cnn"] = trace.entries
    model, ids = _tiny_gpt2(dev)
    with _OpTrace(dev.type) as trace:
        _train(model, lambda m: m(ids, labels=ids).loss, torch.optim.AdamW(model.parameters(), lr=1e-3), 3)
    out["gpt2"] = trace.entries
    return out


LAYOUT_FNS = {
    "relu": torch.relu,
    "conv": lambda t: F.conv2d(t, K_H.to(t.device)),
    "conv, channels-last weight": lambda t: F.conv2d(t.contiguous(), K_H.to(t.device).contiguous(
        memory_format=torch.channels_last)),
    "conv backward": lambda t: torch.autograd.grad(F.conv2d(t, K_H.to(t.device)).sum(), t)[0],
    "bn": lambda t: F.batch_norm(t, None, None, training=True),
    "maxpool": lambda t: F.max_pool2d(t, 2),
    "pad": lambda t: F.pad(t, (1, 1, 1, 1), mode="replicate"),
    "upsample": lambda t: F.interpolate(t, scale_factor=2),
    "group_norm": lambda t: F.group_norm(t, 1),
    "adaptive_avg_pool": lambda t: F.adaptive_avg_pool2d(t, 1),
}


@check("layouts: strides of results as local CUDA gives them")
def _layouts(dev):
    a = IMG_H.to(dev).contiguous(memory_format=torch.channels_last).requires_grad_()
    return {name: fn(a).stride() for name, fn in LAYOUT_FNS.items()}


@check("rng: torch.manual_seed gives local CUDA's streams")
def _rng(dev):
    torch.manual_seed(123)
    return [_cpu(torch.randn(1000, device=dev)), _cpu(torch.rand(7, device=dev)),
            _cpu(F.dropout(torch.ones(500, device=dev), 0.3)), _cpu(torch.randint(0, 100, (50,), device=dev)),
            _cpu(torch.randperm(40, device=dev))]


@check("training: MLP SGD 20 steps, losses bit for bit")
def _mlp(dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 10)).to(dev)
    torch.manual_seed(1)  # the draws after init: on --cpu, init and dropout share one generator
    xs, ys = X_H.to(dev), (IDX_H[:64] % 10).to(dev)
    return _train(model, lambda m: F.cross_entropy(m(xs), ys),
                  torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), 20)


@check("training: GPT-2 tiny AdamW 5 steps (dropout on), fp32 and bf16 autocast")
def _gpt(dev):
    out = {}
    for amp in (False, True):
        model, ids = _tiny_gpt2(dev)
        out["bf16" if amp else "fp32"] = _train(model, lambda m: m(ids, labels=ids).loss,
                                                torch.optim.AdamW(model.parameters(), lr=1e-3), 5, amp)
    return out


@check("per-op cost (x + 1, 1k floats, 5000 streamed, then one sync), µs/op", compare=_both)
def _per_op(dev):
    sync = _syncer(dev)
    x = torch.ones(1000, device=dev)
    for _ in range(200):
        x + 1
    sync()
    t0 = time.perf_counter()
    for _ in range(5000):
        x + 1
    sync()
    return round((time.perf_counter() - t0) / 5000 * 1e6, 2)


@check("bulk: 256 MiB from pageable host memory to the device and back, GiB/s", compare=_both)
def _bulk(dev):
    h = torch.randn(64 << 20)
    sync = _syncer(dev)
    d = h.to(dev)
    sync()
    t0 = time.perf_counter()
    d = h.to(dev)
    sync()
    t1 = time.perf_counter()
    back = d.cpu()
    t2 = time.perf_counter()
    assert torch.equal(back, h)
    return {"h2d": round(0.25 / (t1 - t0), 2), "d2h": round(0.25 / (t2 - t1), 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--cpu", action="store_true", help="check a CPU node against local CPU instead "
                        "(exercises this script where there is no GPU)")
    parser.add_argument("--local-side", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backend = "cpu" if args.cpu else "cuda"
    if args.local_side:  # the child: local work only, gpuwire never imported
        torch.save(_run_side(torch.device(backend)), args.local_side)
        return 0
    if backend == "cuda" and not torch.cuda.is_available():
        print("gpu_check: this machine has no CUDA GPU; nothing to check", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if backend == "cuda" else "none (--cpu)"
    print(f"torch {torch.__version__}, {gpu}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    local_runs = []
    for run in range(2):  # twice: a check whose local runs differ is not deterministic to begin with
        local_file = args.out / f"gpu_check.local{run}.pt"
        child = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--local-side", str(local_file),
                                *(["--cpu"] if args.cpu else [])],
                               env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
                               cwd=Path(__file__).resolve().parent.parent, timeout=600)
        if child.returncode != 0:
            print(f"gpu_check: the local side failed (exit {child.returncode})", file=sys.stderr)
            return 1
        local_runs.append(torch.load(local_file, weights_only=False))
        local_file.unlink()
    local = local_runs[0]
    print(f"[{time.perf_counter() - t0:6.1f} s] local side done (twice)", flush=True)
    ctx = Context(quick=False, threads=torch.get_num_threads())
    try:
        ctx.attach(backend=backend)
        remote = _run_side(torch.device("gpuwire"))
    finally:
        ctx.kill_all()
    for name, (_, compare) in CHECKS.items():
        a, b = local[name], remote[name]
        failed = [f"{side}: {v[1]}" for side, v in (("local", a), ("remote", b)) if isinstance(v, tuple) and
                  len(v) == 2 and v[0] == "error"]
        RESULTS[name] = "ERROR " + "; ".join(failed) if failed else compare(a, b)
        if not failed and compare is _equal_verdict and _equal_verdict(a, local_runs[1][name]) != \
                _equal_verdict(a, a):
            RESULTS[name] += f" [local runs differ from each other: {_equal_verdict(a, local_runs[1][name])}]"
        print(f"{name}: {RESULTS[name]}", flush=True)
    (args.out / "gpu_check.json").write_text(json.dumps({"torch": torch.__version__, "gpu": gpu,
                                                         "sections": RESULTS}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
