"""``torch.distributed`` on gpuwire tensors: DistributedDataParallel and collectives, in real
rank processes, compared with the same ranks on local CPU with gloo.

Collective libraries read device memory directly, so gpuwire stages each collective through
the host (``client.distributed``); ``init_process_group("nccl")`` under ``gpuwire run`` (NCCL
needs local GPUs) and ``"gloo"`` natively both get it for gpuwire tensors."""

import glob
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest


def _descendants(pid: int) -> list[int]:
    """Every process started under ``pid``, from /proc (torchrun starts its ranks in sessions of
    their own, which a kill of the launcher's process group does not reach)."""
    found, pending = [], [pid]
    while pending:
        parent = pending.pop()
        for children in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(children) as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            pending += kids
    return found


def _run_job(command, timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a launcher and the ranks it starts, in a process group of their own:
    past ``timeout`` (under the tests' own 300 s) the launcher and every process under it are
    killed: the ranks of a hung job outlived the launcher."""
    import signal
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        started = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        raise AssertionError(f"the job did not finish in {timeout:.0f} s:\n{out[-2000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, out, err)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    rank, world, port, device, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    if device == "gpuwire":
        import gpuwire
        gpuwire.attach(sys.argv[6])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=None if device == "cpu" else [0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        loss = ddp(torch.randn(8, 6, generator=data).to(device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    total = torch.tensor([float(rank + 1)]).to(device)
    dist.all_reduce(total)
    gathered = [torch.zeros(2).to(device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)).to(device))
    sent = torch.tensor([float(rank)]).to(device)
    dist.broadcast(sent, src=world - 1)
    dist.barrier()
    if backend == "gloo":  # (gloo's own; PyTorch refuses it for NCCL, on CUDA too)
        import datetime
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    reduced = torch.tensor([float(rank + 1)]).to(device)
    dist.reduce(reduced, dst=0)
    collected = [torch.zeros(1).to(device) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank * 10)]).to(device), collected, dst=0)
    piece = torch.zeros(1).to(device)
    dist.scatter(piece, [torch.tensor([float(i + 5)]).to(device) for i in range(world)] if rank == 0 else None, src=0)
    extra = [reduced.item() if rank == 0 else None, [c.item() for c in collected] if collected else None, piece.item()]
    whole = torch.zeros(2 * world).to(device)
    dist.all_gather_into_tensor(whole, torch.full((2,), float(rank)).to(device))
    part = torch.zeros(2).to(device)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * world).add(rank).to(device))
    extra += [whole.cpu().tolist(), part.cpu().tolist()]
    weights = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    print("RESULT", rank, weights.tolist(), total.item(), [g.cpu().tolist() for g in gathered], sent.item(), extra, flush=True)
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

GLOO_EXIT_ABORT = "terminate called without an active exception"


def _two_ranks(script, *args, launcher=(), env=None, timeout: float = 150, marks=("RESULT",)) -> list[str]:
    """The lines starting with one of ``marks`` that ``script args`` prints as two torchrun ranks
    (behind ``launcher``, e.g. ``gpuwire run``), sorted; the job must succeed."""
    def run():
        command = [*launcher, sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                   f"--master_port={free_port()}", str(script), *args]
        return _run_job(command, cwd=REPO, timeout=timeout, env=env)

    def finished(done) -> bool:  # (every rank printed its results: the work was done)
        return sum(line.startswith(marks) for line in done.stdout.splitlines()) >= 2

    done = run()
    for _ in range(2):
        if done.returncode == 0 or GLOO_EXIT_ABORT not in done.stderr or launcher and not finished(done):
            break
        # plain PyTorch's gloo threads can abort a rank at interpreter exit (pytorch/pytorch#179291;
        # it failed CI runs of the DDP comm-hooks and the FSDP2 checkpoint tests' reference runs);
        # that says nothing about gpuwire, so the reference is computed again. A gpuwire run uses
        # gloo too (its collectives run on host copies): it gets a second try only where the abort
        # came at exit, after every rank printed its results (seen once, session 37's CI, in the
        # Hugging Face FSDP Trainer test); an abort before that fails the test.
        done = run()
    assert done.returncode == 0, done.stderr[-3000:]
    return sorted(line for line in done.stdout.splitlines() if line.startswith(marks))


def _gpuwire_run(node) -> tuple:
    return (sys.executable, "-m", "gpuwire", "run", "--node", node.address, "-q", "--")


def native_builds() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None and os.environ.get("GPUWIRE_NATIVE", "1") != "0"



def run_ranks(world: int, command) -> list[str]:
    port = str(free_port())
    procs = [subprocess.Popen(command(rank, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for rank in range(world)]
    lines = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            lines.extend(line for line in out.splitlines() if line.startswith("RESULT"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return sorted(lines)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "ddp.py"
    path.write_text(SCRIPT)
    return str(path)


def test_two_rank_ddp_with_nccl_under_gpuwire_run_matches_cpu_gloo(node, script):
    remote = run_ranks(2, lambda rank, port: [sys.executable, "-m", "gpuwire", "run", "--node", node.address, "-q",
                                              "--", sys.executable, script, str(rank), "2", port, "cuda", "nccl"])
    local = run_ranks(2, lambda rank, port: [sys.executable, script, str(rank), "2", port, "cpu", "gloo"])
    assert len(remote) == 2 and remote == local


def test_single_rank_ddp_with_gloo_on_the_gpuwire_device(node, script):
    remote = run_ranks(1, lambda rank, port: [sys.executable, script, "0", "1", port, "gpuwire", "gloo",
                                              node.address])
    local = run_ranks(1, lambda rank, port: [sys.executable, script, "0", "1", port, "cpu", "gloo"])
    assert len(remote) == 1 and remote == local


SYNC_BATCH_NORM = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    rank, world, port = int(sys.argv[1]), 2, sys.argv[2]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("nccl", rank=rank, world_size=world)

    def make():
        torch.manual_seed(0)
        bn = nn.BatchNorm2d(3)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        return bn

    # ranks of unequal batches; the reference: one BatchNorm over both batches, on the local CPU
    xs = [torch.randn(2 + r, 3, 4, 4, generator=torch.Generator().manual_seed(10 + r)) for r in range(world)]
    ref = make()
    full = torch.cat(xs).requires_grad_()
    ref_out = ref(full)
    weights = torch.arange(ref_out.numel()).reshape(ref_out.shape).float().sin()
    (ref_out * weights).sum().backward()
    mine = slice(sum(x.shape[0] for x in xs[:rank]), sum(x.shape[0] for x in xs[:rank + 1]))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(make())).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    x = xs[rank].cuda().requires_grad_()
    out = ddp(x)
    (out * weights[mine].cuda()).sum().backward()
    bn = model[0]
    print("RESULT", rank, [torch.allclose(out.cpu(), ref_out[mine].detach(), atol=1e-5),
                           torch.allclose(x.grad.cpu(), full.grad[mine], atol=1e-5),
                           torch.allclose(bn.running_mean.cpu(), ref.running_mean, atol=1e-6),
                           torch.allclose(bn.running_var.cpu(), ref.running_var, atol=1e-6),
                           torch.allclose(bn.weight.grad.cpu(), ref.weight.grad / world, atol=1e-5),
                           torch.allclose(bn.bias.grad.cpu(), ref.bias.grad / world, atol=1e-5)], flush=True)
    dist.destroy_process_group()
""")


def test_sync_batch_norm_across_two_ranks_matches_one_batch_norm_over_both_batches(node, tmp_path):
    """``nn.SyncBatchNorm`` (DDP scripts' ``--sync-bn``) runs CUDA-only ops (``batch_norm_stats``
    and four more), which a CPU node computes after CUDA's arithmetic, and gathers statistics
    with ``all_gather_single``, which the host-staged collectives cover."""
    path = tmp_path / "sync_bn.py"
    path.write_text(SYNC_BATCH_NORM)
    lines = run_ranks(2, lambda rank, port: [sys.executable, "-m", "gpuwire", "run", "--node", node.address, "-q",
                                             "--", sys.executable, str(path), str(rank), port])
    assert lines == [f"RESULT {rank} [True, True, True, True, True, True]" for rank in range(2)]


def test_processes_that_do_not_use_gpuwire_keep_torch_defaults(monkeypatch):
    # the backend autoload imports gpuwire everywhere: a program on real GPUs must keep NCCL
    from gpuwire.client import distributed
    monkeypatch.setattr(distributed, "_gpuwire_in_use", lambda: False)
    assert [distributed.with_gpuwire(b) for b in (None, "gloo", "nccl")] == [None, "gloo", "nccl"]
    monkeypatch.setattr(distributed, "_gpuwire_in_use", lambda: True)
    staged = "cpu:gloo,cuda:gloo,gpuwire:gpuwire"
    assert [distributed.with_gpuwire(b) for b in (None, "gloo", "nccl")] == [staged] * 3
    assert distributed.with_gpuwire("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"  # an explicit map is kept


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    device_type = sys.argv[1]
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":  # the launcher's convention: local rank i drives cuda:i
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
        ids = [local_rank]
    else:
        device, ids = torch.device("cpu"), None
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7 + dist.get_rank())
    for _ in range(3):
        loss = ddp(torch.randn(4, 6, generator=data).to(device)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    where = [torch.cuda.current_device(), torch.cuda.device_count(), str(next(model.parameters()).device)] \\
        if device_type == "cuda" else [local_rank, 2, f"cuda:{local_rank}"]
    weights = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    # one write per line: the two ranks share the pipe, unbuffered under gpuwire run
    sys.stdout.write(f"RESULT {dist.get_rank()} {where} {weights.tolist()}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
""")


def test_torchrun_ranks_each_drive_cuda_local_rank_under_gpuwire_run(node, tmp_path):
    # torchrun (accelerate, deepspeed) gives local rank i the GPU cuda:i: torch.cuda.set_device(
    # local_rank) and DDP(device_ids=[local_rank]) raised "gpuwire device 1 does not exist"
    path = tmp_path / "torchrun_ddp.py"
    path.write_text(TORCHRUN_SCRIPT)
    # (through ``_two_ranks``: the plain-PyTorch reference run is retried on gloo's exit abort)
    remote = _two_ranks(path, "cuda", launcher=_gpuwire_run(node), timeout=240)
    local = _two_ranks(path, "cpu", timeout=240)
    assert len(remote) == 2 and remote == local


FSDP_SCRIPT = textwrap.dedent("""
    import hashlib, os, sys, torch, torch.nn as nn, torch.distributed as dist
    kind = sys.argv[1]
    if kind.endswith("native"):  # the gpuwire device by its own name, gloo for the host
        import gpuwire
        device = torch.device("gpuwire")
        dist.init_process_group("gloo")
    else:  # a CUDA script under gpuwire run
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        model = FullyShardedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)  # the same batch on every rank: the gradient is one rank's
    x, y = torch.randn(8, 32, generator=data).to(device), torch.randint(0, 4, (8,), generator=data).to(device)
    losses = []
    for _ in range(4):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the trained weights, gathered whole (DTensor's functional collectives under FSDP2)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256(torch.cat([v.flatten().cpu() for v in state.values()]).numpy().tobytes()).hexdigest()
    sys.stdout.write(f"RESULT {dist.get_rank()} {list(state)} {digest} {losses}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("kind", ["fsdp1", "fsdp2", "fsdp2-native"])
def test_fsdp_across_two_ranks_under_gpuwire_run_trains_as_one_process_does(node, tmp_path, kind):
    """FSDP (``FullyShardedDataParallel`` and FSDP2's ``fully_shard``; a CUDA script under gpuwire
    run, and FSDP2 on the gpuwire device by name, which needed ``torch.gpuwire.Stream`` & co.) shards
    parameters over the ranks, gathers them for each layer and reduce-scatters the gradients. Both failed before:
    FSDP frees a flat parameter's memory with ``storage.resize_(0)``, which a Python device could
    not do; FSDP2's DeviceMesh read the name of a group with no backend ("ProcessGroup name not
    set"), compared parameters on ``cuda:i`` with an accelerator named otherwise, and reduced its
    gradients in a backward callback that made tensors on "cuda" outside the compatibility mode.
    With the same batch on both ranks the averaged gradient is one rank's, exactly: the losses,
    and the trained weights gathered whole (``get_model_state_dict(full_state_dict=True)``, which
    under FSDP2 runs DTensor's functional collectives: "No backend type associated with device
    type gpuwire" before), equal one process training alone on the CPU, bit for bit."""
    import torch
    path = tmp_path / "fsdp_train.py"
    path.write_text(FSDP_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
               str(path), kind]
    if not kind.endswith("native"):
        command = [sys.executable, "-m", "gpuwire", "run", "--node", node.address, "-q", "--", *command]
    done = _run_job(command, cwd=REPO,
                          env={**os.environ, "GPUWIRE_NODE": node.address})
    assert done.returncode == 0, done.stderr[-3000:]
    results = sorted(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 32, generator=data), torch.randint(0, 4, (8,), generator=data)
    expected = []
    for _ in range(4):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    import hashlib
    names = list(model.state_dict())
    digest = hashlib.sha256(torch.cat([v.flatten() for v in model.state_dict().values()]).numpy().tobytes()).hexdigest()
    assert results == [f"RESULT 0 {names} {digest} {expected}", f"RESULT 1 {names} {digest} {expected}"]


HF_FSDP_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=3, report_to=[],
                             fsdp="full_shard", save_strategy="no", use_cpu=sys.argv[2] == "cpu")
    result = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens()).train()
    sys.stdout.write(f"RESULT {os.environ['RANK']} {result.training_loss!r}\\n")
""")


def test_transformers_trainer_with_fsdp_under_gpuwire_run_matches_cpu_gloo(node, tmp_path):
    """A Hugging Face ``Trainer(fsdp="full_shard")`` script, two ranks under torchrun: accelerate
    applies FSDP2 to the model while it is on the CPU, moving each parameter with
    ``param.data = param.to(device)`` ("incompatible tensor type" for the gpuwire device before).
    Each rank's training loss equals the same rank's on CPU with gloo, bit for bit."""
    path = tmp_path / "hf_fsdp.py"
    path.write_text(HF_FSDP_SCRIPT)
    # (through ``_two_ranks``: a run whose gloo threads abort at exit is retried, the gpuwire run
    # only once both ranks printed their loss: hence a line from each)
    remote = _two_ranks(path, str(tmp_path / "cuda"), "cuda", launcher=_gpuwire_run(node), timeout=240)
    local = _two_ranks(path, str(tmp_path / "cpu"), "cpu", timeout=240)
    assert len(remote) == 2 and remote == local


FUNCTIONAL_COLLECTIVES_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, group = dist.get_rank(), dist.group.WORLD
    t = torch.arange(4.0, device="cuda") + rank
    results = [funcol.all_reduce(t, "sum", group), funcol.all_reduce(t, "avg", group),
               funcol.all_gather_tensor(t, 0, group), funcol.reduce_scatter_tensor(t, "sum", 0, group),
               funcol.broadcast(t, 1, group)]
    in_place = t.clone()
    torch.ops._c10d_functional.all_reduce_(in_place, "max", group.group_name)
    sys.stdout.write(f"RESULT {rank} {[r.tolist() for r in results]} {in_place.tolist()}\\n")
    # the rest of the family (DTensor's redistributions, compiled graphs)
    c10d = torch.ops._c10d_functional
    gathered, broadcast = torch.empty(8, device="cuda"), t.clone()
    c10d.all_gather_into_tensor_out(t, 2, group.group_name, out=gathered)
    c10d.broadcast_(broadcast, 0, group.group_name)
    more = [funcol.all_to_all_single(torch.arange(4.0, device="cuda") + 10 * rank, [2, 2], [2, 2], group),
            *funcol.all_reduce_coalesced([t, t * 2], "sum", group), gathered, broadcast,
            funcol.all_reduce(torch.tensor([7, -3], device="cuda") * (rank + 1), "avg", group)]
    sys.stdout.write(f"MORE {rank} {[r.tolist() for r in more]}\\n")
    # hundreds of collectives whose results are dropped at once: gloo's worker thread releasing a
    # finished one (under its queue's lock, needing the GIL for the host copy's Python object)
    # while this thread, holding the GIL, queued the next, deadlocked every run
    for _ in range(300):
        funcol.all_reduce(t, "sum", group)
        funcol.all_gather_tensor(t, 0, group)
    sys.stdout.write(f"DONE {rank}\\n")
    dist.destroy_process_group()
""")


def test_dtensors_functional_collectives_on_gpuwire_tensors(node, tmp_path):
    """``torch.distributed._functional_collectives`` (what DTensor and FSDP2's state dicts call)
    on device tensors: their kernels found no backend for the gpuwire device; they run on host
    copies through gloo now, "avg" (which gloo lacks) included, and hundreds in a row do not
    deadlock."""
    path = tmp_path / "funcol.py"
    path.write_text(FUNCTIONAL_COLLECTIVES_SCRIPT)
    command = [sys.executable, "-m", "gpuwire", "run", "--node", node.address, "-q", "--", sys.executable, "-m",
               "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", str(path)]
    done = _run_job(command, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    results = sorted(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    common = "[1.0, 3.0, 5.0, 7.0], [0.5, 1.5, 2.5, 3.5], [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]"
    assert results == [f"RESULT 0 [{common}, [1.0, 3.0], [1.0, 2.0, 3.0, 4.0]] [1.0, 2.0, 3.0, 4.0]",
                       f"RESULT 1 [{common}, [5.0, 7.0], [1.0, 2.0, 3.0, 4.0]] [1.0, 2.0, 3.0, 4.0]"]
    more = sorted(line for line in done.stdout.splitlines() if line.startswith("MORE"))
    common = "[1.0, 3.0, 5.0, 7.0], [2.0, 6.0, 10.0, 14.0], [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 2.0, 3.0]"
    # (an integer "avg" truncates, as NCCL's: (7 + 14) / 2 -> 10, (-3 - 6) / 2 -> -4)
    assert more == [f"MORE 0 [[0.0, 1.0, 10.0, 11.0], {common}, [10, -4]]",
                    f"MORE 1 [[2.0, 3.0, 12.0, 13.0], {common}, [10, -4]]"]
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("DONE")) == ["DONE 0", "DONE 1"]


POINT_TO_POINT_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    where = sys.argv[1]
    dist.init_process_group("nccl" if where == "cuda" else "gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    if where == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    t = torch.arange(3.0, device=where) * (rank + 1)
    got = torch.empty(3, device=where)
    if rank == 0:  # blocking, in opposite orders on the two ranks
        dist.send(t, dst=1)
        dist.recv(got, src=1)
    else:
        dist.recv(got, src=0)
        dist.send(t, dst=0)
    # both ranks queue their send first: completes only if a send does not wait when it is queued
    swapped = torch.empty(3, device=where)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t * 10, peer), dist.P2POp(dist.irecv, swapped, peer)]):
        work.wait()
    ring = torch.empty(3, device=where)
    sent, received = dist.isend(t + 100, peer, tag=7), dist.irecv(ring, peer, tag=7)
    sent.wait()
    received.wait()
    a2a = torch.empty(4, device=where)
    dist.all_to_all_single(a2a, torch.arange(4.0, device=where) + 10 * rank)
    reduced = t.clone()
    dist.reduce(reduced, dst=0)
    gathered = [None, None]
    dist.all_gather_object(gathered, {"rank": rank, "device": str(t.device.type)})
    values = [got, swapped, ring, a2a, reduced if rank == 0 else torch.zeros(())]
    sys.stdout.write(f"RESULT {rank} {[v.tolist() for v in values]} {gathered}\\n")
    sys.stdout.write(f"BACKEND {rank} {dist.get_backend()}\\n")
    if where == "cuda":  # the list forms gloo lacks on the host
        parts = [torch.empty(2, device=where) for _ in range(2)]
        dist.all_to_all(parts, [torch.full((2,), float(rank * 10 + i), device=where) for i in range(2)])
        scattered = torch.empty(2, device=where)
        dist.reduce_scatter(scattered, [torch.full((2,), float(rank + i), device=where) for i in range(2)])
        sys.stdout.write(f"LISTS {rank} {[p.tolist() for p in parts]} {scattered.tolist()}\\n")
    # pipeline parallelism: a GPipe schedule over two stages (its activations and gradients go
    # between the ranks by isend/irecv)
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    torch.manual_seed(0)
    halves = [nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))]
    device = torch.device(where, int(os.environ["LOCAL_RANK"])) if where == "cuda" else torch.device("cpu")
    half = halves[rank].to(device)
    schedule = ScheduleGPipe(PipelineStage(half, rank, 2, device), n_microbatches=4, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(half.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y, losses = torch.randn(8, 16, generator=data).to(device), torch.randn(8, 4, generator=data).to(device), []
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad()
    weights = [p.detach().cpu().sum().item() for p in half.parameters()]
    sys.stdout.write(f"PIPE {rank} {weights} {[l.item() for l in losses]}\\n")
    dist.destroy_process_group()
""")


def test_point_to_point_and_all_to_all_on_gpuwire_tensors_match_cpu_gloo(node, tmp_path):
    """``dist.send``/``recv``, ``isend``/``irecv`` and ``batch_isend_irecv`` (pipeline
    parallelism, ring exchanges; a GPipe schedule runs here) on device tensors raised "No backend type associated with
    device type gpuwire"; with both ranks sending first they must not block each other. Results
    equal the same script's on CPU with gloo; the list forms of all-to-all and reduce-scatter,
    which gloo lacks on the host, equal their definitions."""
    path = tmp_path / "p2p.py"
    path.write_text(POINT_TO_POINT_SCRIPT)

    marks = ("RESULT", "LISTS", "PIPE", "BACKEND")
    remote = _two_ranks(path, "cuda", launcher=_gpuwire_run(node), timeout=120, marks=marks)
    local = _two_ranks(path, "cpu", timeout=120, marks=marks)
    # the program asked for "nccl" and is told so (it was the device map gpuwire gave c10d)
    assert [line for line in remote if line.startswith("BACKEND")] == ["BACKEND 0 nccl", "BACKEND 1 nccl"]
    assert [line for line in local if line.startswith("BACKEND")] == ["BACKEND 0 gloo", "BACKEND 1 gloo"]
    assert ([line.replace("'cuda'", "'cpu'") for line in remote if line.startswith(("RESULT", "PIPE"))]
            == [line for line in local if line.startswith(("RESULT", "PIPE"))])
    assert len(local) == 6 and "[0.0, 20.0, 40.0]" in local[4]  # (RESULT 0) rank 0 received rank 1's t * 10
    assert [line for line in remote if line.startswith("LISTS")] == [
        "LISTS 0 [[0.0, 0.0], [10.0, 10.0]] [1.0, 1.0]",  # rank r gets element r of every rank's list
        "LISTS 1 [[1.0, 1.0], [11.0, 11.0]] [3.0, 3.0]"]  # sum over ranks of element r: (0+1), (1+2)


TENSOR_PARALLEL_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    where = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)).to(where)
    # (as pytorch/examples' tensor_parallel_example.py: the mesh starts the default group itself)
    mesh = init_device_mesh(where, (int(os.environ["WORLD_SIZE"]),))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.25, foreach=True)
    for step in range(3):
        torch.manual_seed(step)
        loss = model(torch.rand(20, 10, device=where)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    shard = model[0].weight.to_local().detach().cpu()
    sys.stdout.write(f"RESULT {dist.get_rank()} {loss.item()!r} {shard.sum().item()!r} {list(shard.shape)}\\n")
    dist.destroy_process_group()
""")


def test_tensor_parallelism_under_gpuwire_run_matches_cpu_gloo(node, tmp_path):
    """``parallelize_module`` with ``init_device_mesh("cuda")``, as pytorch/examples' tensor
    parallel script: the mesh started NCCL (its own call of ``init_process_group``), and
    DTensor's collective results, wrapped with the "cuda" their device reads as, aborted the
    process in C++. Losses and each rank's weight shard equal CPU gloo's bit for bit."""
    path = tmp_path / "tp.py"
    path.write_text(TENSOR_PARALLEL_SCRIPT)

    remote = _two_ranks(path, "cuda", launcher=_gpuwire_run(node))
    # the device by its own name: the mesh sets each rank's device to its LOCAL_RANK, which was
    # refused ("gpuwire device 1 does not exist")
    native = _two_ranks(path, "gpuwire", env={**os.environ, "GPUWIRE_NODE": node.address})
    local = _two_ranks(path, "cpu")
    assert len(remote) == 2 and remote == local and native == local
    assert local[0].endswith("[16, 10]")  # each rank holds half of the column-parallel weight


CHECKPOINT_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    where, checkpoint = sys.argv[1], sys.argv[2]
    dist.init_process_group("nccl" if where == "cuda" else "gloo")
    if where == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(where)
    for layer in (model[0], model[2], model):
        fully_shard(layer)  # (no mesh: FSDP2 builds one on the accelerator)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def train(steps):
        data = torch.Generator().manual_seed(5)
        for _ in range(steps):
            loss = model(torch.randn(4, 8, generator=data).to(where)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()

    train(2)
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)
    after_save = train(2)
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    after_load = train(2)
    device = str(next(model.parameters()).device)
    sys.stdout.write(f"RESULT {dist.get_rank()} {after_save!r} {after_load!r} {device}\\n")
    del model, opt, model_state, optim_state, state  # (FSDP's pending work goes before the group does)
    dist.barrier()
    dist.destroy_process_group()
""")


def test_fsdp2_distributed_checkpoint_save_and_load_match_cpu_gloo(node, tmp_path):
    """FSDP2 with a sharded ``torch.distributed.checkpoint`` save and load (torchtitan's
    checkpoints): training resumed from the checkpoint repeats the steps after the save, under
    ``gpuwire run`` and natively, equal to CPU gloo. Natively this is also a CPU program on a
    machine with gpuwire installed: ``fully_shard`` without a mesh builds one on the accelerator
    (gpuwire), whose ``set_device(LOCAL_RANK)`` was refused on rank 1."""
    path = tmp_path / "dcp.py"
    path.write_text(CHECKPOINT_SCRIPT)

    remote = _two_ranks(path, "cuda", str(tmp_path / "remote"), launcher=_gpuwire_run(node))
    native = _two_ranks(path, "cpu", str(tmp_path / "native"), env={**os.environ, "GPUWIRE_NODE": node.address})
    local = _two_ranks(path, "cpu", str(tmp_path / "local"), env={**os.environ, "GPUWIRE_AUTOLOAD": "0"})
    assert [line.rsplit(" ", 1)[1] for line in remote] == ["cuda:0", "cuda:1"]
    assert [line.rsplit(" ", 1)[1] for line in native] == ["gpuwire:0", "gpuwire:0"]
    assert [line.rsplit(" ", 1)[1] for line in local] == ["cpu", "cpu"]
    losses = {line.rsplit(" ", 1)[0] for line in remote + native + local}
    assert len(losses) == 2  # one line a rank, the same in all three runs
    after_save, after_load = next(iter(losses)).split()[2:4]
    assert after_save == after_load  # resumed from the checkpoint, the same steps again


DDP_VARIANTS_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as powerSGD
    where = sys.argv[1]
    local_rank = int(os.environ["LOCAL_RANK"])
    if where == "cuda":  # set up as pytorch/examples' minGPT-ddp does, through torch.accelerator
        acc = torch.accelerator.current_accelerator()
        device = torch.device(f"{acc}:{local_rank}")
        dist.init_process_group(backend=dist.get_default_backend_for_device(device))
        torch.accelerator.set_device_index(local_rank)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Net(nn.Module):
        def __init__(self, with_unused):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            self.unused = nn.Linear(4, 4) if with_unused else None  # (no gradient: DDP must be told)

        def forward(self, x):
            return self.body(x)

    out = []
    for variant in ("find_unused_parameters", "static_graph", "fp16_compress_hook", "powerSGD_hook", "no_sync"):
        torch.manual_seed(0)
        model = Net(variant in ("find_unused_parameters", "static_graph")).to(device)
        ddp = DDP(model, device_ids=[local_rank] if where == "cuda" else None,
                  find_unused_parameters=variant == "find_unused_parameters", static_graph=variant == "static_graph")
        if variant == "fp16_compress_hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        if variant == "powerSGD_hook":
            ddp.register_comm_hook(powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                          start_powerSGD_iter=2, min_compression_rate=0.5),
                                   powerSGD.powerSGD_hook)
        opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        for step in range(4):
            x = torch.randn(8, 16, generator=data)
            x = x.to(local_rank) if where == "cuda" else x  # (an index, as minGPT-ddp moves its batches)
            if variant == "no_sync" and step % 2 == 0:
                with ddp.no_sync():  # gradient accumulation: this step's gradients stay local
                    ddp(x).square().mean().backward()
                continue
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        # DDP times its iterations with a timer of the parameters' device type (gpuwire had none:
        # "Time stats are currently only collected for CPU and CUDA devices" in every DDP run)
        timed = ddp._get_ddp_logging_data().get("avg_forward_compute_time", 0) > 0
        out.append([variant, [p.detach().cpu().double().sum().item() for p in model.body.parameters()], timed])
        del ddp, model, opt  # the reducer's and PowerSGD's pending work go before the group does
    sys.stdout.write(f"RESULT {rank} {out}\\n")
    dist.barrier()
    dist.destroy_process_group()
""")


