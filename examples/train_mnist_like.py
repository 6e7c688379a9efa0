"""A small MNIST-style CNN trained on synthetic digits through gpuwire.

Runs on whatever node GPUWIRE_NODE names (else an embedded CPU node), and prints the loss
and where the work ran. Compare with `--device cpu` to see the same numbers locally.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuwire


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


def synthetic_digits(n: int, seed: int = 0):
    """Images whose class is written in their brightness pattern, so the net can learn it."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    for digit in range(10):
        rows = labels == digit
        images[rows, :, digit * 2:digit * 2 + 6, 4:24] += 1.0
    return images, labels


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="gpuwire", help="gpuwire (default) or cpu")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    images, labels = synthetic_digits(2048)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        total, correct, loss_sum = 0, 0, 0.0
        for i in range(0, len(images), args.batch_size):
            x = images[i:i + args.batch_size].to(device)
            y = labels[i:i + args.batch_size].to(device)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(y)
            correct += (logits.argmax(1) == y).sum().item()
            total += len(y)
        print(f"epoch {epoch + 1}: loss {loss_sum / total:.4f}  accuracy {correct / total:.3f}")
    elapsed = time.perf_counter() - start
    if device.type == "gpuwire":
        info = torch.gpuwire.get_device_properties()
        stats = gpuwire.stats()
        print(f"ran on gpuwire node {stats['node']}: {info.name} (backend {info.backend}); "
              f"{stats['ops_sent']} ops streamed, {stats['round_trips']} round trips, {elapsed:.1f} s")
    else:
        print(f"ran locally on {device}, {elapsed:.1f} s")


if __name__ == "__main__":
    main()
