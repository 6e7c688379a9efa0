"""Small models and training loops shared by the end-to-end tests and the benchmarks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SmallResNet(nn.Module):
    """conv/bn/relu/pool/linear with a residual block."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.stem(x)
        x = F.relu(x + self.block(x))
        x = self.pool(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 50, hidden: int = 32, cell: str = "lstm"):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(hidden, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, ids):
        h, _ = self.rnn(self.embed(ids))
        return self.out(h)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, bos_token_id=0,
                      eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def train_classifier(model_fn, device, steps: int, optimizer: str = "sgd", batch=(8, 3, 16, 16), classes=10, seed=0):
    """Train from a fixed seed on generated data; return (losses, final state on CPU)."""
    torch.manual_seed(seed)
    model = model_fn().to(device)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x = torch.randn(*batch, generator=data).to(device)
        y = torch.randint(0, classes, (batch[0],), generator=data).to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}
