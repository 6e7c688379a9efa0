"""Placement rules, as pure functions: whole vs fractional, stranding, multi-GPU, constraints."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwire.pool.placement import Gpu, Request, Slot, apply, could_ever_fit, fits, free_summary, place, shortfall

GIB = 1 << 30


def gpu(node="n1", index=0, memory=16 * GIB, name="NVIDIA A100-SXM4-80GB", **kw) -> Gpu:
    return Gpu(node_id=node, index=index, name=name, memory=memory, **kw)


def where(slots):
    return [(s.node_id, s.index) for s in slots] if slots is not None else None


def test_whole_request_takes_an_empty_gpu_with_all_its_memory():
    gpus = [gpu("n1", 0, used_share=0.25, used_memory=GIB, sessions=1), gpu("n2", 0)]
    slots = place(Request(), gpus)
    assert slots == [Slot("n2", 0, 16 * GIB, 1.0)]


def test_whole_request_never_shares_a_gpu():
    gpus = [gpu("n1", 0, used_share=0.1, used_memory=GIB, sessions=1)]
    assert place(Request(), gpus) is None
    assert place(Request(memory=GIB), gpus) is None


def test_fractional_request_goes_to_an_already_shared_gpu_not_a_whole_one():
    gpus = [gpu("n1", 0), gpu("n2", 0, used_share=0.5, used_memory=4 * GIB, sessions=1), gpu("n3", 0)]
    assert where(place(Request(share=0.25, memory=GIB), gpus)) == [("n2", 0)]


def test_fractional_prefers_the_most_used_gpu_that_still_fits():
    gpus = [gpu("a", 0, used_share=0.25, used_memory=GIB, sessions=1),
            gpu("b", 0, used_share=0.5, used_memory=GIB, sessions=1),
            gpu("c", 0, used_share=0.75, used_memory=GIB, sessions=1)]
    assert where(place(Request(share=0.25, memory=GIB), gpus)) == [("c", 0)]   # fills c exactly
    assert where(place(Request(share=0.5, memory=GIB), gpus)) == [("b", 0)]    # c has no room; b is fuller than a


def test_fractional_packing_leaves_the_other_gpus_whole():
    gpus = [gpu("n1", 0), gpu("n2", 0)]
    for share in (0.25, 0.25, 0.5):
        slots = place(Request(share=share, memory=GIB), gpus)
        assert where(slots) == [("n1", 0)]
        gpus = apply(gpus, slots)
    assert gpus[0].used_share == pytest.approx(1.0) and gpus[0].sessions == 3
    assert gpus[1].empty
    assert where(place(Request(), gpus)) == [("n2", 0)]  # the whole-GPU request still fits


def test_fractional_opens_a_gpu_on_the_node_with_fewest_empty_gpus():
    # n-big has 4 empty GPUs, n-small 1: slicing n-small keeps n-big whole for a 4-GPU job
    gpus = [gpu("n-big", i) for i in range(4)] + [gpu("n-small", 0)]
    assert where(place(Request(share=0.5), gpus)) == [("n-small", 0)]


def test_whole_request_takes_the_smallest_gpu_that_fits():
    gpus = [gpu("n1", 0, memory=80 * GIB), gpu("n2", 0, memory=24 * GIB), gpu("n3", 0, memory=40 * GIB)]
    assert where(place(Request(memory=30 * GIB), gpus)) == [("n3", 0)]
    assert where(place(Request(), gpus)) == [("n2", 0)]


def test_single_gpu_request_does_not_break_up_a_big_free_node():
    gpus = [gpu("big", i) for i in range(8)] + [gpu("small", 0), gpu("small", 1)]
    assert where(place(Request(), gpus))[0][0] == "small"


def test_multi_gpu_lease_goes_to_one_node_the_tightest_that_suffices():
    gpus = ([gpu("eight", i) for i in range(8)] + [gpu("four", i) for i in range(4)]
            + [gpu("two", i) for i in range(2)])
    slots = place(Request(gpus=4), gpus)
    assert {n for n, _ in where(slots)} == {"four"} and len(slots) == 4
    assert {n for n, _ in where(place(Request(gpus=2), gpus))} == {"two"}
    assert {n for n, _ in where(place(Request(gpus=6), gpus))} == {"eight"}


def test_multi_gpu_spreads_over_as_few_nodes_as_possible_when_no_node_has_enough():
    gpus = [gpu("a", 0), gpu("a", 1), gpu("b", 0), gpu("b", 1), gpu("b", 2), gpu("c", 0)]
    slots = place(Request(gpus=4), gpus)
    assert sorted(where(slots)) == [("a", 0), ("b", 0), ("b", 1), ("b", 2)]
    assert place(Request(gpus=7), gpus) is None


def test_multi_gpu_skips_busy_gpus():
    gpus = [gpu("a", 0, used_share=0.25, used_memory=GIB, sessions=1), gpu("a", 1), gpu("b", 0), gpu("b", 1)]
    assert {n for n, _ in where(place(Request(gpus=2), gpus))} == {"b"}


def test_model_constraint():
    gpus = [gpu("n1", 0, name="NVIDIA A100-SXM4-80GB"), gpu("n2", 0, name="NVIDIA H100 80GB HBM3")]
    assert where(place(Request(model="h100"), gpus)) == [("n2", 0)]
    assert where(place(Request(model="A100", share=0.5), gpus)) == [("n1", 0)]
    assert place(Request(model="V100"), gpus) is None
    assert "model 'V100'" in shortfall(Request(model="V100"), gpus)
    assert not could_ever_fit(Request(model="V100"), gpus)


def test_label_constraint_and_backend_label():
    gpus = [gpu("n1", 0, labels={"zone": "a"}), gpu("n2", 0, labels={"zone": "b"}, backend="cpu")]
    assert where(place(Request(labels={"zone": "b"}), gpus)) == [("n2", 0)]
    assert where(place(Request(labels={"backend": "cuda"}), gpus)) == [("n1", 0)]
    assert place(Request(labels={"zone": "c"}), gpus) is None


def test_max_sessions_per_gpu():
    g = gpu("n1", 0, max_sessions=2)
    gpus = [g]
    for _ in range(2):
        gpus = apply(gpus, place(Request(share=0.1, memory=GIB), gpus))
    assert gpus[0].sessions == 2 and gpus[0].free_share == pytest.approx(0.8)
    assert place(Request(share=0.1, memory=GIB), gpus) is None
    assert "maximum number of sessions" in shortfall(Request(share=0.1), gpus)


def test_memory_budget_limits_fractional_fit():
    gpus = [gpu("n1", 0, memory=8 * GIB, used_share=0.25, used_memory=7 * GIB, sessions=1)]
    assert place(Request(share=0.25, memory=2 * GIB), gpus) is None
    assert where(place(Request(share=0.25, memory=GIB), gpus)) == [("n1", 0)]


def test_default_memory_budget_is_the_share_of_the_gpu():
    slots = place(Request(share=0.25), [gpu("n1", 0, memory=16 * GIB)])
    assert slots[0].memory == 4 * GIB and slots[0].share == 0.25


def test_shares_add_up_exactly_without_float_trouble():
    gpus = [gpu("n1", 0)]
    for share in (0.1, 0.2, 0.3, 0.4):
        slots = place(Request(share=share, memory=GIB), gpus)
        assert slots is not None, share
        gpus = apply(gpus, slots)
    assert place(Request(share=0.01, memory=1), gpus) is None


def test_could_ever_fit_distinguishes_busy_from_impossible():
    gpus = [gpu("n1", 0, memory=8 * GIB, exclusive=True, sessions=1, used_share=1.0, used_memory=8 * GIB)]
    assert place(Request(), gpus) is None
    assert could_ever_fit(Request(), gpus)
    assert not could_ever_fit(Request(memory=9 * GIB), gpus)
    assert not could_ever_fit(Request(gpus=2), gpus)


def test_free_summary():
    gpus = apply([gpu("n1", 0), gpu("n2", 0)], [Slot("n1", 0, 4 * GIB, 0.25)])
    free = free_summary(gpus)
    assert free["whole_gpus_free"] == 1
    assert free["gpus"][0]["free_share"] == pytest.approx(0.75) and free["gpus"][0]["free_memory"] == 12 * GIB
    assert free["largest_slice"]["node_id"] == "n2"


@pytest.mark.parametrize("kwargs", [dict(gpus=0), dict(share=0.0), dict(share=1.5), dict(memory=-1),
                                    dict(gpus=2, share=0.5)])
def test_request_validation(kwargs):
    with pytest.raises(ValueError):
        Request(**kwargs)


@st.composite
def requests(draw):
    if draw(st.booleans()):
        return Request(gpus=draw(st.integers(1, 3)), memory=draw(st.one_of(st.none(), st.integers(0, 20 * GIB))))
    return Request(share=draw(st.sampled_from([0.1, 0.125, 0.25, 0.3, 0.5, 0.75])),
                   memory=draw(st.one_of(st.none(), st.integers(0, 12 * GIB))))


@settings(max_examples=150, deadline=None)
@given(st.lists(requests(), min_size=1, max_size=25))
def test_placement_never_overcommits_a_gpu(reqs):
    gpus = [gpu("a", 0, max_sessions=4), gpu("a", 1, memory=8 * GIB, max_sessions=4), gpu("b", 0, max_sessions=4)]
    for request in reqs:
        slots = place(request, gpus)
        if slots is None:
            continue
        assert len(slots) == request.gpus and len({(s.node_id, s.index) for s in slots}) == request.gpus
        for s in slots:
            target = next(g for g in gpus if (g.node_id, g.index) == (s.node_id, s.index))
            assert fits(request, target)
        gpus = apply(gpus, slots)
        for g in gpus:
            assert g.used_share <= 1.0 + 1e-9
            assert g.used_memory <= g.memory
            assert g.sessions <= g.max_sessions
            assert not g.exclusive or g.sessions == 1
