"""The fair scheduler on its own, with real threads: shares, the virtual floor, ties, exclusion,
forget() and wake-ups under many threads. Each test is bounded in time (a lost wake-up shows
as a thread that never finishes, not as a hung run)."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from gpuwire.node.scheduler import FairScheduler, Forgotten


class FakeSession:
    def __init__(self, name: str, share: float = 1.0):
        self.name = name
        self.share = share
        self.vtime = 0.0
        self.device_seconds = 0.0

    def __repr__(self) -> str:
        return self.name


class Exclusion:
    """Counts sessions inside a turn at once; more than one is a violation."""

    def __init__(self):
        self._lock = threading.Lock()
        self.inside = 0
        self.violations = 0

    def __enter__(self):
        with self._lock:
            self.inside += 1
            if self.inside > 1:
                self.violations += 1

    def __exit__(self, *exc):
        with self._lock:
            self.inside -= 1


def burn(seconds: float) -> None:
    """Use the CPU for ``seconds`` of this thread's CPU time (what a turn is charged)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def waiting(scheduler: FairScheduler) -> int:
    return len(scheduler._waiting)


def run_busy(scheduler, sessions, seconds: float, work: float = 0.001, exclusion=None) -> dict:
    """Each session busy in its own thread for ``seconds``: turn after turn of ``work`` CPU seconds."""
    exclusion = exclusion or Exclusion()
    start = threading.Barrier(len(sessions))
    turns = {s.name: 0 for s in sessions}
    errors = []

    def loop(session):
        try:
            start.wait(timeout=5)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                with scheduler.turn(session), exclusion:
                    burn(work)
                turns[session.name] += 1
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(s,), daemon=True) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 10)
    assert not any(t.is_alive() for t in threads), "a session thread never finished (lost wake-up?)"
    assert not errors, errors
    assert exclusion.violations == 0
    return turns


@pytest.mark.timeout(30)
def test_busy_sessions_get_device_time_by_share_1_2_4():
    scheduler = FairScheduler()
    sessions = [FakeSession("one", 0.25), FakeSession("two", 0.5), FakeSession("four", 1.0)]
    run_busy(scheduler, sessions, seconds=1.5)
    total = sum(s.device_seconds for s in sessions)
    assert total > 0.3
    for s, weight in zip(sessions, (1, 2, 4)):
        fraction = s.device_seconds / total
        assert fraction == pytest.approx(weight / 7, rel=0.10, abs=0.01), \
            {x.name: round(x.device_seconds / total, 3) for x in sessions}
    # the largest share takes turns back to back: the scheduler does not alternate blindly
    assert sessions[2].device_seconds / total > 0.5


@pytest.mark.timeout(30)
def test_an_idle_session_comes_back_at_the_floor_without_banked_credit():
    scheduler = FairScheduler()
    busy, idle = FakeSession("busy"), FakeSession("idle")
    for _ in range(50):  # alone: busy's virtual time runs ahead
        with scheduler.turn(busy):
            burn(0.002)
    assert busy.vtime > 0.05
    with scheduler.turn(idle):
        # lifted to the floor, not left at 0 (which would give it the device for ~0.1 s straight)
        assert idle.vtime == pytest.approx(busy.vtime)
    # both busy from here: they share evenly from the start, idle does not catch up on the past
    busy.device_seconds = idle.device_seconds = 0.0
    run_busy(scheduler, [busy, idle], seconds=0.6)
    total = busy.device_seconds + idle.device_seconds
    assert idle.device_seconds / total == pytest.approx(0.5, abs=0.08)


@pytest.mark.timeout(30)
def test_a_short_idle_gap_does_not_forfeit_a_lead_either():
    """The floor only lifts: a session behind the floor is lifted, one ahead keeps its virtual time."""
    scheduler = FairScheduler()
    a, b = FakeSession("a"), FakeSession("b")
    a.vtime = 5.0
    with scheduler.turn(a):
        pass
    b.vtime = 7.0
    with scheduler.turn(b):
        assert b.vtime == 7.0


@pytest.mark.timeout(30)
def test_ties_go_to_the_earlier_arrival_and_less_virtual_time_goes_first():
    scheduler = FairScheduler()
    holder = FakeSession("holder")
    order = []
    names = ["s0", "s1", "s2", "s3", "s4", "behind"]
    sessions = [FakeSession(n) for n in names]
    sessions[-1].vtime = -1.0  # arrives last, but is owed the most (below the floor only until lifted)
    turn = scheduler.turn(holder)
    turn.__enter__()
    scheduler._floor = -1.0  # let "behind" keep its lead so it must go first
    threads = []
    for i, s in enumerate(sessions):
        def one(s=s):
            with scheduler.turn(s):
                order.append(s.name)
        t = threading.Thread(target=one, daemon=True)
        t.start()
        threads.append(t)
        wait_until(lambda i=i: waiting(scheduler) == i + 1)
    turn.__exit__(None, None, None)
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert order == ["behind", "s0", "s1", "s2", "s3", "s4"]


