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

import json
import sys
import time
import traceback

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


def matmul_seconds(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> float:
    """Seconds for ``reps`` streamed n x n matmuls and one synchronize (after one warm-up)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype).to(device)
    b = torch.randn(n, n, generator=g).to(dtype).to(device)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return time.perf_counter() - t0


class GptTrainer:
    """GPT-2 (random init, seeded) with AdamW on ``device``; ``step(i)`` trains on batch i % 2."""

    def __init__(self, device: torch.device, gpt: dict, batch: int, seq: int, amp: bool):
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
        transformers.logging.set_verbosity_error()
        cfg = GPT2Config(**gpt, bos_token_id=0, eos_token_id=0)
        g = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(2)]
        self.device, self.amp = device, amp
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(cfg).to(device)
        torch.manual_seed(1)  # dropout's draws: the same stream on either side
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, i: int) -> tuple[float, float]:
        """(seconds, loss) of training step i."""
        issue, wait, loss = self.timed_step(i)
        return issue + wait, loss

    def timed_step(self, i: int) -> tuple[float, float, float]:
        """(seconds to issue the step's ops, seconds waiting for the loss, loss)."""
        forward, backward, optimizer, wait, loss = self.phased_step(i)
        return forward + backward + optimizer, wait, loss

    def phased_step(self, i: int) -> tuple[float, float, float, float, float]:
        """Seconds to issue the forward (the batch upload included), the backward and the
        optimizer step, then seconds waiting for the loss; and the loss."""
        t0 = time.perf_counter()
        ids = self.batches[i % 2].to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = self.model(ids, labels=ids).loss
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        value = loss.item()
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3, value


class LocalSide:
    """The local baseline, in a child process that never imports gpuwire.

    PyTorch's autograd engine serves one accelerator per process (pytorch/pytorch#161129):
    once gpuwire's PrivateUse1 device is registered, a CUDA backward in the same process trips
    ``opt_ready_stream && opt_parent_stream INTERNAL ASSERT``. So the local GPU work runs next
    door, one command at a time, interleaved with the remote work in this process."""

    def __init__(self, ctx, device: str):
        self.worker = ctx.worker([sys.executable, "-m", "bench.gpu", "--serve-local", device,
                                  "--threads", str(ctx.threads)], what=f"local {device} side",
                                 env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})

    def __call__(self, **command):
        self.worker.send(json.dumps(command))
        reply = json.loads(self.worker.readline(timeout=600))
        if "error" in reply:
            raise RuntimeError(f"local side: {reply['error']}\n{reply.get('traceback', '')}")
        return reply


def serve_local(device: str, threads: int) -> None:
    """The child's loop: a JSON command a line on stdin, a JSON reply a line on stdout."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    trainers: dict[str, GptTrainer] = {}
    for line in sys.stdin:
        command = json.loads(line)
        try:
            op = command.pop("op")
            if op == "matmul":
                reply = {"seconds": matmul_seconds(dev, getattr(torch, command["dtype"]), command["n"],
                                                   command["reps"])}
            elif op == "gpt":
                trainers[command["key"]] = GptTrainer(dev, command["gpt"], command["batch"], command["seq"],
                                                      command["amp"])
                reply = {}
            elif op == "gpt_step":
                seconds, loss = trainers[command["key"]].step(command["i"])
                reply = {"seconds": seconds, "loss": loss}
            elif op == "gpt_done":
                trainers.pop(command["key"], None)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                reply = {}
            else:
                raise ValueError(f"unknown command {op!r}")
        except Exception as exc:  # noqa: BLE001 - the parent reports it as the figure's failure
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def compare(ctx, result, *, local_device: str, backend: str, matmul_n: int, matmul_reps: int, gpt: dict,
            batch: int, seq: int, steps: int) -> None:
    """The measurements, parametrised so the code path can be exercised on CPU too."""
    ctx.attach(backend=backend)
    local = LocalSide(ctx, local_device)
    remote = torch.device("gpuwire")
    result.config.update({"matmul_n": matmul_n, "matmul_reps": matmul_reps, "gpt2": gpt, "batch": batch, "seq": seq,
                          "steps": steps, "local_side": "a child process without gpuwire (pytorch#161129)"})
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).replace("torch.", "")
        label = f"matmul {matmul_n}x{matmul_n} {name}"
        try:
            flops = 2 * matmul_n ** 3 * matmul_reps
            t_local = local(op="matmul", dtype=name, n=matmul_n, reps=matmul_reps)["seconds"]
            t_remote = matmul_seconds(remote, dtype, matmul_n, matmul_reps)
            result.add(label, flops / t_remote / 1e12, "TFLOPS", flops / t_local / 1e12,
                       baseline_label=f"local {local_device} TFLOPS")
        except Exception as exc:  # noqa: BLE001
            result.fail(label, exc)
    for amp in (False, True):
        label = f"GPT-2 ({gpt['n_layer']}L d{gpt['n_embd']}) train step b{batch}x{seq}{' bf16 autocast' if amp else ''}"
        try:
            _gpt_step(result, label, local, remote, local_device, gpt, batch, seq, steps, amp)
        except Exception as exc:  # noqa: BLE001
            result.fail(label, exc)
        finally:
            try:
                local(op="gpt_done", key=label)
            except Exception:  # noqa: BLE001 - the child is gone: the next figure says so
                pass


def _gpt_step(result, label, local, remote, local_device, gpt, batch, seq, steps, amp: bool) -> None:
    local(op="gpt", key=label, gpt=gpt, batch=batch, seq=seq, amp=amp)
    trainer = GptTrainer(remote, gpt, batch, seq, amp)
    times: dict[str, list] = {"local": [], "remote": []}
    losses: dict[str, list] = {"local": [], "remote": []}
    for i in range(2 + steps):
        reply = local(op="gpt_step", key=label, i=i)
        seconds, loss = trainer.step(i)
        losses["local"].append(reply["loss"])
        losses["remote"].append(loss)
        if i >= 2:
            times["local"].append(reply["seconds"])
            times["remote"].append(seconds)
    del trainer
    lm, rm = median(times["local"]) * 1e3, median(times["remote"]) * 1e3
    judged = local_device == "cuda" and not amp  # the issue's target: float32 on a real GPU
    same = losses["local"] == losses["remote"]
    note = "losses equal local's bit for bit"
    if not same:
        # is it gpuwire, or does local CUDA differ from itself (kernels with atomics)? Run it again
        local(op="gpt", key=label + " again", gpt=gpt, batch=batch, seq=seq, amp=amp)
        try:
            again = [local(op="gpt_step", key=label + " again", i=i)["loss"] for i in range(2 + steps)]
        finally:
            local(op="gpt_done", key=label + " again")
        note = _first_difference(losses["local"], losses["remote"], "local's") + "; " + (
            "local equals itself run again" if again == losses["local"] else
            _first_difference(losses["local"], again, "a second local run's"))
    result.add(label, rm, "ms", lm, baseline_label=f"local {local_device} ms",
               target="<= 1.05x local" if judged else None, ok=(rm <= 1.05 * lm) if judged else None, note=note)


def _first_difference(expected: list, got: list, whose: str) -> str:
    step = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    return (f"losses differ from {whose} from step {step} of {len(expected)} (warm-up included): "
            f"{expected[step]!r} vs {got[step]!r}; last {expected[-1]!r} vs {got[-1]!r}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description="The local side of the gpu benchmark "
                                     "(run by it: JSON commands on stdin, replies on stdout).")
    parser.add_argument("--serve-local", required=True, metavar="DEVICE")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    serve_local(args.serve_local, args.threads)
