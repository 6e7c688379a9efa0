"""A training script written the usual CUDA way, with no mention of gpuwire.

    gpuwire run python examples/cuda_style_train.py          # GPU work on a gpuwire node
    python examples/cuda_style_train.py --force-cpu          # the same script on the local CPU

DataLoader with pin_memory, AMP autocast + GradScaler, checkpoint save and load.
"""

import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--force-cpu", action="store_true")
    parser.add_argument("--amp", action="store_true", help="mixed precision (autocast + GradScaler)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.force_cpu else "cpu"
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(args.steps * 16, 1, 28, 28, generator=g), torch.randint(0, 10, (args.steps * 16,), generator=g))
    loader = DataLoader(data, batch_size=16, shuffle=False, pin_memory=(device == "cuda"))

    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp and device == "cuda")
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device_type=device, dtype=torch.float16, enabled=args.amp and device == "cuda"):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        print(f"loss {loss.item():.6f}")

    path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    state = torch.load(path, map_location=device)
    model.load_state_dict(state["model"])
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"device {device} name {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(f"checksum {checksum:.10f}")


if __name__ == "__main__":
    main()