@pytest.mark.timeout(60)
def test_one_session_at_a_time_and_no_lost_wake_ups_under_many_threads():
    """64 sessions, each doing short turns with random idle gaps (so they keep leaving and
    coming back): every turn completes, never two at once."""
    scheduler = FairScheduler()
    exclusion = Exclusion()
    sessions = [FakeSession(f"s{i}", share=random.Random(i).choice((0.25, 0.5, 1.0))) for i in range(64)]
    per_thread = 150
    done = []

    def loop(session, seed):
        r = random.Random(seed)
        for _ in range(per_thread):
            with scheduler.turn(session), exclusion:
                if r.random() < 0.3:
                    time.sleep(0)  # drop the GIL inside the turn: another thread could run if not excluded
            if r.random() < 0.2:
                time.sleep(r.random() * 0.002)
        done.append(session)

    threads = [threading.Thread(target=loop, args=(s, i), daemon=True) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert not any(t.is_alive() for t in threads), f"{sum(t.is_alive() for t in threads)} threads stuck"
    assert len(done) == len(sessions)
    assert exclusion.violations == 0
    assert scheduler._running is None and not scheduler._waiting


def _queue_behind_a_holder(*names):
    """A scheduler whose device a "holder" session holds (its turn entered), and one thread per
    name waiting for a turn, queued in that order; each records whether it ran or was forgotten.
    Returns the scheduler, the holder's turn, the waiting sessions, their threads, the record."""
    scheduler = FairScheduler()
    turn = scheduler.turn(FakeSession("holder"))
    turn.__enter__()
    outcome = {}

    def wait_for(session):
        try:
            with scheduler.turn(session):
                outcome[session.name] = "ran"
        except Forgotten:
            outcome[session.name] = "forgotten"

    sessions, threads = [], []
    for name in names:
        sessions.append(FakeSession(name))
        threads.append(threading.Thread(target=wait_for, args=(sessions[-1],), daemon=True))
        threads[-1].start()
        wait_until(lambda n=len(threads): waiting(scheduler) == n)
    return scheduler, turn, sessions, threads, outcome


@pytest.mark.timeout(30)
def test_forget_releases_a_waiting_session_and_the_device_stays_usable():
    scheduler, turn, (gone, _), (t_gone, t_next), outcome = _queue_behind_a_holder("gone", "next")
    scheduler.forget(gone)  # it was first in line
    t_gone.join(timeout=5)
    assert outcome == {"gone": "forgotten"}
    scheduler.forget(FakeSession("never seen"))  # a session that is not waiting: nothing to do
    turn.__exit__(None, None, None)
    t_next.join(timeout=5)
    assert outcome == {"gone": "forgotten", "next": "ran"}
    with scheduler.turn(gone):  # a forgotten session that comes back is served like any other
        pass


@pytest.mark.timeout(30)
def test_forgetting_the_session_just_woken_for_a_free_device_passes_the_turn_on():
    scheduler, turn, (woken, _), threads, outcome = _queue_behind_a_holder("woken", "behind")
    turn.__exit__(None, None, None)  # wakes "woken" for the free device ...
    scheduler.forget(woken)  # ... which ends before it looked (this thread still has the GIL)
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads), outcome
    assert outcome["behind"] == "ran"


@pytest.mark.timeout(60)
def test_forgetting_sessions_under_load_strands_nobody():
    """Sessions forgotten at random moments (waiting, woken, running or idle): the rest finish."""
    scheduler = FairScheduler()
    exclusion = Exclusion()
    sessions = [FakeSession(f"s{i}") for i in range(32)]
    stop = threading.Event()
    counts = {"turns": 0, "forgotten": 0}
    lock = threading.Lock()

    def loop(session, seed):
        r = random.Random(seed)
        for _ in range(150):
            try:
                with scheduler.turn(session), exclusion:
                    if r.random() < 0.3:
                        time.sleep(0)
                with lock:
                    counts["turns"] += 1
            except Forgotten:
                with lock:
                    counts["forgotten"] += 1
            if r.random() < 0.2:
                time.sleep(r.random() * 0.001)

    def reaper():
        r = random.Random(99)
        while not stop.is_set():
            scheduler.forget(r.choice(sessions))
            time.sleep(0.0005)

    threads = [threading.Thread(target=loop, args=(s, i), daemon=True) for i, s in enumerate(sessions)]
    killer = threading.Thread(target=reaper, daemon=True)
    killer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    stop.set()
    killer.join(timeout=5)
    assert not any(t.is_alive() for t in threads), f"{sum(t.is_alive() for t in threads)} threads stuck"
    assert counts["turns"] + counts["forgotten"] == 32 * 150
    assert counts["forgotten"] > 0
    assert exclusion.violations == 0
    assert scheduler._running is None and not scheduler._waiting


