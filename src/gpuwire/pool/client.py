"""A small synchronous client of the pool's HTTP API (httpx).

Sits at the edge of everything that talks to the pool: the CLI (``gpuwire tenant|key|ls``,
``smi --pool``), the node agent (register + heartbeats) and ``gpuwire run --pool`` (ask for a
lease, wait in the queue, keep it alive in the background, release it).

Errors: a refusal by the pool raises ``PoolError`` with the HTTP ``status``, the pool's error
``code`` and its ``message``; a pool that cannot be reached raises ``PoolUnreachable``.

    client = PoolClient("http://pool:7000", api_key)           # or GPUWIRE_POOL / GPUWIRE_API_KEY
    with client.lease(share=0.25, memory="4GiB", wait=300,
                      on_position=lambda n, _: print(f"waiting for a GPU: {n} in queue")) as lease:
        gpuwire.attach(lease.address, token=lease.token)       # renewed in the background meanwhile
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import httpx

from .sizes import parse_size

log = logging.getLogger("gpuwire.pool.client")


class PoolError(Exception):
    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 body: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.body = message, status, code, body or {}


class PoolUnreachable(PoolError):
    pass


def _retry_after(response, body) -> float | None:
    """Seconds a 429 asks to wait: the JSON body's exact figure, else the Retry-After header."""
    exact = body.get("retry_after") if isinstance(body, dict) else None
    if type(exact) in (int, float) and 0 <= exact < 3600:
        return float(exact)
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


