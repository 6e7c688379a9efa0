"""The three training workloads shared by round_trips, step_ratio and latency.

Each workload builds a model, an AdamW optimizer and a few host batches, for a given device;
``step`` is one ordinary training step as a user writes it: batch to the device, forward,
loss, zero_grad, backward, optimizer step, ``loss.item()`` (the step's one sync point).
The remote and the local copy start from the same weights (same seed).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("mlp", "cnn", "gpt2")
DESCRIPTIONS = {
    "mlp": "MLP 784-512-512-10, batch 64",
    "cnn": "ResNet-style CNN (conv/bn/relu/pool/linear), 3x32x32, batch 32",
    "gpt2": "GPT-2 tiny (2 layers, 2 heads, d=64, vocab 256), batch 8 x 64 tokens",
}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.block1 = Block(32)
        self.down = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.block2 = Block(64)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _gpt2():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class Workload:
    """A model + optimizer + host batches on one device; ``step()`` returns the loss."""

    def __init__(self, kind: str, device, seed: int = 0, n_batches: int = 4):
        self.kind = kind
        self.device = torch.device(device)
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        if kind == "mlp":
            model = MLP()
            self.batches = [(torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g))
                            for _ in range(n_batches)]
        elif kind == "cnn":
            model = SmallResNet()
            self.batches = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g))
                            for _ in range(n_batches)]
        elif kind == "gpt2":
            model = _gpt2()
            self.batches = [(torch.randint(0, 256, (8, 64), generator=g),) for _ in range(n_batches)]
        else:
            raise ValueError(f"unknown model {kind!r}; one of {MODELS}")
        self.model = model.to(self.device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self._i = 0

    def step(self) -> float:
        batch = self.batches[self._i % len(self.batches)]
        self._i += 1
        if self.kind == "gpt2":
            (ids,) = (t.to(self.device) for t in batch)
            loss = self.model(ids, labels=ids).loss
        else:
            x, y = (t.to(self.device) for t in batch)
            loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()
