"""Weighted fair sharing of one device between sessions.

Sits between the server's session threads and the device: a session runs a batch of commands
only when it holds the device's turn. Turns go to the waiting session with the least
*virtual time* (device seconds used divided by its share), so busy sessions get device time
in proportion to their shares; a session that was idle comes back at the current virtual
floor (it does not bank credit), which lends an idle session's share to the busy ones.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from time import perf_counter


class FairScheduler:
    def __init__(self):
        self._cond = threading.Condition()
        self._waiting: dict = {}  # session -> arrival number (ties go to the earlier)
        self._running = None
        self._floor = 0.0
        self._arrivals = itertools.count()
        self.busy_seconds = 0.0  # device time of all sessions together (utilization)

    @contextmanager
    def turn(self, session):
        with self._cond:
            if session.vtime < self._floor:
                session.vtime = self._floor
            self._waiting[session] = next(self._arrivals)
            while self._running is not None or self._next() is not session:
                self._cond.wait()
            del self._waiting[session]
            self._running = session
        started = perf_counter()
        try:
            yield
        finally:
            elapsed = perf_counter() - started
            with self._cond:
                session.device_seconds += elapsed
                self.busy_seconds += elapsed
                session.vtime += elapsed / session.share
                self._running = None
                # the floor is the least virtual time among sessions with work (this one included),
                # so only a session coming back from idle is lifted to it
                self._floor = min([s.vtime for s in self._waiting] + [session.vtime])
                self._cond.notify_all()

    def _next(self):
        return min(self._waiting, key=lambda s: (s.vtime, self._waiting[s]))

    def forget(self, session) -> None:
        with self._cond:
            self._waiting.pop(session, None)
            self._cond.notify_all()