class Interrupted(Exception):
    pass


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_a_wait_interrupted_by_a_signal_leaves_no_turn_stranded():
    scheduler = FairScheduler()
    holder, me, other = FakeSession("holder"), FakeSession("me"), FakeSession("other")
    ran = []
    entered = threading.Event()
    release = threading.Event()

    def hold():
        with scheduler.turn(holder):
            entered.set()
            release.wait(10)

    def wait_other():
        with scheduler.turn(other):
            ran.append("other")

    def raise_interrupted(signum, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)
    try:
        t_hold = threading.Thread(target=hold, daemon=True)
        t_hold.start()
        entered.wait(5)
        main = threading.get_ident()

        def interrupt_me():
            wait_until(lambda: waiting(scheduler) == 1)  # the main thread waits, first in line
            t_other.start()
            wait_until(lambda: waiting(scheduler) == 2)
            signal.pthread_kill(main, signal.SIGUSR1)

        t_other = threading.Thread(target=wait_other, daemon=True)
        t_int = threading.Thread(target=interrupt_me, daemon=True)
        t_int.start()
        with pytest.raises(Interrupted):
            with scheduler.turn(me):
                ran.append("me")
        t_int.join(5)
        release.set()  # the holder's turn ends: the next in line is "other", not the interrupted waiter
        t_hold.join(5)
        t_other.join(5)
        assert ran == ["other"]
        with scheduler.turn(me):
            ran.append("me")
        assert ran == ["other", "me"]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.timeout(30)
def test_busy_seconds_is_the_time_the_device_was_held():
    scheduler = FairScheduler()
    s = FakeSession("s")
    with scheduler.turn(s):
        time.sleep(0.05)  # holds the device without using the CPU
    assert scheduler.busy_seconds >= 0.05
    assert 0 <= s.device_seconds <= scheduler.busy_seconds
    assert s.vtime == pytest.approx(s.device_seconds / s.share)


@pytest.mark.timeout(30)
def test_a_stretched_turn_is_not_charged_for_time_the_session_did_not_run():
    """A turn whose thread is kept off the CPU (here: sleeping, as a preempted thread would be)
    is charged at most a quantum, so that session does not then wait out a long penalty."""
    scheduler = FairScheduler()
    slow = FakeSession("slow")
    with scheduler.turn(slow):
        time.sleep(0.2)
    assert slow.device_seconds <= 0.0101
    assert scheduler.busy_seconds >= 0.2


def test_a_session_waiting_twice_at_once_is_refused():
    scheduler = FairScheduler()
    holder, s = FakeSession("holder"), FakeSession("s")
    turn = scheduler.turn(holder)
    turn.__enter__()
    def wait_in_another_thread():
        with pytest.raises(Forgotten):
            scheduler.turn(s).__enter__()

    t = threading.Thread(target=wait_in_another_thread, daemon=True)
    t.start()
    wait_until(lambda: waiting(scheduler) == 1)
    with pytest.raises(RuntimeError):
        with scheduler.turn(s):
            pass
    scheduler.forget(s)
    t.join(5)
    turn.__exit__(None, None, None)



@pytest.mark.timeout(30)
def test_a_full_garbage_collection_inside_a_turn_is_not_charged_to_that_session():
    """It frees every session's garbage; charged to one, that session would wait ~n turns for it."""
    import gc

    scheduler = FairScheduler()
    s = FakeSession("s")
    garbage = [[] for _ in range(300_000)]
    for a, b in zip(garbage, garbage[1:]):
        a.append(b)
        b.append(a)
    del garbage, a, b
    with scheduler.turn(s):
        started = time.thread_time()
        gc.collect()
        collected = time.thread_time() - started
    assert collected > 0.01  # the collection did real work ...
    assert s.device_seconds < collected / 4  # ... that the session was not charged for
