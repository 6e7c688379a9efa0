"""Reads of small integer/boolean tensors whose values the client knows (uploaded from the
host, or computed from such by exact ops) need no round trip; anything that may write into a
storage makes the client forget what it knew, so a read after it asks the node again."""

import pytest
import torch

import gpuwire


def _round_trips() -> int:
    return gpuwire.stats()["round_trips"]


def _mask_checks(host, device):
    mask = host.to(device)
    padding = mask.bool()
    assert bool(padding[:, -16:].all()) is False
    assert bool(padding[:2].all()) is True
    assert torch.all(mask == 1).item() is False
    assert mask.sum().item() == host.sum().item()
    assert mask.sum(dim=1).tolist() == host.sum(dim=1).tolist()
    assert (mask != 0).any(dim=0).tolist() == (host != 0).any(dim=0).tolist()
    assert torch.equal(mask.cpu(), host)
    assert torch.equal(padding[1:3, ::3].cpu(), host.bool()[1:3, ::3])


def test_a_padding_mask_check_needs_no_round_trip(device):
    """What transformers' masking code does with an attention mask at every forward. (The
    first call of an op with new argument metadata learns its output layout from C++'s
    generic kernel, which writes into an out= tensor: that call reads from the node.)"""
    host = torch.ones(8, 32, dtype=torch.long)
    host[3, 28:] = 0
    for _ in range(2):  # (and an op's first call with a dtype other than float32/64 runs with a reply)
        _mask_checks(host, device)
    before = _round_trips()
    _mask_checks(host, device)
    assert _round_trips() == before, "reads of values the client computed went to the node"


def test_values_from_the_node_are_still_read_from_it(device):
    x = torch.randn(16).to(device)
    before = _round_trips()
    assert (x > 0).all().item() is bool((x.cpu() > 0).all())  # from float data: the node's answer
    labels = torch.randint(0, 5, (16,)).to(device)
    shifted = labels + 1  # not an exact-op mirror: asked of the node
    assert shifted.tolist() == [v + 1 for v in labels.tolist()]
    assert _round_trips() >= before + 2


WRITES = {
    "index assignment": lambda m: m.__setitem__((0, 0), 0),
    "fill_": lambda m: m.fill_(3),
    "zero_ through a view": lambda m: m[:, 1:].zero_(),
    "add_ (structured, in place)": lambda m: m.add_(2),
    "masked_fill_": lambda m: m.masked_fill_(m == 1, 5),
    "out=": lambda m: torch.add(m, 7, out=m),
    "copy_ from the host": lambda m: m.copy_(torch.full((4, 6), 9)),
    "copy_ of part from the host": lambda m: m[1].copy_(torch.arange(6)),
    "copy_ from the device": lambda m: m.copy_(torch.randn(4, 6).mul(10).to(m.device).long()),
    "through .data": lambda m: m.data.fill_(4),
    "_foreach_add_": lambda m: torch._foreach_add_([m], 1),
    "scatter_": lambda m: m.scatter_(1, torch.zeros(4, 1, dtype=torch.long, device=m.device), 8),
    "index_put_ by a device mask": lambda m: m.__setitem__(m > 0, 6),
}


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_a_write_makes_the_client_forget(device, write):
    host = torch.ones(4, 6, dtype=torch.long)
    mask = host.to(device)
    derived = mask.bool()
    assert mask.all().item() is True  # known, and ``derived`` too
    WRITES[write](mask)
    expected = mask.cpu()  # (a read after a write: always the node's bytes, checked below)
    reference = host.clone()
    if write == "copy_ from the device":
        reference = expected.clone()  # random: compare the node's answer with itself below
    else:
        torch.manual_seed(0)
        WRITES[write](reference)
    assert torch.equal(expected, reference), write
    assert mask.all().item() is bool(reference.all())
    assert mask.sum().item() == reference.sum().item()
    assert bool(derived.all()) is True  # its own storage: the write did not touch it


def test_off_switch(device, monkeypatch):
    from gpuwire.client import mirror
    monkeypatch.setattr(mirror, "ENABLED", False)
    mask = torch.ones(4, dtype=torch.long).to(device)
    mask.all()  # (warm-up: an op's first call with integer dtypes has a reply, whichever test runs first)
    before = _round_trips()
    assert mask.all().item() is True
    assert _round_trips() == before + 1


