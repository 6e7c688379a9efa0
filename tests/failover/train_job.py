"""The user program of the failover tests: a plain PyTorch training loop with AdamW.

``python train_job.py MODEL STEPS OUT [DEVICE]`` trains MODEL (cnn | gpt2) for STEPS steps on
DEVICE (default: gpuwire) and saves the final parameters to OUT (torch.save, on CPU). It
prints ``step N`` after each step (flushed), so a test can kill things at a chosen step.
JOB_SAVE_EVERY=K: ``torch.save`` the model every K steps (prints ``saving`` first);
JOB_UPLOAD_AT=N: at step N upload 64 MiB and fold it into the loss (prints ``uploading`` first).
Nothing in it knows about failover.
"""

import os
import sys

import torch
import torch.nn as nn


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "cnn":
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(0.1), nn.Linear(32, 10))
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32)
    return GPT2LMHeadModel(config)


def main() -> None:
    name, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "gpuwire")
    save_every = int(os.environ.get("JOB_SAVE_EVERY", "0"))
    upload_at = int(os.environ.get("JOB_UPLOAD_AT", "-1"))
    torch.backends.cuda.matmul.allow_tf32 = True  # as training scripts do: the node must keep it
    torch.set_float32_matmul_precision("high")
    model = build(name).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        if name == "cnn":
            x = torch.randn(8, 3, 16, 16, generator=data).to(device)
            y = torch.randint(0, 10, (8,), generator=data).to(device)
            loss = nn.functional.cross_entropy(model(x), y)
        else:
            ids = torch.randint(0, 97, (4, 16), generator=data).to(device)
            loss = model(ids, labels=ids).loss
        if step == upload_at:
            print("uploading", flush=True)
            big = torch.full((16 << 20,), 1e-9).to(device)
            loss = loss + big.sum() * 0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.item()
        if save_every and step % save_every == save_every - 1:
            print("saving", flush=True)
            torch.save(model.state_dict(), out + ".mid")
        print(f"step {step} loss {value:.6f}", flush=True)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out)
    if device.type == "gpuwire":  # what the node that finished the run computed with
        import gpuwire
        print("node precision", gpuwire.client.device.runtime().query("precision")["float32_matmul_precision"])
    print("done", flush=True)


if __name__ == "__main__":
    main()
