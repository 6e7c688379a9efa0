"""The node's side of the pool: registration, heartbeats, and lease-token verification.

Sits beside ``gpuwire serve``: ``start_agent`` registers the node's GPU(s) with the pool and
heartbeats from a background thread (with the node's session count and memory in use). When
the pool restarts, or forgets or buries the node, the agent registers again by itself; when the
pool is unreachable it keeps trying without disturbing the node, whose sessions never depend
on the pool.

``make_token_verifier`` is what the node's session admission uses to check the lease token a
client presents, locally, with the pool's public key::

    verify = make_token_verifier("http://pool:7000", "gpu-box-7070")   # or a PEM public key
    claims = verify(token)   # {'lease', 'tenant', 'node', 'device', 'memory', 'share', 'exp', ...}
                             # or raises TokenExpired / TokenWrongNode / TokenInvalid / TokenUnverifiable
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from .client import PoolClient, PoolError, PoolUnreachable
from .tokens import (TokenError, TokenExpired, TokenInvalid, TokenUnverifiable,  # noqa: F401 - re-exported
                     TokenWrongNode, load_public_key, verify, verify_signature)

log = logging.getLogger("gpuwire.pool.agent")


class AgentError(RuntimeError):
    """The pool refused this node for good (bad key, bad registration): fix and restart."""


# ---------------------------------------------------------------- registration and heartbeats

class NodeAgent:
    def __init__(self, pool_url: str, node_id: str, address: str, gpus: list[dict], *, api_key: str | None = None,
                 labels: dict | None = None, usage: Callable[[], dict] | None = None, version: str = "",
                 on_heartbeat: Callable[[dict, float], None] | None = None):
        self.client = PoolClient(pool_url, api_key, timeout=5.0)
        self.node_id = node_id
        self.address = address
        self.gpus = gpus
        self.labels = labels or {}
        self.usage = usage
        self.on_heartbeat = on_heartbeat  # (pool's reply, monotonic time the heartbeat was sent)
        self.version = version
        self.boot_id = uuid.uuid4().hex
        self.interval = 2.0
        self.public_key_pem: str | None = None
        self.registered = threading.Event()
        self.registrations = 0
        self.heartbeats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unreachable_logged = False

    def register(self) -> dict:
        reply = self.client.register_node(self.node_id, self.address, self.gpus, labels=self.labels,
                                          boot_id=self.boot_id, version=self.version)
        self.interval = float(reply.get("heartbeat_interval") or self.interval)
        self.public_key_pem = reply.get("public_key") or self.public_key_pem
        self.registrations += 1
        self.registered.set()
        self._unreachable_logged = False
        log.info("registered with the pool at %s as node %s (%s), heartbeat every %gs", self.client.url,
                 self.node_id, self.address, self.interval)
        return reply

    def start(self) -> bool:
        """Register once now (raising ``AgentError`` if the pool refuses this node), then keep
        registered from a background thread. Returns whether the first registration succeeded."""
        try:
            self.register()
        except PoolUnreachable as exc:
            log.warning("%s; will keep trying in the background", exc)
            self._unreachable_logged = True
        except PoolError as exc:
            raise AgentError(f"the pool at {self.client.url} refused to register this node: {exc.message}") from None
        self._thread = threading.Thread(target=self._run, name="gpuwire-pool-agent", daemon=True)
        self._thread.start()
        return self.registered.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval if self.registered.is_set() else min(self.interval, 1.0)):
            try:
                if not self.registered.is_set():
                    self.register()
                    continue
                usage = None
                if self.usage is not None:
                    try:
                        usage = self.usage()
                    except Exception:  # noqa: BLE001 - usage is informative only
                        usage = None
                sent = time.monotonic()
                reply = self.client.heartbeat(self.node_id, boot_id=self.boot_id, usage=usage)
                self.interval = float(reply.get("heartbeat_interval") or self.interval)  # the pool may change it
                self.heartbeats += 1
                if self.on_heartbeat is not None:
                    self.on_heartbeat(reply, sent)
                self._unreachable_logged = False
            except PoolUnreachable as exc:
                if not self._unreachable_logged:
                    log.warning("%s; the node keeps serving and retries", exc)
                    self._unreachable_logged = True
            except PoolError as exc:
                if exc.status in (404, 409):  # the pool forgot us, buried us, or we restarted: register again
                    log.warning("pool: %s; registering again", exc.message)
                    self.registered.clear()
                    try:
                        self.register()
                    except PoolError as again:
                        log.warning("registration failed: %s", again.message)
                else:
                    log.error("pool refused the heartbeat: %s", exc.message)
            except Exception:  # noqa: BLE001 - never take the node down
                log.exception("pool agent error")

    def stop(self, deregister: bool = True) -> None:
        """Stop heartbeating; with ``deregister``, tell the pool the node is leaving (its leases fail)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if deregister and self.registered.is_set():
            try:
                self.client.deregister_node(self.node_id)
            except PoolError as exc:
                log.info("could not deregister from the pool: %s", exc.message)
        self.client.close()

    def token_verifier(self, *, leeway: float = 5.0) -> "TokenVerifier":
        """A verifier using the public key the pool sent at registration (fetched if not yet)."""
        source = self.public_key_pem or self.client.url
        return TokenVerifier(source, self.node_id, api_key=self.client.api_key, leeway=leeway)


