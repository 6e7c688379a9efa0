"""Weighted fair sharing of one device between sessions.

Sits between the server's session threads and the device: a session runs a batch of commands
only when it holds the device's turn (``with scheduler.turn(session):``). Turns go to the
waiting session with the least *virtual time* (device seconds charged divided by its share), so
busy sessions get device time in proportion to their shares; on equal virtual time the session
that started waiting first goes first. A session that was idle comes back at the current
virtual floor (the least virtual time among sessions with work): it does not bank credit, which
lends an idle session's share to the busy ones. Call ``forget(session)`` when a session ends: a
thread still waiting for that session's turn is released with :class:`Forgotten` rather than
left blocked. ``busy_seconds`` is the time the device was held by some session (utilization);
``session.device_seconds`` is what that session was charged.

Handing a turn on. Waiting sessions sit in a heap keyed by (virtual time, arrival); a waiting
session's key cannot change while it waits (only its own finished turns and the floor lift at
arrival move it), so the heap stays valid and the pick is O(log n). Each waiting thread blocks
on a lock of its own; the session ending a turn releases only the heap top's. The woken thread
takes the turn if the device is still free and it is still the top. A session that comes
straight back with less virtual time than the top takes the free device first and the woken one
goes back to sleep: that is how a session with a larger share runs several turns in a row
(handing the turn over unconditionally would make busy sessions alternate, whatever their
shares). So at most two threads wake per turn. The previous design did ``notify_all`` on one
condition: with 64 sessions every turn woke 63 threads, each took the lock, recomputed a min
over all waiters and slept again (O(n) wakeups, O(n^2) work per turn), and those threads
competed with the running session for the GIL and the two cores, stretching its turn.

What a turn is charged: the CPU time of the session's own thread during the turn
(``time.thread_time()``), not its wall time. With many session threads on few cores, a turn's
wall time includes time its thread sat preempted by the OS or waiting for the GIL while other
threads ran; charging that made a session unlucky once wait out ~n turns of penalty (op waits
of 20-30 s under 64 sessions, fairness spread 25-100 %). CPU time counts what the session ran:
with the CPU backend its kernels run on that thread (an intra-op pool's master thread works and
spins at the barrier with the others), and on CUDA a turn's host cost is its launches and, with
the default spinning synchronization, its waits. Measured on 2 cores (bench/tenants.py, 64
sessions, three interleaved runs each): max deviation from mean ops per session 7-11 % charging
CPU time, 10-24 % charging wall time capped below at CPU time and above at the 5 ms quantum,
13-17 % charging wall time capped at the quantum (which also under-charges one kernel longer
than the quantum). What CPU time misses is a turn that waits without using the CPU (a blocking
device synchronization); ``busy_seconds`` counts wall time, since the device is unavailable to
others for the whole turn either way.

A full garbage collection (generation 2) is not charged either: it runs on whichever thread
allocates when one is due and frees everyone's garbage. In the 64-session load test
(tests/node/test_load.py) one 240 ms collection inside a turn put that session 0.24 s of virtual
time ahead, and it then waited 13-22 s while 63 others caught up; young collections are short
and left in. The price is a ``gc.callbacks`` hook that returns at once for young collections.
"""

from __future__ import annotations

import gc
import itertools
import threading
from heapq import heappop, heappush
from time import perf_counter, thread_time


_gc_time = threading.local()  # seconds of full collections run on this thread
_gc_hooked = False


def _time_full_collections(phase: str, info: dict) -> None:
    if info["generation"] != 2:
        return  # young collections take well under a millisecond of CPU: not worth a clock read
    if phase == "start":
        _gc_time.started = thread_time()
    else:
        started = getattr(_gc_time, "started", None)
        if started is not None:
            _gc_time.seconds = getattr(_gc_time, "seconds", 0.0) + thread_time() - started
            _gc_time.started = None


class Forgotten(RuntimeError):
    """The session was forgotten (it ended) while its thread waited for a turn."""


class _Waiter:
    __slots__ = ("session", "gate", "signalled", "cancelled")

    def __init__(self, session):
        self.session = session
        self.gate = threading.Lock()
        self.gate.acquire()  # the waiting thread blocks on its own gate, so a wake-up reaches it alone
        self.signalled = False  # its gate was released and it has not yet looked: never released twice
        self.cancelled = False


