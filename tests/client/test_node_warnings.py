"""A kernel's warning on the node reaches the program, as a local run's does.

The node's kernels (called by the node as ``torch.ops`` calls, or by its native loop) hand their
warnings to c10's handler of the session's thread; the node keeps them and sends them before its
next reply (a "warnings" Notice), and the client warns the program at the line that waited for
them. Compared with CPU word for word.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from gpuwire import _native
from gpuwire.client.device import runtime as gpuwire_runtime

pytestmark = pytest.mark.skipif(not _native.enabled(), reason="the node keeps kernel warnings in its C++ helper")


def _said(call, target) -> tuple:
    """(the result, the warnings the program saw at this file's lines, their categories)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call(target).cpu().tolist()
    ours = [w for w in caught if w.filename == __file__]
    return result, [str(w.message) for w in ours], [w.category for w in ours]


CASES = {
    "copy_ of complex into real": lambda d: torch.zeros(3, device=d).copy_(
        torch.tensor([1 + 2j, 3 - 1j, 0j], device=d)),
    "to() of complex as real": lambda d: torch.tensor([1 + 2j, 3 - 1j], device=d).to(torch.float32),
    "where of a uint8 condition": lambda d: torch.where(torch.tensor([1, 0, 1], dtype=torch.uint8, device=d),
                                                        torch.ones(3, device=d), torch.zeros(3, device=d)),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_warnings_reach_the_program_in_a_local_runs_words(device, name):
    always = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # (these are TORCH_WARN_ONCE: said every time, as PyTorch's tests ask)
    try:
        local, remote = _said(CASES[name], "cpu"), _said(CASES[name], device)
    finally:
        torch.set_warn_always(always)
    assert local[1], f"the CPU run of {name} said nothing: the case no longer tests anything"
    assert remote == local


def test_a_streamed_ops_warning_comes_at_the_line_that_waits_for_it(device):
    source = torch.tensor([1 + 2j, 3 - 1j], device=device)
    target = torch.zeros(2, device=device)
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target.copy_(source)  # streamed: no reply
            waited = sys._getframe().f_lineno + 1
            values = target.cpu().tolist()
    finally:
        torch.set_warn_always(False)
    assert values == [1.0, 3.0]
    said = [(w.filename, w.lineno) for w in caught if "Casting complex values to real" in str(w.message)]
    assert said == [(__file__, waited)]


def test_a_warning_filtered_as_an_error_raises_at_the_sync_point_and_the_session_goes_on(device):
    """(A first call of a dtype combination has a reply, a later one is streamed: the first
    raises at the call, the second at the sync; either way nothing is left half done.)"""
    condition = torch.tensor([1, 0, 1], dtype=torch.uint8, device=device)
    ones, zeros = torch.ones(3, device=device), torch.zeros(3, device=device)
    live = gpuwire_runtime().live_storages
    torch.set_warn_always(True)
    try:
        for _ in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(UserWarning, match="where received a uint8 condition tensor"):
                    torch.where(condition, ones, zeros).cpu()
    finally:
        torch.set_warn_always(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.where(condition, ones, zeros).cpu().tolist() == [1.0, 0.0, 1.0]
    assert (torch.arange(4, device=device) * 2).cpu().tolist() == [0, 2, 4, 6]
    gpuwire_runtime().synchronize()
    assert gpuwire_runtime().live_storages <= live  # (no result of a call that raised is held)


def test_warnings_the_client_says_itself_are_said_once(device):
    """An out= of the wrong size: the client warns at the call, the node's kernel says it again."""
    local, remote = [
        _said(lambda d: (lambda out: (torch.add(torch.ones(3, device=d), 1, out=out), out)[1])(torch.empty(2, device=d)),
              target) for target in ("cpu", device)]
    local, remote = [(result, [text.split(" (Triggered")[0] for text in said], categories)
                     for result, said, categories in (local, remote)]
    assert len(local[1]) == 1 and remote == local


def test_a_client_without_the_capability_gets_no_warning_notices(fresh_node):
    """A client of an earlier version takes every Notice for a drain notice: the node sends it
    none, and its kernels' warnings stay in the node's log."""
    script = textwrap.dedent(f"""
        import torch, warnings
        from gpuwire.client import runtime
        hello = runtime.Runtime._hello
        def old_hello(self, *args, **kwargs):
            event = hello(self, *args, **kwargs)
            event.capabilities = [c for c in event.capabilities if c != "warnings"]
            return event
        runtime.Runtime._hello = old_hello
        import gpuwire
        gpuwire.attach({fresh_node.address!r})
        torch.set_warn_always(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            values = torch.where(torch.tensor([1, 0], dtype=torch.uint8, device="gpuwire"),
                                 torch.ones(2, device="gpuwire"), torch.zeros(2, device="gpuwire")).cpu().tolist()
        rt = gpuwire.client.device.runtime()
        print(values, [str(w.message)[:30] for w in caught], rt.recovery.notice)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1.0, 0.0] [] None", done.stdout
    assert "where received a uint8 condition tensor" in fresh_node.log_text()


def test_the_nodes_own_complex32_tensors_say_nothing_on_its_stderr(fresh_node):
    """The node's views and result storage of complex32 tensors printed "ComplexHalf support is
    experimental" on its stderr (the embedded node's is the program's terminal) at their first
    use; the client says it once, where the program makes one."""
    code = textwrap.dedent("""
        import warnings, torch, gpuwire
        warnings.simplefilter("ignore")
        x = torch.randn(8).to(torch.complex32).to("gpuwire")
        print((x * 2).to(torch.complex64).cpu().abs().sum().item() > 0)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "GPUWIRE_NODE": fresh_node.address})
    assert done.stdout.strip() == "True", done.stderr
    assert "ComplexHalf support is experimental" not in fresh_node.log_text()