class PoolClient:
    def __init__(self, url: str | None = None, api_key: str | None = None, *, timeout: float = 10.0,
                 max_rate_wait: float = 30.0):
        url = url or os.environ.get("GPUWIRE_POOL")
        if not url:
            raise PoolError("no pool given: pass --pool URL or set GPUWIRE_POOL (e.g. http://pool-host:7000)")
        self.url = normalize_url(url)
        self.api_key = api_key if api_key is not None else os.environ.get("GPUWIRE_API_KEY")
        self.timeout = timeout
        # a request refused with 429 was not processed: wait as the pool says and send it again,
        # up to this many seconds per call, then raise the pool's message
        self.max_rate_wait = max_rate_wait
        headers = {"User-Agent": "gpuwire-pool-client"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        from ..security.tls import TLSConfigError, client_context_from_env
        try:  # an HTTPS pool signed by a private CA: GPUWIRE_TLS_CA (+ GPUWIRE_TLS_CERT/KEY for mutual TLS)
            verify = client_context_from_env() or True
        except TLSConfigError as exc:
            raise PoolError(str(exc)) from None
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, verify=verify)

    def clone(self) -> "PoolClient":
        return PoolClient(self.url, self.api_key, timeout=self.timeout, max_rate_wait=self.max_rate_wait)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ plumbing

    def call(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> tuple[int, dict]:
        waited = 0.0
        while True:
            try:
                response = self._http.request(method, path, json=json, params=params)
            except httpx.TransportError as exc:
                raise PoolUnreachable(f"cannot reach the pool at {self.url}: {exc or type(exc).__name__}") from None
            try:
                body = response.json()
            except ValueError:
                body = {"message": response.text[:500]}
            if response.status_code != 429:
                break
            pause = _retry_after(response, body)
            if pause is None or waited + pause > self.max_rate_wait:
                break
            log.info("pool rate limit: %s %s waits %.2f s as told", method, path, pause)
            time.sleep(pause)
            waited += pause
        if response.status_code >= 400:
            message = body.get("message") if isinstance(body, dict) else None
            raise PoolError(message or f"the pool answered HTTP {response.status_code}", status=response.status_code,
                            code=body.get("error") if isinstance(body, dict) else None,
                            body=body if isinstance(body, dict) else {})
        return response.status_code, body

    def _get(self, path: str, **params) -> dict:
        return self.call("GET", path, params={k: v for k, v in params.items() if v is not None} or None)[1]

    # ------------------------------------------------------------ pool

    def health(self) -> dict:
        return self._get("/v1/health")

    def version(self) -> dict:
        return self._get("/v1/version")

    def status(self) -> dict:
        return self._get("/v1/status")

    def signing_key(self) -> dict:
        return self._get("/v1/signing-key")

    def wait_ready(self, timeout: float = 30.0) -> dict:
        """Wait until the pool answers its health check."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.health()
            except PoolUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    # ------------------------------------------------------------ nodes

    def register_node(self, node_id: str, address: str, gpus: list[dict], *, labels: dict | None = None,
                      boot_id: str = "", version: str = "") -> dict:
        return self.call("POST", "/v1/nodes", json={"id": node_id, "address": address, "gpus": gpus,
                                                     "labels": labels or {}, "boot_id": boot_id,
                                                     "version": version})[1]

    def heartbeat(self, node_id: str, *, boot_id: str = "", usage: dict | None = None) -> dict:
        body: dict = {"boot_id": boot_id}
        if usage is not None:
            body["usage"] = usage
        return self.call("POST", f"/v1/nodes/{node_id}/heartbeat", json=body)[1]

    def deregister_node(self, node_id: str) -> dict:
        return self.call("DELETE", f"/v1/nodes/{node_id}")[1]

    def nodes(self) -> list[dict]:
        return self._get("/v1/nodes")["nodes"]

    def node(self, node_id: str) -> dict:
        return self._get(f"/v1/nodes/{node_id}")

    # ------------------------------------------------------------ tenants and keys

    def create_tenant(self, name: str, *, max_gpus: float | None = None, max_memory: int | str | None = None) -> dict:
        body = {"name": name, "max_gpus": max_gpus,
                "max_memory": parse_size(max_memory) if max_memory is not None else None}
        return self.call("POST", "/v1/tenants", json=body)[1]

    def tenants(self) -> list[dict]:
        return self._get("/v1/tenants")["tenants"]

    def create_key(self, *, tenant: str | None = None, role: str = "tenant", name: str = "") -> dict:
        return self.call("POST", "/v1/keys", json={"role": role, "tenant": tenant, "name": name})[1]

    def keys(self) -> list[dict]:
        return self._get("/v1/keys")["keys"]

    def revoke_key(self, key_id: str) -> dict:
        return self.call("DELETE", f"/v1/keys/{key_id}")[1]

    # ------------------------------------------------------------ leases

    def leases(self, state: str | None = None, limit: int | None = None) -> list[dict]:
        return self._get("/v1/leases", state=state, limit=limit)["leases"]

    def get_lease(self, lease_id: str) -> dict:
        return self._get(f"/v1/leases/{lease_id}")

    def renew(self, lease_id: str, ttl: float | None = None) -> dict:
        return self.call("POST", f"/v1/leases/{lease_id}/renew", json={"ttl": ttl} if ttl else None)[1]

    def release(self, lease_id: str) -> dict:
        return self.call("DELETE", f"/v1/leases/{lease_id}")[1]

    def replace_lease(self, lease_id: str, *, reason: str = "lost", lost_address: str | None = None) -> dict:
        """Move the lease to another GPU (its node is lost or draining); the reply is active
        (with the new node's address and token) or queued (with a position)."""
        return self.call("POST", f"/v1/leases/{lease_id}/replace",
                         json={"reason": reason, "lost_address": lost_address})[1]

    def drain_node(self, node_id: str, *, deadline: float | None = None) -> dict:
        return self.call("POST", f"/v1/nodes/{node_id}/drain", json={"deadline": deadline})[1]

    def undrain_node(self, node_id: str) -> dict:
        return self.call("POST", f"/v1/nodes/{node_id}/undrain")[1]

    def request_lease(self, *, gpus: int = 1, memory: int | str | None = None, share: float = 1.0,
                      model: str | None = None, labels: dict | None = None, wait: float = 0.0, priority: int = 0,
                      ttl: float | None = None, on_position: Callable[[int, dict], None] | None = None,
                      poll: float = 0.5) -> "Lease":
        """Ask for a lease; with ``wait`` > 0, wait in the queue (``on_position(n, lease)`` on each
        change of place). Raises ``PoolError`` (409 ``no_capacity``, ``quota_exceeded``, ...)."""
        body: dict[str, Any] = {"gpus": gpus, "share": share, "wait": wait, "priority": priority}
        if memory is not None:
            body["memory"] = parse_size(memory)
        if model:
            body["model"] = model
        if labels:
            body["labels"] = labels
        if ttl is not None:
            body["ttl"] = ttl
        status, data = self.call("POST", "/v1/leases", json=body)
        if status == 201:
            return Lease(self, data)
        lease_id = data["id"]
        deadline = time.monotonic() + wait + 10.0
        last = None
        try:
            while True:
                if data["state"] == "active":
                    return Lease(self, data)
                if data["state"] != "queued":
                    raise PoolError(f"lease {lease_id} {data['state']}: {data.get('reason')}", status=409,
                                    code="lease_ended", body=data)
                if on_position is not None and data.get("position") != last and data.get("position"):
                    last = data["position"]
                    on_position(last, data)
                if time.monotonic() > deadline:
                    raise PoolError(f"lease {lease_id} still queued after {wait:g}s", status=408, code="wait_timeout",
                                    body=data)
                time.sleep(poll)
                try:
                    data = self.get_lease(lease_id)
                except PoolUnreachable:
                    continue  # the pool is restarting: the queued lease is in its store
        except BaseException:
            try:
                self.release(lease_id)  # leave the queue (a no-op if the lease already ended)
            except PoolError:
                pass
            raise

    @contextmanager
    def lease(self, *, keep_alive: bool = True, on_lost: Callable[["Lease", str], None] | None = None,
              **request) -> Iterator["Lease"]:
        """A lease for the duration of a ``with`` block: renewed in the background, released at exit."""
        held = self.request_lease(**request)
        if keep_alive:
            held.keep_alive(on_lost=on_lost)
        try:
            yield held
        finally:
            held.release()


class Lease:
    """A lease granted to this client. ``data`` is the pool's latest view of it."""

    def __init__(self, client: PoolClient, data: dict):
        self.client = client
        self.data = data
        self._keeper: LeaseKeeper | None = None

    def __repr__(self) -> str:
        return f"<Lease {self.id} {self.data.get('state')} on {self.node_id}:{self.device} share {self.share}>"

    id = property(lambda self: self.data["id"])
    state = property(lambda self: self.data["state"])
    address = property(lambda self: self.data.get("address"))
    addresses = property(lambda self: self.data.get("addresses", []))
    node_id = property(lambda self: self.data.get("node_id"))
    device = property(lambda self: self.data.get("device"))
    memory = property(lambda self: self.data.get("memory"))
    share = property(lambda self: self.data.get("share"))
    token = property(lambda self: self.data.get("token"))
    expires_at = property(lambda self: self.data.get("expires_at"))
    allocations = property(lambda self: self.data.get("allocations", []))

    def renew(self, ttl: float | None = None) -> dict:
        self.data = self.client.renew(self.id, ttl)
        return self.data

    def keep_alive(self, on_lost: Callable[["Lease", str], None] | None = None) -> "LeaseKeeper":
        if self._keeper is None:
            self._keeper = LeaseKeeper(self, on_lost=on_lost)
            self._keeper.start()
        return self._keeper

    def release(self) -> dict:
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        try:
            self.data = self.client.release(self.id)
        except PoolUnreachable as exc:
            log.warning("could not release lease %s (%s); it expires by itself", self.id, exc)
        return self.data


class LeaseKeeper(threading.Thread):
    """Renews a lease every third of its ttl; retries while the pool is unreachable (a restart)."""

    def __init__(self, lease: Lease, on_lost: Callable[[Lease, str], None] | None = None):
        super().__init__(name=f"gpuwire-lease-{lease.id}", daemon=True)
        self.lease = lease
        self.on_lost = on_lost
        self.client = lease.client.clone()
        self._stop_event = threading.Event()
        self.renewals = 0
        self.lost: str | None = None

    def interval(self) -> float:
        return max(min(float(self.lease.data.get("ttl") or 60.0) / 3.0, 30.0), 0.2)

    def run(self) -> None:
        delay = self.interval()
        try:
            while not self._stop_event.wait(delay):
                try:
                    data = self.client.renew(self.lease.id)
                    if data.get("state") == "queued":  # being replaced: no token until placed again
                        delay = min(1.0, self.interval())
                        continue
                    self.lease.data = data
                    self.renewals += 1
                    delay = self.interval()
                except PoolUnreachable as exc:
                    log.info("lease %s: pool unreachable (%s); retrying", self.lease.id, exc)
                    delay = min(1.0, self.interval())
                except PoolError as exc:
                    if exc.status == 409 and exc.body.get("state") == "failed" and \
                            str(exc.body.get("reason") or "").startswith("node "):
                        # its node died: the program's client may get it replaced (failover); keep watching
                        log.info("lease %s: %s; waiting for a replacement", self.lease.id, exc.message)
                        delay = min(1.0, self.interval())
                        continue
                    if exc.status in (404, 409):
                        self.lost = exc.message
                        log.warning("lease %s lost: %s", self.lease.id, exc.message)
                        if self.on_lost is not None:
                            self.on_lost(self.lease, exc.message)
                        return
                    log.warning("lease %s: renewal refused (%s); retrying", self.lease.id, exc.message)
                    delay = self.interval()
        finally:
            self.client.close()

    def stop(self) -> None:
        self._stop_event.set()
        if self is not threading.current_thread() and self.is_alive():
            self.join(timeout=15)
