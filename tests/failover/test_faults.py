"""A node that fails on one command, every time: the client gives up with the cause.

Real node processes (``faulty_node.py``: ``gpuwire serve`` failing on every 1 MiB Write) and a
real client process. Before, a connection the node broke at the same command each time was
"restored" again and again, forever (one line on stderr per attempt), and a bug of the node
parked the session for a resume that met the same bug.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import NodeProcess

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.timeout(120)

UPLOAD = "import torch, gpuwire\nx = torch.ones(1 << 20).to('gpuwire')\nprint(x.sum().item())\n"


def _run_client(address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", UPLOAD], env={**os.environ, "GPUWIRE_NODE": address},
                          capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("fault", ["reset", "bug"])
def test_a_command_that_breaks_the_node_every_time_fails_the_program_with_its_cause(fault):
    node = NodeProcess(launcher=(os.path.join(HERE, "faulty_node.py"), fault))
    try:
        done = _run_client(node.address)
    finally:
        node.kill()
    assert done.returncode != 0, done.stdout
    assert "ConnectionLost" in done.stderr, done.stderr[-3000:]
    if fault == "reset":
        # a few attempts, then the error says what happened
        assert 1 <= done.stderr.count("nothing lost") <= 3, done.stderr[-3000:]
        assert "times in a row at the same command" in done.stderr
    else:
        # the node's own bug ends the session at once, and the client's error names it
        assert "nothing lost" not in done.stderr
        assert "internal error of the node (RuntimeError: injected fault" in done.stderr, done.stderr[-3000:]
        assert "injected fault" in node.log_text()  # with its traceback, to report
