"""Device tensors crossing processes, as a CUDA training script passes them; run under
``gpuwire run`` by test_sharing.py. Prints one line: RESULTS <json>."""
import json
import pickle
import sys
import warnings
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset


class OnTheGpu(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.full((2,), float(i), device="cuda")


def doubled(rank, tensor, parameter, queue):
    queue.put((rank, (tensor * 2).cpu().tolist(), str(tensor.device), type(parameter).__name__,
               parameter.requires_grad, parameter.cpu().tolist()))


def hogwild_step(weight, bias, queue):
    with torch.no_grad():  # (what each Hogwild trainer's optimizer does to the shared model)
        weight.add_(1)
        bias.mul_(2)
    queue.put("stepped")


def send_back(queue):
    queue.put(torch.arange(4.0, device="cuda") + 1)
    queue.put(torch.tensor([7], dtype=torch.int64, device="cuda").untyped_storage())


def use_inherited(tensor, queue):
    try:
        queue.put(("value", (tensor + 1).cpu().tolist()))
    except Exception as exc:  # noqa: BLE001
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    results = {}
    loader = DataLoader(OnTheGpu(), batch_size=3, num_workers=2, multiprocessing_context="spawn")
    results["loader"] = [[str(b.device), b.cpu().tolist()] for b in loader]
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    tensor = torch.arange(3.0, device="cuda")
    parameter = torch.nn.Parameter(torch.ones(2, device="cuda"))
    children = [spawn.Process(target=doubled, args=(rank, tensor, parameter, queue)) for rank in range(2)]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for child in children:
            child.start()
    results["copy warnings, not shared"] = [str(w.message) for w in said]
    results["arguments"] = sorted(queue.get(timeout=120) for _ in children)
    sender = spawn.Process(target=send_back, args=(queue,))
    sender.start()
    back = queue.get(timeout=120)
    storage = queue.get(timeout=60)
    results["queue"] = [str(back.device), back.cpu().tolist(), storage.device.type != "cpu",
                        torch.empty(0, dtype=torch.int64, device=storage.device).set_(storage).cpu().tolist()]
    for child in children + [sender]:
        child.join(60)
    results["exit codes"] = [child.exitcode for child in children + [sender]]
    hogwild = torch.nn.Linear(2, 2).cuda()
    with torch.no_grad():
        hogwild.weight.fill_(1)
        hogwild.bias.fill_(3)
    hogwild.share_memory()  # (Hogwild training: the program expects the children's writes)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainers = [spawn.Process(target=hogwild_step, args=(hogwild.weight, hogwild.bias, queue)) for _ in range(2)]
        for trainer in trainers:
            trainer.start()
            queue.get(timeout=120)
            trainer.join(60)
    results["hogwild"] = [hogwild.weight.tolist(), hogwild.bias.tolist(), [t.exitcode for t in trainers]]
    results["copy warnings, shared"] = [str(w.message) for w in said]
    try:
        ForkingPickler.dumps(torch.ones(2, device="cuda", requires_grad=True) * 2)
        results["non-leaf"] = "pickled"
    except RuntimeError as exc:
        results["non-leaf"] = str(exc)
    results["plain pickle"] = pickle.loads(pickle.dumps(tensor)).cpu().tolist()
    fork = mp.get_context("fork")
    forked_queue = fork.Queue()
    forked = fork.Process(target=use_inherited, args=(tensor, forked_queue))
    forked.start()
    results["fork"] = forked_queue.get(timeout=120)
    forked.join(60)
    print("RESULTS " + json.dumps(results), flush=True)
    sys.exit(0)