@pytest.mark.parametrize("value", [1.5, float("inf"), float("-inf"), float("nan")])
def test_a_nan_or_inf_check_of_a_loss_costs_one_round_trip(device, value):
    """transformers' Trainer checks every step's loss with ``torch.isnan(loss) or
    torch.isinf(loss)``: the first read brings the loss along, the second test is answered
    from it."""
    x = torch.tensor([value, 2.0]).to(device)
    for attempt in range(2):  # (the first pass learns the ops' output layouts)
        loss = (x * 1.0).sum()
        before = _round_trips()
        flagged = bool(torch.isnan(loss) or torch.isinf(loss))
        trips = _round_trips() - before
        assert flagged is (value != 1.5)
        assert str(loss.item()) == str(float(torch.tensor([value, 2.0]).sum()))
        assert bool(torch.isinf(loss)) is (abs(value) == float("inf"))
        assert bool(torch.isnan(loss)) is (value != value)
    assert trips == 1


def test_repeated_reads_of_a_small_result_cost_one_round_trip(device):
    x = torch.randn(64).to(device)
    loss = (x * x).mean()
    before = _round_trips()
    first = loss.item()
    assert loss.item() == first and float(loss) == first and loss.tolist() == first
    assert _round_trips() == before + 1
    loss.mul_(2)  # a write: the next read asks the node
    assert loss.item() == first * 2
    assert _round_trips() == before + 2


def test_writes_elsewhere_keep_what_is_known(device):
    """Only the storages an op writes are forgotten (from the op's schema): an optimizer
    step between the upload of a mask and its check does not cost a round trip."""
    # (an op's first call with a dtype combination runs with a reply, which empties the table:
    # proven here, on throwaway tensors, before the mask is uploaded)
    throwaway = torch.zeros(4, dtype=torch.long).to(device)
    torch.add(throwaway, 1, out=throwaway)
    assert throwaway.bool().all().item() is True
    mask = torch.ones(4, 8, dtype=torch.long).to(device)
    weights = torch.randn(8).to(device)
    other = torch.zeros(4, dtype=torch.long).to(device)
    for attempt in range(2):  # (the first pass learns the ops' output layouts)
        before = _round_trips()
        weights.add_(1.0)
        torch._foreach_mul_([weights], 0.5)
        torch.add(other, 1, out=other)
        assert mask.bool().all().item() is True
    assert _round_trips() == before
    assert torch.equal(other.cpu(), torch.full((4,), 2))  # written: read from the node
    assert _round_trips() == before + 1
    absolute = torch.empty(4, 8, dtype=torch.long, device=device)
    torch.abs(mask.neg(), out=absolute)  # an out= op of known values (its .out overload)
    assert torch.equal(absolute.cpu(), torch.ones(4, 8, dtype=torch.long))
    torch.abs(mask, out=mask[:2])  # writes a view of the mask: the mask is forgotten
    assert mask.sum().item() == 32


def test_an_exact_op_of_a_mask_keeps_the_mask_known(device):
    """``abs``, ``logical_not``, ``isinf`` of a mask are sent whole (client/fused.py), and such
    ops made the client forget their inputs: the next ``mask.sum()`` was a round trip."""
    host = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for attempt in range(3):  # (first calls with new signatures and dtypes have replies)
        mask = host.to(device)
        before = _round_trips()
        assert mask.abs().sum().item() == 3 and mask.logical_not().sum(dim=1).tolist() == [1, 2]
        assert mask.logical_or(mask).any().item() is True and mask.isinf().any().item() is False
        assert mask.sum().item() == 3 and mask.tolist() == host.tolist()
    assert _round_trips() == before


def test_an_op_that_writes_what_its_schema_does_not_say(device):
    """``native_batch_norm`` updates its running statistics, which its schema does not mark
    as written: a read of them in between must not answer the next read."""
    torch.manual_seed(0)
    local = torch.nn.BatchNorm1d(4)
    remote = torch.nn.BatchNorm1d(4).to(device)
    x = torch.randn(8, 4)
    for _ in range(3):
        local(x)
        remote(x.to(device))
        assert torch.equal(remote.running_mean.cpu(), local.running_mean)
        assert torch.equal(remote.running_var.cpu(), local.running_var)
        assert remote.num_batches_tracked.item() == local.num_batches_tracked.item()


@pytest.mark.parametrize("write", [
    lambda x: x.copy_(x.t()),
    lambda x: torch.logical_not(x.t(), out=x),
    lambda x: torch.eq(x.t(), True, out=x),
    lambda x: torch.bitwise_not(x.t(), out=x),
])
def test_a_write_refused_for_overlapping_its_source_is_not_known(device, write):
    """A copy or out= op whose target is its source's storage seen another way: the kernel
    refuses the partial overlap and writes nothing (local CPU raises at the line; the node
    raises it at the next sync point). The client mirrored the refused result, so every read
    after it returned values the tensor never had, without raising the node's error."""
    values = [[True, False], [True, True]]
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        write(torch.tensor(values))
    x = torch.tensor(values).to(device)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        write(x)
        x.cpu()
    assert torch.equal(x.cpu(), torch.tensor(values))  # what the node holds: unchanged, as on CPU
    torch.logical_not(x, out=x)  # exactly itself: valid, and still right
    assert x.tolist() == [[False, True], [False, False]]