class _Turn:
    """One turn on the device: acquired on entry, charged (CPU time, not the garbage collector's)
    and released on exit."""

    __slots__ = ("scheduler", "session", "collecting", "cpu", "wall")

    def __init__(self, scheduler: "FairScheduler", session):
        self.scheduler = scheduler
        self.session = session

    def __enter__(self) -> None:
        self.scheduler._acquire(self.session)
        self.collecting = getattr(_gc_time, "seconds", 0.0)
        self.cpu, self.wall = thread_time(), perf_counter()

    def __exit__(self, *exc) -> None:
        held = perf_counter() - self.wall
        cpu = thread_time() - self.cpu - (getattr(_gc_time, "seconds", 0.0) - self.collecting)
        # min(): a thread's CPU time cannot exceed the wall time; a coarser CPU clock could say otherwise
        self.scheduler._release(self.session, max(0.0, min(cpu, held)), held)


class FairScheduler:
    def __init__(self):
        self._lock = threading.Lock()
        self._heap: list = []  # (vtime, arrival, waiter); cancelled waiters are dropped when they surface
        self._waiting: dict = {}  # session -> its waiter
        self._running = None
        self._floor = 0.0
        self._arrivals = itertools.count()
        self.busy_seconds = 0.0  # time the device was held, all sessions together (utilization)
        global _gc_hooked
        if not _gc_hooked:
            _gc_hooked = True
            gc.callbacks.append(_time_full_collections)

    def turn(self, session) -> "_Turn":
        """``with scheduler.turn(session):`` runs a batch of the session's commands when its
        fair share says so (a class, not a generator: the session loop takes one a batch, and a
        generator-based context manager cost ~2 % of a small model's node time)."""
        return _Turn(self, session)

    def _acquire(self, session) -> None:
        with self._lock:
            if session.vtime < self._floor:
                session.vtime = self._floor
            if session in self._waiting:
                raise RuntimeError(f"session {session!r} is already waiting for a turn in another thread")
            top = self._top()
            # strictly less: on equal virtual time the session already waiting arrived first
            if self._running is None and (top is None or session.vtime < self._heap[0][0]):
                self._running = session
                return
            waiter = _Waiter(session)
            self._waiting[session] = waiter
            heappush(self._heap, (session.vtime, next(self._arrivals), waiter))
        while True:
            try:
                waiter.gate.acquire()
            except BaseException:  # interrupted (KeyboardInterrupt in the main thread): pass the wake-up on
                self._abandon(waiter)
                raise
            with self._lock:
                waiter.signalled = False
                if waiter.cancelled:
                    raise Forgotten(f"session {session!r} ended while waiting for the device")
                if self._running is not None:
                    continue  # a session that came back with less virtual time took the free device first
                top = self._top()
                if top is waiter:
                    heappop(self._heap)
                    del self._waiting[session]
                    self._running = session
                    return
                wake = self._mark(top)
            if wake is not None:
                wake.gate.release()

    def _release(self, session, charged: float, held: float) -> None:
        with self._lock:
            session.device_seconds += charged
            self.busy_seconds += held
            session.vtime += charged / session.share
            self._running = None
            top = self._top()
            # the floor is the least virtual time among sessions with work (this one included),
            # so only a session coming back from idle is lifted to it
            self._floor = session.vtime if top is None else min(self._heap[0][0], session.vtime)
            # the device stays free until the woken session takes it: if this session comes straight
            # back with less virtual time than the top, it takes it first (a larger share runs
            # several turns in a row) and the woken one goes back to waiting
            wake = self._mark(top)
        if wake is not None:
            wake.gate.release()

    def _top(self):
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heappop(heap)
        return heap[0][2] if heap else None

    @staticmethod
    def _mark(waiter):
        """The waiter to wake once the lock is let go, unless it has a wake-up it has not seen yet."""
        if waiter is None or waiter.signalled:
            return None
        waiter.signalled = True
        return waiter

    def _abandon(self, waiter) -> None:
        with self._lock:
            if self._waiting.get(waiter.session) is waiter:
                del self._waiting[waiter.session]
            waiter.cancelled = True
            wake = self._mark(self._top()) if self._running is None else None
        if wake is not None:
            wake.gate.release()

    def forget(self, session) -> None:
        with self._lock:
            waiter = self._waiting.pop(session, None)
            if waiter is None:
                return
            waiter.cancelled = True
            wake = [self._mark(waiter)]
            if self._running is None:  # it may have been the one woken for the free device
                wake.append(self._mark(self._top()))
        for w in wake:
            if w is not None:
                w.gate.release()
