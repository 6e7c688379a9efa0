"""``gpuwire serve --restart-on-crash``: a node killed by a crash is started again on its address.

A real supervisor process and node process; the node is killed with SIGSEGV (what a kernel
crash does) while a client holds a session, and the client's program goes on with a new one.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

from tests.conftest import _readline_with_timeout, child_process

CLIENT = textwrap.dedent("""
    import os, signal, sys, time, torch, gpuwire
    gpuwire.attach(sys.argv[1])
    kept = torch.arange(4.0, device="gpuwire")
    print("before", kept.sum().item(), flush=True)
    os.kill(int(sys.argv[2]), signal.SIGSEGV)
    time.sleep(0.5)
    try:
        (kept * 2).sum().item()
    except gpuwire.ConnectionLost as e:
        print("lost:", e, flush=True)
    print("after", (torch.arange(6.0).to("gpuwire") * 3).sum().item(), flush=True)
    gpuwire.detach()
""")


def test_a_crashed_node_is_started_again_and_a_client_goes_on_with_a_new_session():
    supervisor = subprocess.Popen([sys.executable, "-m", "gpuwire", "serve", "--restart-on-crash", "--port", "0",
                                   "--backend", "cpu", "--log-level", "warning"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _readline_with_timeout(supervisor.stdout, 120) or ""
        address = re.search(r"listening on (\S+)", line).group(1)
        crashed = child_process(supervisor.pid)
        assert crashed is not None
        client = subprocess.run([sys.executable, "-c", CLIENT, address, str(crashed)], capture_output=True, text=True,
                                timeout=180)
        assert client.returncode == 0, client.stderr[-3000:]
        assert "before 6.0" in client.stdout, client.stdout + client.stderr
        assert re.search(rf"lost: .*the node restarted after its previous process \(pid {crashed}\) ended: killed by "
                         r"SIGSEGV \(a kernel crashed", client.stdout), client.stdout + client.stderr
        assert "after 45.0" in client.stdout, client.stdout + client.stderr
        replacement = child_process(supervisor.pid)
        assert replacement != crashed
        supervisor.send_signal(signal.SIGTERM)  # (passed on to the node; both end)
        assert supervisor.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{replacement}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{replacement}")
        assert f"the node (pid {crashed}) ended: killed by SIGSEGV" in supervisor.stderr.read()
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


def test_a_node_that_exits_by_itself_is_not_started_again():
    # (a configuration error: the supervisor ends with the node's status rather than looping)
    done = subprocess.run([sys.executable, "-m", "gpuwire", "serve", "--restart-on-crash", "--port", "0",
                           "--backend", "cpu", "--session-memory", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--session-memory must be positive" in done.stderr
    assert "Starting it again" not in done.stderr
