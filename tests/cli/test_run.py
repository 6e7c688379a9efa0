"""`gpuwire run`: unmodified CUDA-style programs in real subprocesses, compared with CPU runs."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "cuda_style_train.py")


def gpuwire(*args, env=None, timeout=180, **kwargs):
    return subprocess.run([sys.executable, "-m", "gpuwire", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=REPO, **kwargs)


def python(*args, timeout=180):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_cuda_style_training_script_matches_cpu_bit_for_bit(node):
    remote = gpuwire("run", "--node", node.address, "--", sys.executable, EXAMPLE, "--steps", "4")
    local = python(EXAMPLE, "--steps", "4", "--force-cpu")
    assert remote.returncode == 0, remote.stderr
    assert "device cuda" in remote.stdout  # the script believed it had a CUDA GPU
    losses = re.findall(r"loss (\S+)", remote.stdout)
    assert losses and losses == re.findall(r"loss (\S+)", local.stdout)
    assert re.search(r"checksum (\S+)", remote.stdout).group(1) == re.search(r"checksum (\S+)", local.stdout).group(1)
    assert remote.stderr.count("GPU 0 is") == 1


def test_amp_autocast_and_grad_scaler(node):
    result = gpuwire("run", "--node", node.address, "--", sys.executable, EXAMPLE, "--steps", "3", "--amp")
    assert result.returncode == 0, result.stderr
    losses = [float(v) for v in re.findall(r"loss (\S+)", result.stdout)]
    local = [float(v) for v in re.findall(r"loss (\S+)", python(EXAMPLE, "--steps", "3", "--force-cpu").stdout)]
    assert len(losses) == 3
    # float16 matmuls: close to the fp32 CPU run, but not equal (autocast really ran in half precision)
    assert losses != local
    assert all(abs(a - b) < 0.05 for a, b in zip(losses, local))


HF_SCRIPT = textwrap.dedent("""
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel
    device = "cuda" if torch.cuda.is_available() and sys.argv[1] == "gpu" else "cpu"
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(device)
    assert next(model.parameters()).is_cuda == (device == "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 256, (2, 16), generator=data).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(); loss.backward(); opt.step()
        print("loss", repr(loss.item()))
    model.eval()
    out = model.generate(torch.tensor([[5, 17, 42]], device=device), max_new_tokens=8, do_sample=False, pad_token_id=0)
    print("tokens", out.tolist())
    print("device", next(model.parameters()).device)
""")


def test_hugging_face_fine_tuning_in_cuda_style(node, tmp_path):
    script = tmp_path / "hf_train.py"
    script.write_text(HF_SCRIPT)
    remote = gpuwire("run", "--node", node.address, "--", sys.executable, str(script), "gpu")
    local = python(str(script), "cpu")
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert "device cuda:0" in remote.stdout
    assert re.findall(r"(loss|tokens) (.*)", remote.stdout) == re.findall(r"(loss|tokens) (.*)", local.stdout)


TRAINER_CHECKPOINTS = textwrap.dedent("""
    import sys, numpy as np, torch, transformers
    from transformers import GPT2Config, GPT2ForSequenceClassification, Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
    out_dir, use_cpu = sys.argv[1], sys.argv[2] == "cpu"
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16, pad_token_id=0, num_labels=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2ForSequenceClassification(cfg)

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(n)
            self.x, self.y = torch.randint(1, 64, (n, 12), generator=g), torch.randint(0, 2, (n,), generator=g)
        def __len__(self):
            return len(self.y)
        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.y[i]}

    def accuracy(p):
        return {"acc": float((np.argmax(p.predictions, -1) == p.label_ids).mean())}

    common = dict(per_device_train_batch_size=8, save_strategy="epoch", report_to=[], use_cpu=use_cpu,
                  dataloader_pin_memory=True)
    # a checkpoint every epoch (model, optimizer, scheduler and every RNG state, the GPU's included),
    # the best one loaded back at the end ...
    trainer = Trainer(model=model, args=TrainingArguments(out_dir, num_train_epochs=2, eval_strategy="epoch",
                                                          load_best_model_at_end=True, metric_for_best_model="acc",
                                                          **common),
                      train_dataset=Data(32), eval_dataset=Data(16), compute_metrics=accuracy)
    print("loss", round(trainer.train().training_loss, 5))
    print("device", next(model.parameters()).device)
    # ... and a run resumed from the last checkpoint (RNG states restored)
    resumed = Trainer(model=model, args=TrainingArguments(out_dir, num_train_epochs=3, **common), train_dataset=Data(32))
    print("resumed", round(resumed.train(resume_from_checkpoint=True).training_loss, 5))
