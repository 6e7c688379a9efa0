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


def test_hogwild_trainers_update_the_parents_shared_model(results):
    """Hogwild training (``model.share_memory()``, the model passed to spawned trainers:
    pytorch/examples' mnist_hogwild ``--cuda``): on a GPU CUDA IPC shares the model, so the
    parent sees its trainers' updates; each gpuwire process held a copy and the parent tested
    an untrained model. Processes on one node now share the storage (two trainers, one after
    the other: weight + 1 + 1, bias * 2 * 2), without a word."""
    assert results["hogwild"] == [[[3.0, 3.0], [3.0, 3.0]], [12.0, 12.0], [0, 0]]
    assert results["copy warnings, shared"] == []
    assert results["copy warnings, not shared"] == []


_SHARED_THEN_ENDED = """
import pickle, sys, warnings, torch, gpuwire
from multiprocessing.reduction import ForkingPickler
weight = torch.nn.Parameter(torch.arange(3.0, device="gpuwire"))
weight.share_memory_()
sent = ForkingPickler.dumps(weight)
same = pickle.loads(sent)  # (a receiver on the same node: the same storage)
with torch.no_grad():
    same.add_(1)
print(weight.tolist(), type(same).__name__)
gpuwire.detach()  # (the sending session ends: what it shared is withdrawn)
gpuwire.attach(sys.argv[1])
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    copy = pickle.loads(sent)
print(copy.tolist(), [str(w.message)[:60] for w in said])
"""


def test_a_shared_tensor_whose_sender_ended_arrives_as_a_copy_and_says_so(node):
    run = subprocess.run([sys.executable, "-c", _SHARED_THEN_ENDED, node.address], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "GPUWIRE_NODE": node.address})
    assert run.returncode == 0, run.stderr
    shared, copied = run.stdout.splitlines()[-2:]
    assert shared == "[1.0, 2.0, 3.0] Parameter"
    assert copied == "[0.0, 1.0, 2.0] ['gpuwire: a device tensor made shared with share_memory_() (M']"
