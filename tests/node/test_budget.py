"""A session's memory budget: the client raises torch.OutOfMemoryError at the line that
over-allocates; the node enforces it regardless; other sessions are unaffected."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gpuwire
from gpuwire.client.runtime import Runtime


@pytest.fixture
def budget_node():
    from tests.conftest import NodeProcess
    node = NodeProcess("--session-memory", "1MiB")
    yield node
    node.kill()


def test_client_raises_oom_at_the_allocating_line(budget_node):
    code = textwrap.dedent(f"""
        import torch, gpuwire
        gpuwire.attach("{budget_node.address}")
        a = torch.zeros(150_000, device="gpuwire")           # 600 KB
        try:
            b = torch.zeros(150_000, device="gpuwire")       # would be 1.2 MB > 1 MiB
        except torch.OutOfMemoryError as e:
            print("OOM", "budget" in str(e))
        del a
        c = torch.ones(150_000, device="gpuwire")            # fits again once a is freed
        print("after", c.sum().item())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "OOM True" in result.stdout, result.stderr
    assert "after 150000.0" in result.stdout


def test_node_enforces_the_budget_even_if_the_client_does_not(budget_node):
    greedy = Runtime(budget_node.address)
    greedy.memory_budget = None  # a client that ignores its budget
    greedy.allocate(800_000)
    greedy.allocate(800_000)
    with pytest.raises(torch.OutOfMemoryError, match="memory budget"):
        greedy.synchronize()
    polite = Runtime(budget_node.address)  # another tenant on the same node is unaffected
    sid = polite.allocate(900_000)
    polite.write(sid, 0, memoryview(b"\x01" * 16))
    assert bytes(polite.read(sid, 0, 16)) == b"\x01" * 16
    greedy.close()
    polite.close()