def test_a_failure_on_the_node_makes_the_client_forget_what_it_knew(device):
    """An error raised at a sync point may belong to any queued op, including one whose result
    the client mirrored: after it, reads go to the node again."""
    torch.randn(3, device=device).index_select(0, torch.tensor([1]).to(device))  # (its dtypes proven: queued)
    mask = torch.tensor([1, 0, 1, 1]).to(device)
    kept = mask.bool()
    assert kept.tolist() == [True, False, True, True]
    before = _round_trips()
    assert kept.tolist() == [True, False, True, True] and _round_trips() == before  # known
    torch.randn(3, device=device).index_select(0, torch.tensor([7]).to(device))  # fails on the node
    with pytest.raises(gpuwire.RemoteError, match="index"):
        gpuwire.synchronize()
    before = _round_trips()
    assert kept.tolist() == [True, False, True, True]
    assert _round_trips() == before + 1, "a value from before the failure was answered by the client"


def test_a_full_table_keeps_a_mask_uploaded_a_moment_ago(device):
    """The table of known values is bounded; full, it drops its oldest entries, not all of them:
    emptied whole, the upload after the mask (the labels) dropped the mask's values before its
    ``padding_mask.all()``, and one masked-BERT training step in ~230 read it from the node."""
    from gpuwire.client import device as client_device
    from gpuwire.client import mirror

    rt = client_device.runtime()
    bool(torch.ones(4, 16, dtype=torch.long).to(device).all())  # (the op's first call learns its layout)
    rt.mirror.clear()  # (what earlier tests left)
    kept = [torch.full((4,), i).to(device) for i in range(mirror.MAX_ENTRIES)]  # live: never freed
    assert len(rt.mirror) >= mirror.MAX_ENTRIES - 1
    while len(rt.mirror) >= mirror.MAX_ENTRIES:  # one entry short of full
        rt.mirror.pop(next(iter(rt.mirror)))
    host = torch.ones(4, 16, dtype=torch.long)
    host[1, 10:] = 0
    mask = host.to(device)
    labels = torch.tensor([0, 1, 1, 0]).to(device)  # fills the table
    before = _round_trips()
    assert bool(mask.all()) is False
    assert labels.tolist() == [0, 1, 1, 0]
    assert _round_trips() == before, "the mask's values were dropped with the whole table"
    del kept


def test_freed_storages_leave_the_table(device):
    from gpuwire.client import device as client_device

    rt = client_device.runtime()
    rt._collect_garbage()
    before = len(rt.mirror)
    for i in range(200):
        t = torch.full((8,), i).to(device)
        assert t.sum().item() == 8 * i  # known: no round trip, two entries
        del t
    rt._collect_garbage()
    assert len(rt.mirror) <= before + 2


def test_iterating_a_device_tensor_reads_it_once(device):
    """``for token in ids: int(token)``, ``all(t == x)``: each element's ``.item()`` was a round
    trip (a 1M-element loop in PyTorch's own tests took 100 s). A second element read of the same
    storage reads all of it (up to 1 MiB), and the rest are answered here."""
    values = {torch.int64: torch.arange(1000) * 3 - 7, torch.float32: torch.linspace(-2, 5, 1000) ** 3,
              torch.bool: torch.arange(1000) % 3 == 0}
    for dtype, host in values.items():
        computed = (host.to(device) + 0) if dtype is not torch.bool else host.to(device) & True  # (on the node)
        gpuwire.synchronize()
        before = _round_trips()
        got = [v.item() for v in computed]
        assert got == host.tolist(), dtype
        assert _round_trips() - before == 2, dtype
    a, b = torch.arange(40).to(device) * 2, torch.arange(40).to(device) * 5
    gpuwire.synchronize()
    before = _round_trips()
    assert sum(int(x) * int(y) for x, y in zip(a, b)) == sum(x * 2 * x * 5 for x in range(40))
    assert _round_trips() - before == 4  # (two storages read in turn: two reads of each)


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_a_write_after_iterating_is_read_from_the_node(device, write):
    host = torch.arange(24, dtype=torch.long).view(4, 6) * 3 - 5
    mask = host.to(device) + 0  # (computed on the node)
    assert [int(v) for v in mask.view(-1)[:3]] == host.view(-1)[:3].tolist()  # (now mirrored whole)
    WRITES[write](mask)
    expected = mask.cpu()
    reference = host.clone()
    if write == "copy_ from the device":
        reference = expected.clone()
    else:
        torch.manual_seed(0)
        WRITES[write](reference)
    assert torch.equal(expected, reference), write
    assert [int(v) for v in mask.view(-1)] == reference.view(-1).tolist(), write
