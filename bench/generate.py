"""Text generation (Hugging Face ``generate``), remote over local, on the CPU backend.

Not one of the issue's training benchmarks, but what an inference user feels first: greedy
decoding of the tiny GPT-2 (bench/models.py) with a KV cache, 40 new tokens from an 8-token
prompt, batch 1. Each token is a forward pass over one position (~70 small ops, new shapes
every token as the cache grows) and a host read of the stopping check, so it measures the
per-op cost and the round trip together, not the bulk of any kernel. Remote and local runs
alternate; reported: median ms per token each side, the ratio, round trips per token, and
that both produce the same tokens.
"""

from __future__ import annotations

import time

import torch

from .common import median, quantiles
from .models import _gpt2

NAME = "generate"
DESCRIPTION = "HF generate() ms per token remote (CPU-backend node on loopback) / local CPU, tiny GPT-2, greedy"
NEW_TOKENS = 40
PROMPT = 8


class Generator:
    """The tiny GPT-2 on one device, greedy-decoding the same prompt."""

    def __init__(self, device):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = _gpt2().to(self.device).eval()
        self.prompt = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(0))

    def run(self) -> torch.Tensor:
        with torch.no_grad():
            out = self.model.generate(self.prompt.to(self.device), max_new_tokens=NEW_TOKENS,
                                      min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        return out.cpu()

    def timed(self) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        tokens = self.run()
        return (time.perf_counter() - t0) / NEW_TOKENS, tokens


def run(ctx, result) -> None:
    import gpuwire

    repetitions = 3 if ctx.quick else 10
    result.config.update({"new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT, "repetitions": repetitions,
                          "model": "GPT-2 tiny (2 layers, 2 heads, d=64, vocab 256), KV cache, greedy, batch 1"})
    try:
        ctx.attach()
        local, remote = Generator("cpu"), Generator(torch.device("gpuwire"))
        expected, got = local.run(), remote.run()  # warm-up (and the shapes of every token, learnt)
        if not torch.equal(expected, got):
            raise AssertionError(f"remote tokens {got.tolist()} differ from local {expected.tolist()}")
        lt, rt = [], []
        before = gpuwire.stats()
        for _ in range(repetitions):
            lt.append(local.timed()[0])
            seconds, got = remote.timed()
            rt.append(seconds)
        after = gpuwire.stats()
        if not torch.equal(expected, got):
            raise AssertionError(f"remote tokens {got.tolist()} differ from local {expected.tolist()}")
        lm, rm = median(lt) * 1e3, median(rt) * 1e3
        (l25, l75), (r25, r75) = quantiles(lt), quantiles(rt)
        result.add("tiny GPT-2 generate: time per token", rm, "ms", lm, baseline_label="local CPU ms",
                   note=f"IQR remote {r25 * 1e3:.2f}-{r75 * 1e3:.2f} ms, local {l25 * 1e3:.2f}-{l75 * 1e3:.2f} ms; "
                        "same tokens as local")
        tokens = repetitions * NEW_TOKENS
        result.add("tiny GPT-2 generate: round trips / token", (after["round_trips"] - before["round_trips"]) / tokens,
                   "rt/token", note=f"{(after['ops_sent'] - before['ops_sent']) / tokens:.1f} op messages per token")
    except Exception as exc:  # noqa: BLE001
        result.fail("generate", exc)
