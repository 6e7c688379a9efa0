"""Network cuts between a client and its node: the job waits, reconnects, loses nothing.

Real node process, real client process, and a proxy in between that drops every connection
(``cut_proxy.CutProxy``). Results are compared bit for bit with a run through no proxy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import NodeProcess
from tests.failover.cut_proxy import CutProxy

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "train_job.py")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def node_and_proxy():
    node = NodeProcess()
    proxy = CutProxy((node.host, node.port)).start()
    yield node, proxy
    proxy.close()
    node.kill()


def run(address: str, steps: int, out: str, *, cuts: dict | None = None, proxy=None, env: dict | None = None):
    proc = subprocess.Popen([sys.executable, JOB, "cnn", str(steps), out],
                            env={**os.environ, "GPUWIRE_NODE": address, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step ") and cuts:
            step = int(line.split()[1])
            if step in cuts:
                proxy.cut(cuts[step])
    return proc.wait(timeout=240), proc.stderr.read()


def test_cuts_of_one_to_five_seconds_cost_nothing_but_time(node_and_proxy, tmp_path):
    node, proxy = node_and_proxy
    code, stderr = run(node.address, 40, str(tmp_path / "direct.pt"))
    assert code == 0, stderr
    code, stderr = run(proxy.address, 40, str(tmp_path / "cut.pt"), cuts={5: 1.0, 17: 5.0, 30: 0.0}, proxy=proxy)
    assert code == 0, stderr[-3000:]
    assert stderr.count("nothing lost") == 3, stderr
    a, b = torch.load(tmp_path / "direct.pt"), torch.load(tmp_path / "cut.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    log = node.log_text()
    assert log.count(" resumed from ") == 3  # the same session, never rebuilt
    assert log.count(" opened from ") == 2  # the direct run and the cut run


def test_without_durability_a_cut_raises_connection_lost(node_and_proxy, tmp_path):
    node, proxy = node_and_proxy
    code, stderr = run(proxy.address, 30, str(tmp_path / "x.pt"), cuts={5: 0.0}, proxy=proxy,
                       env={"GPUWIRE_DURABILITY": "none"})
    assert code != 0
    assert "ConnectionLost" in stderr and "GPUWIRE_DURABILITY=checkpoint" in stderr


def test_a_killed_client_frees_its_parked_session_after_the_grace(node_and_proxy, tmp_path):
    node, _proxy = node_and_proxy
    script = (f"import torch, gpuwire, time\ngpuwire.attach('{node.address}')\n"
              "x = torch.ones(1 << 20, device='gpuwire'); print(x.sum().item(), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "GPUWIRE_RECONNECT_GRACE": "2"},
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == str(float(1 << 20))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        from gpuwire.client.runtime import Runtime
        watcher = Runtime(node.address)
        try:
            deadline = time.monotonic() + 15
            while True:
                others = [s for s in watcher.query("node")["sessions"] if s["id"] != watcher.session_id]
                if not others:
                    break
                assert time.monotonic() < deadline, f"the killed client's session is still held: {others}"
                time.sleep(0.2)
        finally:
            watcher.close()
        assert "its client did not reconnect within 2 s; freeing it" in node.log_text()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


UPLOAD_THEN_WAIT = """
import sys, torch, gpuwire
gpuwire.attach(sys.argv[1])
x = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: logged by reference, not copied
y = x.to("gpuwire")
print(y[-1].item(), flush=True)
if sys.argv[2] == "change":
    x.add_(1)  # the program writes to the source after the upload
if sys.argv[2] == "repoint":  # what module.to(device) does to a parameter, then an optimizer step
    x.data = torch.zeros(3)
    x.add_(1)  # bumps the version counter, but the uploaded bytes are nobody's but the log's now
print(gpuwire.stats()["recovery_log_bytes"], flush=True)
sys.stdin.readline()  # the node is killed and restarted here
print(y.sum().item(), flush=True)
"""


@pytest.mark.parametrize("what", ["keep", "change", "repoint"])
def test_an_upload_is_replayed_from_the_programs_buffer_unless_it_changed(tmp_path, what):
    """A rebuild replays every upload since the last checkpoint. Large uploads are logged by
    reference to the program's tensor, not copied: replayed as they were when it is unchanged;
    refused with a message saying why when the program wrote to it in place since."""
    node = NodeProcess()
    port = node.port
    change = what == "change"
    proc = subprocess.Popen([sys.executable, "-c", UPLOAD_THEN_WAIT, node.address, what],
                            env={**os.environ, "GPUWIRE_DURABILITY": "checkpoint", "GPUWIRE_CHECKPOINT_INTERVAL": "3600",
                                 "GPUWIRE_RECONNECT_GRACE": "20"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert float(proc.stdout.readline()) == float((1 << 20) - 1)
        assert int(proc.stdout.readline()) >= 4 << 20  # the log accounts for the borrowed bytes
        node.kill()
        node = NodeProcess("--port", str(port))  # the same address: the client rebuilds there
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=120)
        if change:
            assert proc.returncode != 0
            assert "ConnectionLost" in err and "changed its source tensor in place" in err, err[-2000:]
        else:
            assert proc.returncode == 0, err[-3000:]
            assert float(out.strip()) == float(torch.arange(1 << 20, dtype=torch.float32).sum())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        node.kill()
