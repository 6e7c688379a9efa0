"""Remote CUDA equals local CUDA: ``python -m bench.gpu_check [--out DIR]`` on a machine with a GPU.

Sits beside ``bench.gpu`` (which times the same pair): it starts a ``gpuwire serve --backend cuda``
node on this machine, runs the same work on the local GPU and through gpuwire over loopback, and
says, section by section, whether the two agree bit for bit. Both sides run the same CUDA kernels
on the same card, so any difference is gpuwire's (a wrong layout, a lost flag, an RNG stream out of
step), not rounding. Each section is independent: one that raises is reported and the rest go on.
Writes ``gpu_check.json`` (section -> verdict) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

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


def section(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            verdict = fn()
        except Exception as exc:  # noqa: BLE001 - report and go on with the next section
            traceback.print_exc()
            verdict = f"ERROR {type(exc).__name__}: {exc}"[:500]
        RESULTS[name] = verdict
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}: {verdict}", flush=True)
        return fn
    return wrap


def run_checks(remote: torch.device, local: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    x_h = torch.randn(64, 128, generator=g)
    w_h = torch.randn(128, 96, generator=g)
    img_h = torch.randn(4, 3, 32, 32, generator=g)
    k_h = torch.randn(8, 3, 3, 3, generator=g)
    idx_h = torch.randint(0, 64, (200,), generator=g)
    ops = {
        "add": lambda x, w, img, k, idx: x + 1.5,
        "matmul fp32": lambda x, w, img, k, idx: x @ w,
        "matmul bf16": lambda x, w, img, k, idx: x.bfloat16() @ w.bfloat16(),
        "matmul fp16": lambda x, w, img, k, idx: x.half() @ w.half(),
        "softmax": lambda x, w, img, k, idx: torch.softmax(x, -1),
        "layer_norm": lambda x, w, img, k, idx: torch.nn.functional.layer_norm(x, (128,)),
        "conv2d": lambda x, w, img, k, idx: torch.nn.functional.conv2d(img, k, padding=1),
        "conv2d channels_last": lambda x, w, img, k, idx: torch.nn.functional.conv2d(
            img.contiguous(memory_format=torch.channels_last), k, padding=1),
        "sum/mean/var": lambda x, w, img, k, idx: torch.stack([x.sum(0), x.mean(0), x.var(0)]),
        "cumsum": lambda x, w, img, k, idx: x.cumsum(1),
        "sort": lambda x, w, img, k, idx: torch.sort(x, 1)[0],
        "topk": lambda x, w, img, k, idx: torch.topk(x, 5, 1)[1],
        "gelu tanh": lambda x, w, img, k, idx: torch.nn.functional.gelu(x, approximate="tanh"),
        "index_select": lambda x, w, img, k, idx: x.index_select(0, idx),
        "embedding": lambda x, w, img, k, idx: torch.nn.functional.embedding(idx, x),
        "cross_entropy": lambda x, w, img, k, idx: torch.nn.functional.cross_entropy(x, idx[:64] % 128),
        "sdpa": lambda x, w, img, k, idx: torch.nn.functional.scaled_dot_product_attention(
            *(x.view(2, 4, 8, 128),) * 3, is_causal=True),
        "sdpa bf16": lambda x, w, img, k, idx: torch.nn.functional.scaled_dot_product_attention(
            *(x.bfloat16().view(2, 4, 8, 128),) * 3, is_causal=True),
        "fft": lambda x, w, img, k, idx: torch.fft.rfft(x),
        "linalg.solve": lambda x, w, img, k, idx: torch.linalg.solve(x[:, :64] + 64 * torch.eye(64, device=x.device),
                                                                     x[:, 64:]),
        "nonzero": lambda x, w, img, k, idx: (x > 1).nonzero(),
        "masked_select": lambda x, w, img, k, idx: x[x > 0.5],
    }

    @section("ops: remote == local, bit for bit")
    def _ops():
        bad = {}
        args_l = [t.to(local) for t in (x_h, w_h, img_h, k_h, idx_h)]
        args_r = [t.to(remote) for t in (x_h, w_h, img_h, k_h, idx_h)]
        for name, fn in ops.items():
            try:
                same, diff = _same(fn(*args_l), fn(*args_r))
                if not same:
                    bad[name] = diff
            except Exception as exc:  # noqa: BLE001
                bad[name] = f"{type(exc).__name__}: {exc}"[:200]
        return f"all {len(ops)} equal" if not bad else f"{len(ops) - len(bad)}/{len(ops)} equal; differ: {bad}"

    @section("layouts: strides of results as local CUDA gives them")
    def _layouts():
        a_l = img_h.to(local).contiguous(memory_format=torch.channels_last)
        a_r = img_h.to(remote).contiguous(memory_format=torch.channels_last)
        fns = {"relu": torch.relu, "conv": lambda t: torch.nn.functional.conv2d(t, k_h.to(t.device)),
               "bn": lambda t: torch.nn.functional.batch_norm(t, None, None, training=True),
               "maxpool": lambda t: torch.nn.functional.max_pool2d(t, 2),
               "pad": lambda t: torch.nn.functional.pad(t, (1, 1, 1, 1), mode="replicate"),
               "upsample": lambda t: torch.nn.functional.interpolate(t, scale_factor=2)}
        bad = {n: (f(a_l).stride(), f(a_r).stride()) for n, f in fns.items() if f(a_l).stride() != f(a_r).stride()}
        return "all equal" if not bad else f"differ (local, remote): {bad}"

    @section("rng: torch.manual_seed gives local CUDA's streams")
    def _rng():
        out = {}
        for dev in (local, remote):
            torch.manual_seed(123)
            out[dev.type] = [torch.randn(1000, device=dev), torch.rand(7, device=dev),
                             torch.nn.functional.dropout(torch.ones(500, device=dev), 0.3),
                             torch.randint(0, 100, (50,), device=dev), torch.randperm(40, device=dev)]
        verdict = [_same(a, b)[0] for a, b in zip(out[local.type], out[remote.type])]
        return "all equal" if all(verdict) else f"equal per draw (randn, rand, dropout, randint, randperm): {verdict}"

    @section("training: MLP SGD 20 steps, losses bit for bit")
    def _mlp():
        losses = {}
        for dev in (local, remote):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(256, 10)).to(dev)
            torch.manual_seed(1)  # the draws after init: on --cpu, init and dropout share one generator
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            xs, ys = x_h.to(dev), (idx_h[:64] % 10).to(dev)
            losses[dev.type] = []
            for _ in range(20):
                loss = torch.nn.functional.cross_entropy(model(xs), ys)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses[dev.type].append(loss.item())
        return "equal" if losses[local.type] == losses[remote.type] else \
            f"differ: local {losses[local.type][-3:]} remote {losses[remote.type][-3:]}"

    @section("training: GPT-2 tiny AdamW 5 steps (dropout on), fp32 and bf16 autocast")
    def _gpt():
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
        transformers.logging.set_verbosity_error()
        cfg = GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1000, n_positions=128, bos_token_id=0,
                         eos_token_id=0)
        ids_h = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
        verdicts = {}
        for amp in (False, True):
            losses = {}
            for dev in (local, remote):
                torch.manual_seed(0)
                model = GPT2LMHeadModel(cfg).to(dev)
                torch.manual_seed(1)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                ids = ids_h.to(dev)
                losses[dev.type] = []
                for _ in range(5):
                    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                        loss = model(ids, labels=ids).loss
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses[dev.type].append(loss.item())
            verdicts["bf16" if amp else "fp32"] = ("equal" if losses[local.type] == losses[remote.type] else
                                                   f"differ: {losses[local.type]} vs {losses[remote.type]}")
        return verdicts

    @section("per-op client cost on a CUDA node (x + 1, 1k floats, 5000 streamed)")
    def _per_op():
        import gpuwire
        figures = {}
        for dev in (local, remote):
            x = torch.ones(1000, device=dev)
            for _ in range(200):
                x + 1
            sync = _syncer(dev)
            sync()
            t0 = time.perf_counter()
            for _ in range(5000):
                x + 1
            sync()
            figures[dev.type] = round((time.perf_counter() - t0) / 5000 * 1e6, 2)
        return {f"{k} µs/op": v for k, v in figures.items()}

    @section("bulk: 256 MiB host->device and back, GiB/s")
    def _bulk():
        import gpuwire
        h = torch.randn(64 << 20)
        figures = {}
        for dev in (local, remote):
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
            figures[f"{dev.type} h2d"] = round(0.25 / (t1 - t0), 2)
            figures[f"{dev.type} d2h"] = round(0.25 / (t2 - t1), 2)
        return figures

    @section("device facts through gpuwire")
    def _facts():
        import gpuwire
        return {"stats": str(gpuwire.stats())[:300]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--cpu", action="store_true", help="check a CPU node against local CPU instead "
                        "(exercises this script where there is no GPU)")
    args = parser.parse_args(argv)
    backend = "cpu" if args.cpu else "cuda"
    if backend == "cuda" and not torch.cuda.is_available():
        print("gpu_check: this machine has no CUDA GPU; nothing to check", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if backend == "cuda" else "none (--cpu)"
    print(f"torch {torch.__version__}, {gpu}", flush=True)
    ctx = Context(quick=False, threads=torch.get_num_threads())
    try:
        ctx.attach(backend=backend)
        run_checks(torch.device("gpuwire"), torch.device(backend))
    finally:
        ctx.kill_all()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps({"torch": torch.__version__,
                                                         "gpu": gpu,
                                                         "sections": RESULTS}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