""")


def test_trainer_checkpoints_and_resume_under_gpuwire_run(node, tmp_path):
    """The Trainer saves every RNG state at each checkpoint through ``torch.cuda.random``
    (not ``torch.cuda``): under ``gpuwire run`` its first checkpoint raised "module 'torch._C' has
    no attribute '_cuda_getDevice'" until session 12."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_CHECKPOINTS)
    remote = gpuwire("run", "--node", node.address, "--", sys.executable, str(script), str(tmp_path / "gpu"), "gpu")
    local = python(str(script), str(tmp_path / "cpu"), "cpu")
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert local.returncode == 0, local.stderr[-3000:]
    assert "device cuda:0" in remote.stdout
    assert re.findall(r"(loss|resumed) (.*)", remote.stdout) == re.findall(r"(loss|resumed) (.*)", local.stdout)


CHECKPOINTED_SCRIPT = textwrap.dedent("""
    import sys, torch
    from transformers import GPT2Config, GPT2LMHeadModel
    device = "cuda" if sys.argv[1] == "gpu" else "cpu"
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(device)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": sys.argv[2] == "reentrant"})
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.transformer.h[0].attn.c_attn.weight.grad.cpu()
    print("loss", repr(loss.item()), "grad", repr(grad.sum().item()), repr(grad.abs().max().item()))
""")


# (the reentrant variant, PyTorch's legacy one, runs with ``-m slow``: CI's 15 minutes)
@pytest.mark.parametrize("mode", [pytest.param("reentrant", marks=pytest.mark.slow), "non-reentrant"])
def test_gradient_checkpointing_with_dropout_recomputes_the_same_masks(node, tmp_path, mode):
    # activation checkpointing restores the device's random state before recomputing a segment,
    # if the device module says it is initialized; otherwise dropout draws new masks and the
    # gradients are silently wrong
    script = tmp_path / "checkpointed.py"
    script.write_text(CHECKPOINTED_SCRIPT)
    remote = gpuwire("run", "--node", node.address, "--", sys.executable, str(script), "gpu", mode)
    local = python(str(script), "cpu", mode)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert re.findall(r"loss .*", remote.stdout) == re.findall(r"loss .*", local.stdout)


def test_nvidia_smi_inside_gpuwire_run(node):
    table = gpuwire("run", "--node", node.address, "--", "nvidia-smi")
    assert table.returncode == 0, table.stderr
    assert "NVIDIA-SMI (gpuwire" in table.stdout and "software GPU" in table.stdout
    csv = gpuwire("run", "-q", "--node", node.address, "--", "nvidia-smi",
                  "--query-gpu=name,memory.total,memory.used", "--format=csv,noheader,nounits")
    name, total, used = [v.strip() for v in csv.stdout.strip().split(",")]
    assert "gpuwire" in name and int(total) > 0 and int(used) >= 0
    listed = gpuwire("run", "-q", "--node", node.address, "--", "nvidia-smi", "-L")
    assert listed.stdout.startswith("GPU 0: ")


def test_python_dash_m_and_child_processes_inherit(node, tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "main.py").write_text(textwrap.dedent("""
        import subprocess, sys, torch
        print("parent", torch.cuda.is_available(), (torch.ones(2).cuda() * 2).sum().item())
        subprocess.run([sys.executable, "-c",
                        "import torch; print('child', torch.cuda.is_available(), torch.ones(3, device='cuda').sum().item())"],
                       check=True)
    """))
    result = subprocess.run([sys.executable, "-m", "gpuwire", "run", "-q", "--node", node.address, "--",
                             sys.executable, "-m", "pkg.main"], capture_output=True, text=True, timeout=180,
                            cwd=tmp_path)
    assert "parent True 4.0" in result.stdout, result.stderr
    assert "child True 3.0" in result.stdout, result.stderr


def test_exit_code_is_the_childs(node):
    result = gpuwire("run", "-q", "--node", node.address, "--", sys.executable, "-c", "import sys; sys.exit(7)")
    assert result.returncode == 7


def test_unreachable_node_fails_before_the_program_starts():
    result = gpuwire("run", "--node", "127.0.0.1:1", "--", sys.executable, "-c", "print('STARTED')")
    assert result.returncode != 0
    assert "STARTED" not in result.stdout
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("gpuwire run: cannot connect"), result.stderr
    assert "Traceback" not in result.stderr


