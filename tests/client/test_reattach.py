"""A process that attaches again (another node, or the same one: a notebook's ``%gpuwire attach``,
``gpuwire.attach`` twice) starts a new session; the tensors of the session it ended are gone
with it. Using one must say so, never read or write the new session's memory: both sessions
gave out the same storage ids, and such a tensor read another tensor's values (session 29)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, torch, gpuwire
    first, second = sys.argv[1:3]
    gpuwire.attach(first)
    old = torch.full((4,), 7.0, device="gpuwire")
    kept = (old * 2).cpu()  # what a user keeps across the switch: a host copy
    gpuwire.attach(second)
    new = torch.full((4,), 1.0, device="gpuwire")
    def outcome(call):
        try:
            return f"value {call()}"
        except RuntimeError as exc:
            return f"raised {type(exc).__name__}: {exc}"
    print("read:", outcome(lambda: old.cpu().tolist()))
    print("op:", outcome(lambda: (old + new).sum().item()))
    print("in place:", outcome(lambda: (old.add_(5), gpuwire.synchronize())))
    print("new:", new.cpu().tolist())
    print("kept:", kept.to("gpuwire").cpu().tolist())
    gpuwire.attach(first)  # back on the first node: a new session there too
    print("back:", outcome(lambda: old.cpu().tolist()))
""")


def test_a_tensor_of_an_ended_session_says_so_and_never_touches_the_new_sessions_memory(node, fresh_node):
    done = subprocess.run([sys.executable, "-c", SCRIPT, node.address, fresh_node.address],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    for case in ("read", "op", "in place", "back"):
        assert lines[case].startswith("raised RemoteRuntimeError: this device tensor was made in an earlier gpuwire "
                                      f"session of this process, on node {node.address}"), (case, lines[case])
        assert "t.cpu()" in lines[case]
    assert lines["new"] == "[1.0, 1.0, 1.0, 1.0]"  # neither read nor written through the old tensor
    assert lines["kept"] == "[14.0, 14.0, 14.0, 14.0]"
