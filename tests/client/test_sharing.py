"""Device tensors between processes (client/sharing.py): DataLoader workers that return
``.cuda()`` tensors, ``torch.multiprocessing`` queues and process arguments, each in real
processes started under ``gpuwire run``. Before, the sender's queue thread failed
(``_share_fd_: only available on CPU``) and the receiver waited for ever."""

import json
import os
import signal
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_probe.py")


@pytest.fixture(scope="module")
def results(node):
    # its own process group: a hang (the bug this tests) leaves the probe's workers to kill too
    proc = subprocess.Popen([sys.executable, "-m", "gpuwire", "run", "-q", "--node", node.address, "--",
                             sys.executable, PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    line = next((line for line in out.splitlines() if line.startswith("RESULTS ")), None)
    assert line, out[-3000:] + err[-3000:]
    return json.loads(line[len("RESULTS "):])


def test_spawned_dataloader_workers_return_device_tensors(results):
    assert results["loader"] == [["cuda:0", [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]],
                                 ["cuda:0", [[3.0, 3.0], [4.0, 4.0], [5.0, 5.0]]]]


def test_device_tensors_and_parameters_reach_spawned_processes_as_arguments(results):
    assert results["arguments"] == [[rank, [0.0, 2.0, 4.0], "cuda:0", "Parameter", True, [1.0, 1.0]]
                                    for rank in range(2)]
    assert results["exit codes"] == [0, 0, 0]


def test_device_tensors_and_storages_come_back_through_a_queue(results):
    assert results["queue"] == ["cuda:0", [1.0, 2.0, 3.0, 4.0], True, [7]]  # (a storage on the device)


def test_a_non_leaf_tensor_is_refused_with_torchs_own_words(results):
    assert results["non-leaf"].startswith("Cowardly refusing to serialize non-leaf tensor which requires_grad")


def test_plain_pickle_still_round_trips(results):
    assert results["plain pickle"] == [0.0, 1.0, 2.0]


def test_a_forked_child_using_its_parents_device_tensor_gets_cudas_error(results):
    kind, message = results["fork"]
    assert kind == "error" and "Cannot re-initialize CUDA in forked subprocess" in message and "spawn" in message


def test_a_tensor_made_shared_says_it_crosses_as_a_copy(results):
    """Hogwild training (``model.share_memory()``, the model passed to spawned trainers:
    pytorch/examples' mnist_hogwild) expects the trainers' writes in the parent, as CUDA IPC
    gives them; gpuwire's processes each hold a copy, so the program is told so, once, at its
    own line (it went on silently and tested an untrained model). Tensors not made shared
    cross without a word."""
    assert results["copy warnings, not shared"] == []
    [(message, where)] = results["copy warnings, shared"]
    assert message.startswith("gpuwire: a device tensor made shared with share_memory_()") and "copy" in message
    assert where == "multiprocess_probe.py"
