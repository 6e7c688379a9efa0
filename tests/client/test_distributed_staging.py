"""The host staging under ``torch.distributed`` on gpuwire tensors (``client.distributed``).

The collectives themselves run end to end in ``tests/cli/test_distributed.py`` (``torchrun`` under
``gpuwire run``); this file holds what a whole job cannot show every time.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist
from torch.distributed import AllreduceOptions

from gpuwire.client import distributed


def _gloo_pair():
    store = dist.HashStore()
    groups = [None, None]

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))

    _on_both_ranks(join)
    return groups


def _on_both_ranks(work) -> None:
    """``work(rank)`` on two threads, one a rank; what either raised is raised here."""
    errors = []

    def rank_thread(rank):
        try:
            work(rank)
        except BaseException as error:  # (re-raised below, on the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    if errors:
        raise errors[0]


def test_a_collective_returns_only_once_gloo_has_let_go_of_the_host_copies():
    """gloo's worker thread held a finished collective's tensors a moment after ``wait()`` (in
    ~30 % of them here), and its drop of the last reference to one with a Python object takes the
    GIL: a rank that exited right after a collective died of SIGABRT ("terminate called without an
    active exception") in one CI run. The staging returns only once the worker has let go, so the
    program's thread makes the last drop."""
    groups = _gloo_pair()
    still_held = [0, 0]

    def run(rank):
        for _ in range(400):
            host = torch.ones(4)
            distributed._run_on_host(lambda: groups[rank].allreduce([host], AllreduceOptions()), host)
            assert host.tolist() == [2.0] * 4
            still_held[rank] += host._use_count() > 1

    _on_both_ranks(run)
    assert still_held == [0, 0]
