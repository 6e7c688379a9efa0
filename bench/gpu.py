"""Remote vs local CUDA: a GPT-2-small-sized training step and matmul TFLOPS.

Runs only where this process sees a CUDA GPU: a node is started on the same machine with
``--backend cuda`` and the same work is timed on the local GPU and through gpuwire
(loopback), alternately. Without CUDA it records one figure, "skipped: no CUDA", and
returns (status "skipped"); absolute GPU figures come only from a real GPU.

Figures: matmul TFLOPS (bf16 and fp32, N×N, a stream of matmuls then one synchronize) and
the median training-step time of GPT-2 small (12 layers, 12 heads, d=768, vocab 50257,
random init) at batch 8 × 512 tokens with AdamW, remote / local, in float32 and under
``torch.autocast(dtype=torch.bfloat16)`` (the faster the device's kernels, the more a step
depends on the client's and the node's per-op cost: bf16 is where a remote step shows it).
"""

from __future__ import annotations

import time

import torch

from .common import median

NAME = "gpu"
DESCRIPTION = "remote vs local CUDA (node --backend cuda on this machine): GPT-2-small step, matmul TFLOPS"


def run(ctx, result) -> None:
    if not torch.cuda.is_available():
        result.skip("no CUDA")
        return
    result.config["gpu"] = torch.cuda.get_device_name(0)
    compare(ctx, result, local_device="cuda", backend="cuda", matmul_n=8192,
            matmul_reps=20 if ctx.quick else 50, gpt=dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257,
                                                           n_positions=1024),
            batch=8, seq=512, steps=5 if ctx.quick else 10)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "gpuwire":
        import gpuwire
        gpuwire.synchronize()


def _matmul_seconds(a, b, reps: int) -> float:
    a @ b
    _sync(a.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(a.device)
    return time.perf_counter() - t0


def compare(ctx, result, *, local_device: str, backend: str, matmul_n: int, matmul_reps: int, gpt: dict,
            batch: int, seq: int, steps: int) -> None:
    """The measurements, parametrised so the code path can be exercised on CPU too."""
    ctx.attach(backend=backend)
    local, remote = torch.device(local_device), torch.device("gpuwire")
    result.config.update({"matmul_n": matmul_n, "matmul_reps": matmul_reps, "gpt2": gpt, "batch": batch, "seq": seq,
                          "steps": steps})
    for dtype in (torch.bfloat16, torch.float32):
        label = f"matmul {matmul_n}x{matmul_n} {str(dtype).replace('torch.', '')}"
        try:
            g = torch.Generator().manual_seed(0)
            a_h = torch.randn(matmul_n, matmul_n, generator=g).to(dtype)
            b_h = torch.randn(matmul_n, matmul_n, generator=g).to(dtype)
            flops = 2 * matmul_n ** 3 * matmul_reps
            la, lb = a_h.to(local), b_h.to(local)
            t_local = _matmul_seconds(la, lb, matmul_reps)
            del la, lb
            ra, rb = a_h.to(remote), b_h.to(remote)
            t_remote = _matmul_seconds(ra, rb, matmul_reps)
            del ra, rb
            result.add(label, flops / t_remote / 1e12, "TFLOPS", flops / t_local / 1e12,
                       baseline_label=f"local {local_device} TFLOPS")
        except Exception as exc:  # noqa: BLE001
            result.fail(label, exc)
    for amp in (False, True):
        label = f"GPT-2 ({gpt['n_layer']}L d{gpt['n_embd']}) train step b{batch}x{seq}{' bf16 autocast' if amp else ''}"
        try:
            _gpt_step(result, label, local, remote, gpt, batch, seq, steps, amp)
        except Exception as exc:  # noqa: BLE001
            result.fail(label, exc)


def _gpt_step(result, label, local, remote, gpt, batch, seq, steps, amp: bool = False) -> None:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(**gpt, bos_token_id=0, eos_token_id=0)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(2)]

    def make(device):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(model, opt, ids_host, device):
        ids = ids_host.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    sides = {"local": (local, *make(local)), "remote": (remote, *make(remote))}
    times = {"local": [], "remote": []}
    for i in range(2 + steps):
        for side, (device, model, opt) in sides.items():
            t0 = time.perf_counter()
            step(model, opt, batches[i % 2], device)
            if i >= 2:
                times[side].append(time.perf_counter() - t0)
    lm, rm = median(times["local"]) * 1e3, median(times["remote"]) * 1e3
    judged = local.type == "cuda" and not amp  # the target: float32 on a real GPU
    result.add(label, rm, "ms", lm, baseline_label=f"local {local.type} ms",
               target="<= 1.05x local" if judged else None, ok=(rm <= 1.05 * lm) if judged else None)
