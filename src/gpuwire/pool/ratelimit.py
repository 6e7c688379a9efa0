"""Rate limits on the pool's HTTP API: a token bucket per API key, one per role's limit.

Sits between authentication and the endpoints (``service.create_app`` calls ``admit`` from
its auth dependency). Every authenticated request takes a token from its key's bucket; an
empty bucket answers ``429 Too Many Requests`` with ``Retry-After`` and a JSON error saying how
long to wait and how to get a higher limit. Failed authentications (no key, a wrong or
revoked key) are limited per client address, so guessing keys or hammering the pool with
bad ones is slow and cheap to refuse. Nothing here touches the store.

Limits are per role, configured with ``gpuwire pool --rate-limit SPEC`` (or
GPUWIRE_POOL_RATE_LIMIT)::

    tenant=20/40,node=100/200,admin=off,failed-auth=5/30     (the defaults)

``RATE/BURST`` is requests per second and the bucket's size (the burst a client may send at
once); ``RATE`` alone means a burst of twice the rate; ``off`` disables the limit for that
role. A bare ``RATE[/BURST]`` sets the tenant limit. Node keys get a higher limit because a
fleet often shares one node key (each node heartbeats every 2 s).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

from .core import Caller, Problem, key_id_of

ENV = "GPUWIRE_POOL_RATE_LIMIT"
FAILED_AUTH = "failed-auth"
ROLES = ("tenant", "node", "admin", FAILED_AUTH)
MAX_BUCKETS = 100_000  # full (idle) buckets are dropped past this, so addresses cannot fill memory


@dataclass(frozen=True)
class Rate:
    per_second: float
    burst: float

    def __str__(self) -> str:
        return f"{self.per_second:g} requests/s, bursts of {self.burst:g}"


DEFAULT_LIMITS: dict[str, Rate | None] = {
    "tenant": Rate(20.0, 40.0),
    "node": Rate(100.0, 200.0),
    "admin": None,  # exempt: an admin key is the operator's own
    FAILED_AUTH: Rate(5.0, 30.0),
}
DEFAULT_SPEC = "tenant=20/40,node=100/200,admin=off,failed-auth=5/30"


def rounded_up(seconds: float) -> float:
    """A wait as a refusal states it: up to the next millisecond (to the nearest, a wait under
    0.5 ms read "retry after 0", and a client that obeyed it was refused again at once)."""
    return max(0.001, math.ceil(seconds * 1000) / 1000)


class RateLimited(Problem):
    """429: the caller sent more requests than its limit allows."""

    def __init__(self, message: str, retry_after: float, limit: Rate):
        super().__init__(429, "rate_limited", message, retry_after=retry_after, limit=str(limit))
        self.retry_after = retry_after

    @property
    def headers(self) -> dict:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


def parse_limits(spec: str | None) -> dict[str, Rate | None]:
    """Limits from a spec like ``tenant=20/40,admin=off`` (unnamed roles keep their defaults).
    Raises ValueError naming the part it cannot read."""
    limits = dict(DEFAULT_LIMITS)
    if spec is None or not spec.strip():
        return limits
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        role, sep, value = part.partition("=")
        if not sep:
            role, value = "tenant", part
        role = role.strip().lower()
        if role not in ROLES:
            raise ValueError(f"rate limit {part!r}: the role must be one of {', '.join(ROLES)}")
        limits[role] = _parse_rate(value.strip(), part)
    return limits


def _parse_rate(value: str, part: str) -> Rate | None:
    if value.lower() in ("off", "none", "0", "unlimited"):
        return None
    rate_text, _, burst_text = value.partition("/")
    try:
        rate = float(rate_text)
        burst = float(burst_text) if burst_text else 2 * rate
    except ValueError:
        raise ValueError(f"rate limit {part!r}: expected RATE[/BURST] in requests per second, e.g. 20/40, "
                         "or off") from None
    if not (math.isfinite(rate) and math.isfinite(burst)) or rate <= 0 or burst < 1:
        raise ValueError(f"rate limit {part!r}: the rate must be > 0 and the burst >= 1 (or say off)")
    return Rate(rate, burst)


def format_limits(limits: dict[str, Rate | None]) -> str:
    return ", ".join(f"{role} {limit or 'unlimited'}" for role, limit in limits.items())


class RateLimiter:
    """Token buckets keyed by (role, key id) or (failed-auth, client address); thread-safe."""

    def __init__(self, limits: dict[str, Rate | None] | None = None, *, clock=time.monotonic):
        self.limits = dict(DEFAULT_LIMITS if limits is None else limits)
        self._clock = clock
        self._buckets: dict[tuple[str, str], list[float]] = {}  # -> [tokens, last refill time]
        self._authenticated: set[str] = set()  # key ids that authenticated (bounded like the buckets)
        self._lock = threading.Lock()
        self.refused = 0

    @classmethod
    def from_spec(cls, spec: str | None = None) -> "RateLimiter":
        """From a spec, else GPUWIRE_POOL_RATE_LIMIT, else the defaults."""
        return cls(parse_limits(spec if spec is not None else os.environ.get(ENV)))

    # ------------------------------------------------------------ buckets

    def _wait(self, role: str, ident: str, take: bool) -> float:
        """Seconds until a token is available (0: one was taken, when ``take``)."""
        limit = self.limits.get(role)
        if limit is None:
            return 0.0
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get((role, ident))
            if bucket is None:
                if len(self._buckets) >= MAX_BUCKETS:
                    self._prune(now)
                bucket = self._buckets[(role, ident)] = [limit.burst, now]
            else:
                bucket[0] = min(limit.burst, bucket[0] + (now - bucket[1]) * limit.per_second)
                bucket[1] = now
            if bucket[0] >= 1.0:
                if take:
                    bucket[0] -= 1.0
                return 0.0
            return (1.0 - bucket[0]) / limit.per_second

    def _prune(self, now: float) -> None:
        for key, (tokens, stamp) in list(self._buckets.items()):
            limit = self.limits.get(key[0])
            if limit is None or tokens + (now - stamp) * limit.per_second >= limit.burst:
                del self._buckets[key]
        if len(self._buckets) >= MAX_BUCKETS:  # still full: forget failed-auth counts first
            for key in [k for k in self._buckets if k[0] == FAILED_AUTH]:
                del self._buckets[key]

    # ------------------------------------------------------------ checks

    def check(self, caller: Caller) -> None:
        if caller.key_id not in self._authenticated:
            with self._lock:
                if len(self._authenticated) >= MAX_BUCKETS:
                    self._authenticated.clear()
                self._authenticated.add(caller.key_id)
        wait = self._wait(caller.role, caller.key_id, take=True)
        if wait:
            wait = rounded_up(wait)
            self.refused += 1
            limit = self.limits[caller.role]
            raise RateLimited(
                f"too many requests with API key {caller.key_id} ({caller.role} keys may send {limit}); "
                f"retry after {wait:.3f} s. Slow down (poll less often, reuse results), or ask the pool's "
                "admin for a higher limit (gpuwire pool --rate-limit)", wait, limit)

    def admit(self, address: str, key: str | None, authenticate) -> Caller:
        """``authenticate(key)`` (returns the Caller or raises a 401 Problem) under the failed-
        authentication limit of ``address``, then take a token from the key's bucket. A key that
        authenticated before passes a blocked address, so one client's bad keys cannot lock
        out the others behind the same address."""
        known = key is not None and key_id_of(key) in self._authenticated
        wait = 0.0 if known else self._wait(FAILED_AUTH, address, take=False)
        if wait:
            wait = rounded_up(wait)
            self.refused += 1
            limit = self.limits[FAILED_AUTH]
            raise RateLimited(
                f"too many failed authentications from {address} ({limit}); retry after {wait:.3f} s with a "
                "valid API key (set GPUWIRE_API_KEY; an admin makes one with `gpuwire key create`)", wait, limit)
        try:
            caller = authenticate(key)
        except Problem as exc:
            if exc.status == 401:
                self._wait(FAILED_AUTH, address, take=True)
            raise
        self.check(caller)
        return caller


def install(app, limiter: RateLimiter | None = None) -> RateLimiter:
    """Answer RateLimited with 429, Retry-After and the JSON error; return the limiter to use."""
    from fastapi.responses import JSONResponse

    limiter = limiter if limiter is not None else RateLimiter.from_spec()

    @app.exception_handler(RateLimited)
    async def _rate_limited(_request, exc: RateLimited):
        return JSONResponse(exc.as_dict(), status_code=429, headers=exc.headers)

    return limiter