def test_ddp_unused_parameters_static_graph_and_comm_hooks_match_cpu_gloo(node, tmp_path):
    """DDP as training scripts configure it: ``find_unused_parameters=True`` and
    ``static_graph=True`` (the reducer stages its used-parameter map through pinned host memory,
    which the gpuwire device could not give: "implement getPinnedMemoryAllocator"), the fp16 and
    PowerSGD communication hooks (PowerSGD's ``torch.zeros(device=bucket.buffer().device)`` ran
    on autograd's thread, outside CUDA compatibility: "Could not run ... 'CUDA' backend"), and
    ``no_sync`` accumulation. The ranks set up as pytorch/examples' minGPT-ddp does, through
    ``torch.accelerator`` (DDP raised "Expected current accelerator type gpuwire to match device
    type cuda" copying the batches). Weights equal CPU gloo's bit for bit."""
    if not native_builds():
        # the pinned host memory comes from the client's C++ helper: with no compiler (or
        # GPUWIRE_NATIVE=0) the device keeps PyTorch's Python hooks, which have none
        pytest.skip("no C++ compiler or GPUWIRE_NATIVE=0: no C++ device hooks")
    path = tmp_path / "ddp_variants.py"
    path.write_text(DDP_VARIANTS_SCRIPT)

    remote = _two_ranks(path, "cuda", launcher=_gpuwire_run(node))
    local = _two_ranks(path, "cpu", env={**os.environ, "GPUWIRE_AUTOLOAD": "0"})
    assert len(local) == 2 and remote == local
    assert "powerSGD_hook" in local[0] and "no_sync" in local[0] and "False" not in local[0]