def server_usage(server) -> Callable[[], dict]:
    """What a heartbeat reports about a ``NodeServer``: its session count and memory in use."""
    def usage() -> dict:
        sessions = list(server.sessions.values())
        return {"sessions": len(sessions), "bytes_in_use": int(sum(getattr(s, "bytes_in_use", 0) for s in sessions))}
    return usage


def server_follower(server) -> Callable[[dict, float], None]:
    """What a heartbeat's reply makes a ``NodeServer`` do: end sessions of leases the pool moved
    elsewhere (after it declared this node dead, say), and start or stop draining."""
    def follow(reply: dict, sent: float) -> None:
        leases = reply.get("leases")
        if isinstance(leases, list):
            server.keep_only_leases({str(x) for x in leases}, admitted_before=sent)
        drain = reply.get("drain")
        if isinstance(drain, dict) and server.draining is None:
            server.set_draining(str(drain.get("reason") or "draining"), drain.get("deadline"))
        elif reply.get("state") == "alive" and server.draining is not None:
            server.set_draining(None)
    return follow


def default_node_id(port: int) -> str:
    return f"{socket.gethostname().split('.')[0] or 'node'}-{port}"


def default_address(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn() or socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def start_agent(pool_url: str, *, backend_info: dict, host: str, port: int, node_id: str | None = None,
                advertise: str | None = None, memory: int | None = None, max_sessions: int | None = None,
                labels: dict | None = None, server=None, api_key: str | None = None) -> NodeAgent:
    """What ``gpuwire serve --pool`` runs: describe the node's GPU, register, heartbeat."""
    from .._version import __version__
    api_key = api_key if api_key is not None else os.environ.get("GPUWIRE_API_KEY")
    if not api_key:
        raise AgentError("--pool needs an API key with the node (or admin) role: set GPUWIRE_API_KEY "
                         "(create one with `gpuwire key create --role node`)")
    gpu = {"index": int(backend_info.get("index") or 0), "name": str(backend_info.get("name", "GPU"))[:256],
           "memory": int(memory if memory is not None else backend_info.get("total_memory") or 0),
           "backend": backend_info.get("backend", "cuda")}
    if max_sessions:
        gpu["max_sessions"] = min(int(max_sessions), 1024)
    all_labels = dict(labels or {})
    for item in filter(None, os.environ.get("GPUWIRE_NODE_LABELS", "").split(",")):
        key, _, value = item.partition("=")
        all_labels.setdefault(key.strip(), value.strip())
    agent = NodeAgent(pool_url, node_id or default_node_id(port), advertise or default_address(host, port), [gpu],
                      api_key=api_key, labels=all_labels, usage=server_usage(server) if server is not None else None,
                      version=__version__, on_heartbeat=server_follower(server) if server is not None else None)
    agent.start()
    return agent


# ---------------------------------------------------------------- token verification

class TokenVerifier:
    """``verify(token) -> claims``, checking tokens locally with the pool's public key.

    ``source`` is the key itself (PEM text/bytes or an ``Ed25519PublicKey``), a path to a PEM
    file, or the pool's URL: the key is then fetched once (``GET /v1/signing-key``, with
    ``api_key`` or GPUWIRE_API_KEY) and again only when a token names an unknown key id.
    """

    def __init__(self, source: Any, node_id: str, *, api_key: str | None = None, leeway: float = 5.0,
                 timeout: float = 5.0):
        self.node_id = node_id
        self.leeway = leeway
        self._url: str | None = None
        self._api_key = api_key
        self._timeout = timeout
        self._key = None
        self._kid: str | None = None
        self._lock = threading.Lock()
        self._last_fetch = 0.0
        if isinstance(source, str) and source.startswith(("http://", "https://")):
            self._url = source
            try:
                self._fetch()
            except PoolError as exc:
                log.warning("cannot fetch the pool's public key yet (%s); will retry on the first token", exc.message)
        elif isinstance(source, str) and not source.lstrip().startswith("-----BEGIN") and os.path.exists(source):
            with open(source, "rb") as f:
                self._key = load_public_key(f.read())
        else:
            self._key = load_public_key(source)

    @property
    def public_key(self):
        return self._key

    def _fetch(self) -> None:
        with self._lock:
            self._last_fetch = time.monotonic()
            with PoolClient(self._url, self._api_key, timeout=self._timeout) as client:
                reply = client.signing_key()
            self._key = load_public_key(reply["public_key"])
            self._kid = reply.get("kid")

    def __call__(self, token: str) -> dict:
        return verify(token, self._key_for(token), self.node_id, leeway=self.leeway)

    def any_node(self, token: str) -> dict:
        """The claims of a token the pool signed for any node (a session move's target)."""
        return verify_signature(token, self._key_for(token), leeway=self.leeway)

    def _key_for(self, token: str):
        if self._url is not None:
            kid = _unverified_kid(token)
            stale = self._key is None or (kid is not None and self._kid is not None and kid != self._kid)
            if stale and (self._key is None or time.monotonic() - self._last_fetch > 10.0):
                try:
                    self._fetch()
                except PoolError as exc:
                    if self._key is None:
                        raise TokenUnverifiable(f"cannot check lease tokens: the pool's public key could not be "
                                                f"fetched from {self._url}: {exc.message}") from None
        if self._key is None:
            raise TokenUnverifiable("cannot check lease tokens: no public key of the pool")
        return self._key


def _unverified_kid(token: str) -> str | None:
    import jwt
    try:
        return jwt.get_unverified_header(token).get("kid")
    except jwt.PyJWTError:
        return None
    except Exception:  # noqa: BLE001
        raise TokenInvalid("invalid lease token") from None


def make_token_verifier(source: Any, node_id: str, *, api_key: str | None = None,
                        leeway: float = 5.0) -> Callable[[str], dict]:
    """Return ``verify(token) -> claims dict`` for node ``node_id``.

    ``source``: the pool's URL (``http://pool:7000``; the public key is fetched with ``api_key``
    or GPUWIRE_API_KEY), or the pool's Ed25519 public key (PEM text/bytes, a PEM file path, or a
    ``cryptography`` key object). ``verify`` never calls the pool for a token (only to fetch the
    key once). It raises ``TokenExpired``, ``TokenWrongNode``, ``TokenInvalid`` (tampered,
    another pool's key, malformed, claims out of range) or ``TokenUnverifiable`` (key not known
    yet), all subclasses of ``gpuwire.pool.tokens.TokenError``.
    """
    return TokenVerifier(source, node_id, api_key=api_key, leeway=leeway)