def test_wrong_token_fails_with_one_line():
    from tests.conftest import NodeProcess
    protected = NodeProcess("--token", "right")
    try:
        result = gpuwire("run", "--node", protected.address, "--token", "wrong", "--", sys.executable, "-c", "print(1)")
        assert result.returncode != 0 and "refused the session" in result.stderr and "Traceback" not in result.stderr
    finally:
        protected.kill()


def test_killed_child_leaves_no_session_on_the_node(fresh_node):
    code = "import torch, time; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-m", "gpuwire", "run", "-q", "--node", fresh_node.address, "--",
                             sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().startswith("ready")
        from gpuwire.smi import fetch
        info, _ = fetch(fresh_node.address, None)
        assert len(info["sessions"]) == 1 and info["bytes_in_use"] >= 4 << 20
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its child, as a crash would
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            info, _ = fetch(fresh_node.address, None)
            if not info["sessions"]:
                break
            time.sleep(0.2)
        assert info["sessions"] == [] and info["bytes_in_use"] == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_dataloader_workers_under_gpuwire_run(node, tmp_path):
    """Forked DataLoader workers do not write into the parent's connection."""
    script = tmp_path / "workers.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import DataLoader, Dataset
        class Squares(Dataset):
            def __len__(self): return 32
            def __getitem__(self, i): return torch.tensor([float(i)]) ** 2
        model = torch.nn.Linear(1, 1).cuda()
        total = 0.0
        for batch in DataLoader(Squares(), batch_size=8, num_workers=2, pin_memory=True):
            total += model(batch.cuda(non_blocking=True)).sum().item() * 0 + batch.sum().item()
        print("total", total)
    """))
    result = gpuwire("run", "-q", "--node", node.address, "--", sys.executable, str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "total 10416.0" in result.stdout


def test_threads_end_holding_no_function_modes(node, tmp_path):
    """gpuwire pushes its mode on every thread's stack, which PyTorch keeps in C++ thread-local
    state; left there, it is dropped when the OS thread exits, after ``join()`` returns, under
    the GIL: a thread exiting as the interpreter finalized aborted the process ("terminate
    called without an active exception" after a DataLoader with pin_memory, ~1 run in 30).
    The stack must be empty by the time the thread's Python code ends."""
    script = tmp_path / "modes.py"
    script.write_text(textwrap.dedent("""
        import threading, torch
        stack_at_end = []
        def profile(frame, event, arg):
            if event == "return" and frame.f_code.co_name == "bootstrap_inner":
                stack_at_end.append(torch._C._len_torch_function_stack())
        threading.setprofile(profile)
        class Mode(torch.overrides.TorchFunctionMode):
            pass
        def work():
            torch.ones(1, device="cuda")
            Mode().__enter__()  # a mode the thread's own code leaves on its stack
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        print("modes left at the thread's end", stack_at_end)
    """))
    result = gpuwire("run", "-q", "--node", node.address, "--", sys.executable, str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "modes left at the thread's end [0]" in result.stdout


THREADED_SCRIPT = textwrap.dedent("""
    import sys, tempfile, threading
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    gpu = sys.argv[1] == "gpu"
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    host = [torch.randn(64, 32) for _ in range(6)]
    with ThreadPoolExecutor(3) as pool:  # "cuda" in pool threads
        moved = list(pool.map(lambda t: (t.to(device) * 2).sum(0), host))
    class Worker(threading.Thread):  # a Thread subclass with its own run()
        def run(self):
            self.result = torch.ones(3, device=device).cumsum(0)
    worker = Worker(); worker.start(); worker.join()
    print("devices", sorted({str(t.device) for t in moved} | {str(worker.result.device)}))
    print("values", [repr(t.sum().item()) for t in moved], worker.result.tolist())
    # transformers loads checkpoint shards on a thread pool when given a device_map
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    saved = tempfile.mkdtemp()
    GPT2LMHeadModel(cfg).save_pretrained(saved)
    model = GPT2LMHeadModel.from_pretrained(saved, device_map=device)
    ids = torch.arange(8).view(1, 8).to(device)
    print("model", next(model.parameters()).device, repr(model(ids).logits.sum().item()))
""")


def test_cuda_in_threads_the_program_starts(node, tmp_path):
    # PyTorch keeps its function-mode stack per thread: a thread without gpuwire's mode would
    # send "cuda" to PyTorch's real (absent) CUDA backend
    script = tmp_path / "threads.py"
    script.write_text(THREADED_SCRIPT)
    remote = gpuwire("run", "--node", node.address, "--", sys.executable, str(script), "gpu")
    local = python(str(script), "cpu")
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert local.returncode == 0, local.stderr[-3000:]
    assert "devices ['cuda:0']" in remote.stdout and "model cuda:0" in remote.stdout
    assert re.findall(r"values .*", remote.stdout) == re.findall(r"values .*", local.stdout)
    assert re.search(r"model \S+ (\S+)", remote.stdout).group(1) == re.search(r"model \S+ (\S+)", local.stdout).group(1)


def test_tf32_training_arguments_and_the_cuda_version_gate(node, tmp_path):
    # libraries gate GPU features on a CUDA build: transformers refused --tf32 with
    # "requires Ampere or a newer GPU arch, cuda>=11"; the flag must then reach the node
    script = tmp_path / "tf32.py"
    script.write_text(textwrap.dedent("""
        import tempfile, torch, gpuwire
        from transformers import TrainingArguments
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), tf32=True, report_to=[])
        torch.ones(1, device="cuda").sum().item()
        flags = gpuwire.client.device.runtime().query("precision")
        print("cuda", torch.version.cuda, "device", args.device, "tf32 on node", flags["cuda.matmul.fp32_precision"])
    """))
    done = gpuwire("run", "--node", node.address, "--", sys.executable, str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"cuda \d+\.\d+ device cuda:0 tf32 on node tf32", done.stdout), done.stdout


LIGHTNING_SCRIPT = textwrap.dedent('''
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class LitMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.BatchNorm1d(32), nn.Linear(32, 4))
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss, prog_bar=True)
            return loss
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean())
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    accelerator, precision, root = sys.argv[1:4]
    L.seed_everything(0)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x[:, :4].argmax(-1))
    trainer = L.Trainer(accelerator=accelerator, devices=1, max_epochs=2, precision=precision, logger=False,
                        default_root_dir=root, enable_progress_bar=False, enable_model_summary=False)
    model = LitMLP()
    trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True), DataLoader(data, batch_size=64))
    print("strategy device", trainer.strategy.root_device)
    print("metrics", {k: float(v) for k, v in sorted(trainer.callback_metrics.items())})
    print("weights", float(sum(p.double().sum() for p in model.parameters())))
''')


# (full precision runs with ``-m slow``: bf16-mixed takes the same Trainer path and autocast too)
@pytest.mark.parametrize("precision", [pytest.param("32-true", marks=pytest.mark.slow), "bf16-mixed"])
def test_lightning_trainer_on_accelerator_gpu(node, tmp_path, precision):
    # Lightning picks CUDAAccelerator from torch.cuda, queries the device's name and capability
    # (its Tensor Core hint), moves the module there and back, and checkpoints at the end
    pytest.importorskip("lightning")
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING_SCRIPT)
    remote = gpuwire("run", "--node", node.address, "--", sys.executable, str(script), "gpu", precision,
                     str(tmp_path / "gpu"), timeout=300)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert "strategy device cuda:0" in remote.stdout
    assert list((tmp_path / "gpu").rglob("*.ckpt")), "the checkpoint was not written"
    if precision == "32-true":  # bit for bit with the same script on the CPU
        local = python(str(script), "cpu", precision, str(tmp_path / "cpu"), timeout=300)
        assert local.returncode == 0, local.stderr[-3000:]
        assert re.findall(r"(?:metrics|weights) .*", remote.stdout) == re.findall(r"(?:metrics|weights) .*", local.stdout)
    else:
        assert re.search(r"'train_loss': \d", remote.stdout)


def test_run_without_a_node_starts_an_embedded_one_and_stops_it():
    # the README's first command: no --node, no GPUWIRE_NODE
    env = {k: v for k, v in os.environ.items() if k not in ("GPUWIRE_NODE", "GPUWIRE_TOKEN")}
    done = subprocess.run([sys.executable, "-m", "gpuwire", "run", "--", sys.executable, "-c",
                           "import torch; x = torch.arange(6.0, device='cuda'); print('sum', (x * 2).sum().item(), x.device)"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sum 30.0 cuda:0" in done.stdout
    address = re.search(r"started an embedded node at (\S+)", done.stderr).group(1)
    host, port = address.rsplit(":", 1)
    import socket
    with pytest.raises(OSError):  # the node went away with the run
        socket.create_connection((host, int(port)), timeout=2).close()


CRASHING_PROGRAM = textwrap.dedent("""
    import os, signal, time, torch

    def node_pid():  # the embedded node: the launcher's child serving the device
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    serving = b"\\x00serve\\x00" in f.read()  # (an argument of its own: this program's text says serve too)
            except OSError:
                continue
            if parent == os.getppid() and serving:
                return int(entry)

    x = torch.arange(6.0, device="cuda")
    print("before", (x * 2).sum().item(), flush=True)
    os.kill(node_pid(), signal.SIGSEGV)
    time.sleep(0.3)
    try:
        (x * 2).sum().item()
    except Exception as e:
        print("lost:", type(e).__name__, e, flush=True)
    y = torch.arange(6.0, device="cuda")
    print("after", (y * 3).sum().item(), node_pid() is not None, flush=True)
""")


def test_run_starts_its_embedded_node_again_when_a_kernel_crashes_it():
    # a `gpuwire run pytest ...` of a suite: one test whose kernel crashes the node must not fail
    # every later test; and the node that replaced it goes away with the run too
    env = {k: v for k, v in os.environ.items() if k not in ("GPUWIRE_NODE", "GPUWIRE_TOKEN")}
    done = subprocess.run([sys.executable, "-m", "gpuwire", "run", "--", sys.executable, "-c", CRASHING_PROGRAM],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "before 30.0" in done.stdout, done.stdout + done.stderr[-3000:]
    assert re.search(r"lost: ConnectionLost .*the node restarted after its previous process \(pid \d+\) ended: "
                     r"killed by SIGSEGV", done.stdout), done.stdout + done.stderr[-3000:]
    assert "after 45.0 True" in done.stdout, done.stdout + done.stderr[-3000:]
    address = re.search(r"started an embedded node at (\S+)", done.stderr).group(1)
    host, port = address.rsplit(":", 1)
    import socket
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_cli_commands_that_need_no_torch_do_not_import_it():
    # `gpuwire --help` took 1.8 s on this machine, most of it importing torch
    done = subprocess.run([sys.executable, "-m", "gpuwire", "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}, cwd=REPO)
    assert done.returncode == 0 and "gpuwire run" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "gpuwire.cli" in imported and "torch" not in imported


def _launcher_imports(*args) -> tuple[subprocess.CompletedProcess, set]:
    """``python -X importtime -m gpuwire ARGS``: the result and the modules that process (not its
    children: the option is not inherited) imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "gpuwire", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    return done, {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


def test_run_and_smi_ask_the_node_without_importing_torch(node):
    # `gpuwire run --node` checked the node through the client runtime, which imports torch: 2-3 s
    # on this machine before the program (which imports torch itself) even started; so did
    # `gpuwire smi` and the nvidia-smi stand-in, on every call
    done, imported = _launcher_imports("run", "-q", "--node", node.address, "--", "true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gpuwire.client.probe" in imported and "torch" not in imported
    done, imported = _launcher_imports("smi", "--node", node.address)
    assert done.returncode == 0 and "gpuwire" in done.stdout, done.stderr[-2000:]
    assert "torch" not in imported
    listed = gpuwire("run", "-q", "--node", node.address, "--", "nvidia-smi", "-L")
    assert listed.returncode == 0 and listed.stdout.startswith("GPU 0: "), listed.stderr


def test_run_with_an_embedded_node_never_imports_torch_in_the_launcher():
    # stopping the embedded node imported the client's device layer (torch: ~2 s) after the
    # program had exited, so every `gpuwire run` without a node ended 2 s late
    done, imported = _launcher_imports("run", "-q", "--", "true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gpuwire.client.embedded" in imported and "torch" not in imported


FAILING_EMBEDDED_NODE = textwrap.dedent('''
    import subprocess, sys
    from gpuwire.client import embedded
    from gpuwire import launcher
    started = subprocess.Popen

    def node_that_fails(cmd, **kwargs):  # the embedded node exits at once (an unknown subcommand)
        return started([part if part != "serve" else "no-such-command" for part in cmd], **kwargs)

    embedded.subprocess.Popen = node_that_fails
    marker = sys.argv[1]
    code = launcher.run([sys.executable, "-c", f"import time; time.sleep(30); open({marker!r}, 'w').write('ran')"],
                        node=None, token=None, cuda_compat=True)
    print("exit code", code)
''')


def test_run_when_the_embedded_node_fails_stops_the_program_and_says_so(tmp_path):
    # the program starts while the embedded node boots; a node that never comes up must not
    # leave it running (or hanging on its first connection)
    script = tmp_path / "failing.py"
    script.write_text(FAILING_EMBEDDED_NODE)
    marker = tmp_path / "program-finished"
    started = time.monotonic()
    done = python(str(script), str(marker), timeout=120)
    assert "exit code 2" in done.stdout, done.stdout + done.stderr
    assert "could not start an embedded node" in done.stderr
    assert time.monotonic() - started < 25 and not marker.exists()


def test_a_2018_style_script_with_cuda_as_the_default_tensor_type(node, tmp_path):
    # set_default_tensor_type('torch.cuda.FloatTensor') raised; then its first version broke the
    # first backward (dynamo, imported lazily there, checks Tensor.__new__ against its own rule)
    script = tmp_path / "old.py"
    script.write_text(textwrap.dedent("""
        import torch
        torch.set_default_tensor_type('torch.cuda.FloatTensor')
        torch.manual_seed(0)
        w = torch.zeros(5, requires_grad=True)
        x = torch.Tensor([[1, 2, 3, 4, 5]])
        (x @ w * 2).sum().backward()
        print(w.device, x.device, w.grad.tolist())
    """))
    done = gpuwire("run", "-q", "--node", node.address, "--", sys.executable, str(script))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "cuda:0 cuda:0 [2.0, 4.0, 6.0, 8.0, 10.0]"


def test_quiet_run_with_an_embedded_node_says_nothing():
    env = {k: v for k, v in os.environ.items() if k not in ("GPUWIRE_NODE", "GPUWIRE_TOKEN")}
    done = subprocess.run([sys.executable, "-m", "gpuwire", "run", "-q", "--", sys.executable, "-c",
                           "import torch; print((torch.ones(3, device='cuda') * 2).sum().item())"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "6.0"
    assert "gpuwire:" not in done.stderr, done.stderr  # (the embedded node's start was still said)


SLOW_NODE_COMPILER = """#!/bin/sh
# a compiler 14 s slower for the node's helpers: a node whose first start on a machine takes
# longer than a client's default 10 s handshake wait. What it writes is the helper this suite
# built before its first test (tests/conftest.py), where there is one: the wait is what is
# tested here, and a real build of both took ~40 s more of the suite (one is built for real
# in tests/client/test_native.py)
case "$*" in *"/node/"*) sleep 14;; esac
out=""; prev=""
for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done
case "$*" in
  *"/node/native.cpp"*) built="$PREBUILT_NODE_NATIVE";;
  *"/node/loop.cpp"*) built="$PREBUILT_NODE_LOOP";;
  *) built="";;
esac
if [ -n "$built" ] && [ -f "$built" ] && [ -n "$out" ]; then exec cp "$built" "$out"; fi
exec "${REAL_CXX:-c++}" "$@"
"""


def test_first_run_on_a_machine_waits_for_the_embedded_node_to_build_its_helpers(tmp_path):
    # The README's first command on a fresh machine: the embedded node builds its C++ helpers
    # before it answers, while the program (started beside it) is already connecting. That
    # program gave up after 10 s with "did not answer the gpuwire handshake".
    compiler = tmp_path / "slow-c++"
    compiler.write_text(SLOW_NODE_COMPILER)
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    cache.mkdir()
    from gpuwire import _native
    from gpuwire.client import autocast, native
    from gpuwire.node import loop as node_loop, native as node_native
    for source, module in ((native.SOURCE, native.MODULE), (autocast.SOURCE, autocast.MODULE)):
        built = _native.library_path(source, module)  # the client's helpers, if built here: only the node builds
        if built.exists():
            (cache / built.name).write_bytes(built.read_bytes())
    env = {k: v for k, v in os.environ.items() if k not in ("GPUWIRE_NODE", "GPUWIRE_TOKEN", "GPUWIRE_CONNECT_TIMEOUT")}
    env.update(CXX=str(compiler), GPUWIRE_CACHE_DIR=str(cache),
               PREBUILT_NODE_NATIVE=str(_native.library_path(node_native.SOURCE, node_native.MODULE)),
               PREBUILT_NODE_LOOP=str(_native.library_path(node_loop.SOURCE, node_loop.MODULE)))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gpuwire", "run", "-q", "--", sys.executable, "-c",
                           "import torch; print((torch.ones(3, device='cuda') * 2).sum().item())"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "6.0"
    assert time.monotonic() - started > 14  # (the node's build did take its 14 s)
    assert list(cache.glob("gpuwire_node_native-*.so")) and list(cache.glob("gpuwire_node_loop-*.so"))
