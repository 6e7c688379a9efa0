"""The pool's HTTP/JSON API (FastAPI on uvicorn), and ``run`` behind ``gpuwire pool``.

Sits at the pool's I/O edge: it checks input (pydantic models that forbid unknown fields and
bound every number and string), authenticates the caller from ``Authorization: Bearer <key>``,
calls ``core.Pool`` and turns its ``Problem``s into JSON errors::

    {"error": "<code>", "message": "<what went wrong and what to do>", ...details}

Bad JSON is a 400, a well-formed body that breaks the schema a 422; both store nothing. The
OpenAPI schema is at ``/v1/openapi.json`` (browsable at ``/v1/docs``). Every endpoint but
``/v1/health`` needs an API key.
"""


import logging
import sys
from typing import Annotated, Any, Literal, Optional

from fastapi import Depends, FastAPI, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .._io import listen
from .._version import __version__
from .core import ROLES, Caller, Pool, PoolConfig, Problem
from .sizes import MAX_BYTES, parse_size
from .store import LIVE_STATES, SqlStore, sqlite_url

log = logging.getLogger("gpuwire.pool")

MAX_BODY = 256 << 10
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
ADDRESS_PATTERN = r"^[^\s/]{1,253}:[0-9]{1,5}$"
LABEL_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$"
ALL_STATES = ("queued", "active", "released", "expired", "failed", "cancelled")


def _size(value: Any) -> Any:
    if isinstance(value, str):
        return parse_size(value)
    return value


Size = Annotated[int, BeforeValidator(_size), Field(ge=0, le=MAX_BYTES,
                                                    description="bytes, or a string such as \"4GiB\"")]
Labels = Annotated[dict[Annotated[str, Field(pattern=LABEL_KEY_PATTERN)], Annotated[str, Field(max_length=128)]],
                   Field(max_length=32)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class GpuIn(Body):
    index: int = Field(ge=0, le=1023)
    name: str = Field(min_length=1, max_length=256)
    memory: Size = Field(gt=0)
    backend: Literal["cuda", "cpu"] = "cuda"
    max_sessions: Optional[int] = Field(None, ge=1, le=1024)


class NodeIn(Body):
    id: str = Field(pattern=NODE_ID_PATTERN)
    address: str = Field(pattern=ADDRESS_PATTERN, description="HOST:PORT clients connect to")
    gpus: list[GpuIn] = Field(min_length=1, max_length=64)
    labels: Labels = {}
    boot_id: str = Field("", max_length=64, description="changes when the node process restarts")
    version: str = Field("", max_length=32)

    @field_validator("gpus")
    @classmethod
    def _unique(cls, gpus: list[GpuIn]) -> list[GpuIn]:
        if len({g.index for g in gpus}) != len(gpus):
            raise ValueError("GPU indexes must be unique")
        return gpus


class Usage(Body):
    sessions: int = Field(0, ge=0, le=1 << 20)
    bytes_in_use: int = Field(0, ge=0, le=1 << 60)


class HeartbeatIn(Body):
    boot_id: str = Field("", max_length=64)
    usage: Optional[Usage] = None


class LeaseIn(Body):
    gpus: int = Field(1, ge=1, le=64)
    memory: Optional[Size] = Field(None, description="per-GPU memory budget; default: the whole GPU (share 1) "
                                                     "or share x its memory")
    share: float = Field(1.0, gt=0.0, le=1.0, description="compute share; 1 = a whole GPU of one's own")
    model: Optional[str] = Field(None, min_length=1, max_length=128, description="part of the GPU's name, e.g. A100")
    labels: Labels = {}
    wait: float = Field(0.0, ge=0.0, le=24 * 3600, description="seconds to wait in the queue if nothing fits now")
    priority: int = Field(0, ge=-100, le=100)
    ttl: Optional[float] = Field(None, ge=1.0, le=24 * 3600, description="seconds the lease lives unless renewed")


class RenewIn(Body):
    ttl: Optional[float] = Field(None, ge=1.0, le=24 * 3600)


class ReplaceIn(Body):
    reason: str = Field("lost", description="lost (the client cannot reach its node) or drain")
    lost_address: Optional[str] = Field(None, max_length=300)


class DrainIn(Body):
    deadline: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600,
                                      description="seconds the sessions get to move before they are ended")


class TenantIn(Body):
    name: str = Field(pattern=NAME_PATTERN)
    max_gpus: Optional[float] = Field(None, ge=0.0, le=1e6, description="GPUs' worth (gpus x share) at once")
    max_memory: Optional[Size] = Field(None, description="bytes of GPU memory at once")


class KeyIn(Body):
    role: Literal["tenant", "node", "admin"] = "tenant"
    tenant: Optional[str] = Field(None, pattern=NAME_PATTERN)
    name: str = Field("", max_length=128)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: 413 for a declared body over ``limit`` bytes; an undeclared one is cut off."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            response = JSONResponse({"error": "too_large", "message": f"request bodies are limited to "
                                                                      f"{self.limit} bytes"}, status_code=413)
            return await response(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(f"request body over {self.limit} bytes")
            return message

        return await self.app(scope, limited_receive, send)


def create_app(pool: Pool, rate_limiter=None) -> FastAPI:
    app = FastAPI(title="gpuwire pool", version=__version__,
                  description="Control plane of gpuwire: nodes, GPUs, leases, tenants, API keys.",
                  openapi_url="/v1/openapi.json", docs_url="/v1/docs", redoc_url=None)
    bearer = HTTPBearer(auto_error=False, description="an API key: admin, tenant or node")

    app.add_middleware(BodyLimit, limit=MAX_BODY)

    @app.exception_handler(Problem)
    async def _problem(_request: Request, exc: Problem):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.as_dict(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse({"error": "bad_json", "message": "the request body is not valid JSON"}, status_code=400)
        parts = []
        for e in errors[:8]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            parts.append(f"{where or 'body'}: {e.get('msg')}")
        return JSONResponse({"error": "invalid", "message": "invalid request: " + "; ".join(parts),
                             "fields": [".".join(str(p) for p in e.get("loc", ())) for e in errors[:8]]},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "no such endpoint: see /v1/openapi.json"
        return JSONResponse({"error": f"http_{exc.status_code}", "message": message}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_request: Request, exc: Exception):
        log.exception("request failed", exc_info=exc)
        return JSONResponse({"error": "internal", "message": f"the pool failed to handle this request: "
                                                             f"{type(exc).__name__}"}, status_code=500)

    from .ratelimit import install as install_rate_limits
    limiter = install_rate_limits(app, rate_limiter)  # 429 past a key's limit (pool/ratelimit.py)

    def caller(request: Request, credentials: Optional[HTTPAuthorizationCredentials] = Security(bearer)) -> Caller:
        return limiter.admit(request.client.host if request.client else "?",
                             credentials.credentials if credentials else None, pool.authenticate)

    Auth = Annotated[Caller, Depends(caller)]

    # ---------------------------------------------------------------- pool

    @app.get("/v1/health", tags=["pool"], summary="Liveness (no key needed)")
    def health():
        return {"status": "ok", "version": __version__}

    @app.get("/v1/version", tags=["pool"])
    def version(_: Auth):
        from ..protocol import PROTOCOL_VERSION
        return {"gpuwire": __version__, "api": "v1", "protocol": PROTOCOL_VERSION}

    @app.get("/v1/signing-key", tags=["pool"], summary="The public key nodes verify lease tokens with")
    def signing_key(who: Auth):
        pool.require(who, *ROLES)
        return {"alg": "EdDSA", "kid": pool.signer.kid, "public_key": pool.signer.public_pem()}

    @app.get("/v1/status", tags=["pool"], summary="Nodes, GPUs, leases, tenants and free capacity at once")
    def status(who: Auth):
        return pool.status(who)

    # ---------------------------------------------------------------- nodes

    @app.post("/v1/nodes", tags=["nodes"], summary="Register (or re-register) a node and its GPUs")
    def register_node(body: NodeIn, who: Auth):
        return pool.register_node(who, node_id=body.id, address=body.address,
                                  gpus=[g.model_dump() for g in body.gpus], labels=body.labels,
                                  boot_id=body.boot_id, version=body.version)

    @app.get("/v1/nodes", tags=["nodes"])
    def list_nodes(who: Auth):
        return {"nodes": pool.list_nodes(who)}

    @app.get("/v1/nodes/{node_id}", tags=["nodes"])
    def get_node(node_id: str, who: Auth):
        return pool.get_node(who, node_id)

    @app.post("/v1/nodes/{node_id}/heartbeat", tags=["nodes"])
    def heartbeat(node_id: str, who: Auth, body: Optional[HeartbeatIn] = None):
        body = body or HeartbeatIn()
        return pool.heartbeat(who, node_id, body.boot_id, body.usage.model_dump() if body.usage else None)

    @app.delete("/v1/nodes/{node_id}", tags=["nodes"], summary="Deregister: the node leaves, its leases fail")
    def deregister(node_id: str, who: Auth):
        return pool.deregister_node(who, node_id)

    # ---------------------------------------------------------------- leases

    @app.post("/v1/leases", tags=["leases"], status_code=201,
              summary="Ask for GPUs: 201 placed, 202 queued (wait > 0), 409 nothing fits / over quota",
              responses={202: {"description": "queued; poll GET /v1/leases/{id} for its position"},
                         409: {"description": "nothing fits now (the free capacity is in 'free'), or quota"}})
    def request_lease(body: LeaseIn, who: Auth):
        view, placed = pool.request_lease(who, gpus=body.gpus, memory=body.memory, share=body.share,
                                          model=body.model, labels=body.labels, wait=body.wait,
                                          priority=body.priority, ttl=body.ttl)
        return view if placed else JSONResponse(view, status_code=202)

    @app.get("/v1/leases", tags=["leases"])
    def list_leases(who: Auth, state: Annotated[Optional[str], Query(
            description="live (default), all, or one of " + ", ".join(ALL_STATES))] = None,
                    limit: Annotated[Optional[int], Query(ge=1, le=10000)] = None):
        if state in (None, "live"):
            states = LIVE_STATES
        elif state == "all":
            states = None
        elif state in ALL_STATES:
            states = (state,)
        else:
            raise Problem(422, "invalid", f"state must be live, all or one of {', '.join(ALL_STATES)}")
        return {"leases": pool.list_leases(who, states, limit=limit)}

    @app.get("/v1/leases/{lease_id}", tags=["leases"], summary="A lease (its queue position while queued)")
    def get_lease(lease_id: str, who: Auth):
        return pool.get_lease(who, lease_id)

    @app.post("/v1/leases/{lease_id}/renew", tags=["leases"], summary="Extend a lease by its ttl; new tokens")
    def renew(lease_id: str, who: Auth, body: Optional[RenewIn] = None):
        return pool.renew(who, lease_id, body.ttl if body else None)

    @app.post("/v1/leases/{lease_id}/replace", tags=["leases"],
              summary="Move a lease to another GPU (lost or draining node): active with a new token, or queued")
    def replace(lease_id: str, who: Auth, body: Optional[ReplaceIn] = None):
        body = body or ReplaceIn()
        return pool.replace_lease(who, lease_id, reason=body.reason, lost_address=body.lost_address)

    @app.post("/v1/nodes/{node_id}/drain", tags=["nodes"],
              summary="Stop placing on a node; its sessions move to other nodes at their next sync point (admin)")
    def drain(node_id: str, who: Auth, body: Optional[DrainIn] = None):
        return pool.drain_node(who, node_id, deadline=body.deadline if body else None)

    @app.post("/v1/nodes/{node_id}/undrain", tags=["nodes"], summary="Take a drained node back (admin)")
    def undrain(node_id: str, who: Auth):
        return pool.drain_node(who, node_id, undo=True)

    @app.delete("/v1/leases/{lease_id}", tags=["leases"], summary="Release a lease (or leave the queue)")
    def release(lease_id: str, who: Auth):
        return pool.release(who, lease_id)

    # ---------------------------------------------------------------- tenants and keys

    @app.post("/v1/tenants", tags=["tenants"], status_code=201, summary="Create a tenant with quotas (admin)")
    def create_tenant(body: TenantIn, who: Auth):
        return pool.create_tenant(who, body.name, body.max_gpus, body.max_memory)

    @app.get("/v1/tenants", tags=["tenants"], summary="Tenants with usage (a tenant key sees its own)")
    def list_tenants(who: Auth):
        return {"tenants": pool.list_tenants(who)}

    @app.post("/v1/keys", tags=["keys"], status_code=201,
              summary="Create an API key (admin); the key is shown once and stored hashed")
    def create_key(body: KeyIn, who: Auth):
        return pool.create_key(who, body.role, body.tenant, body.name)

    @app.get("/v1/keys", tags=["keys"], summary="API keys, without their secrets (admin)")
    def list_keys(who: Auth):
        return {"keys": pool.list_keys(who)}

    @app.delete("/v1/keys/{key_id}", tags=["keys"], summary="Revoke an API key (admin)")
    def revoke_key(key_id: str, who: Auth):
        return pool.revoke_key(who, key_id)

    return app


def run(host: str = "127.0.0.1", port: int = 7000, db: str | None = None, *, admin_key: str | None = None,
        config: PoolConfig | None = None, log_level: str = "info", tls_cert: str | None = None,
        tls_key: str | None = None, tls_client_ca: str | None = None, insecure: bool = False,
        rate_limits: str | None = None) -> int:
    """``gpuwire pool``: open the store, make sure an admin key exists, serve until SIGINT/SIGTERM.

    Plain HTTP only on loopback unless ``insecure``: API keys travel in every request."""
    import ssl

    import uvicorn

    from ..security.tls import TLSConfigError, is_loopback, server_context
    ssl_options: dict = {}
    if tls_cert or tls_key:
        try:
            server_context(tls_cert, tls_key, tls_client_ca)  # fails early, naming the file
        except TLSConfigError as exc:
            print(f"gpuwire pool: {exc}", file=sys.stderr)
            return 2
        ssl_options = dict(ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        if tls_client_ca:
            ssl_options.update(ssl_ca_certs=tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    elif not is_loopback(host) and not insecure:
        print(f"gpuwire pool: refusing to serve plain HTTP on {host}, which other machines can reach (API keys "
              "would travel in clear); pass --tls-cert/--tls-key (see `gpuwire certs init`), or --insecure",
              file=sys.stderr)
        return 2
    from .ratelimit import RateLimiter, format_limits
    try:  # --rate-limit, else GPUWIRE_POOL_RATE_LIMIT, else the defaults (pool/ratelimit.py)
        rate_limiter = RateLimiter.from_spec(rate_limits)
    except ValueError as exc:
        print(f"gpuwire pool: {exc}", file=sys.stderr)
        return 2
    log.info("rate limits per API key: %s", format_limits(rate_limiter.limits))

    url = db if db and "://" in db else sqlite_url(db or default_db_path())
    store = SqlStore(url)
    pool = Pool(store, config)
    try:
        created = pool.bootstrap(admin_key)
    except ValueError as exc:
        print(f"gpuwire pool: {exc}", file=sys.stderr)
        store.close()
        return 2
    try:
        sock = listen(host, port, backlog=512)
    except OSError as exc:
        print(f"gpuwire pool: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        store.close()
        return 2
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    if created:
        print(f"gpuwire pool: created an admin API key (shown once, stored hashed): {created}", flush=True)
    print(f"gpuwire pool: state in {url}", flush=True)
    scheme = "https" if ssl_options else "http"
    print(f"gpuwire pool listening on {scheme}://{shown}:{bound}", flush=True)
    pool.start()
    server = uvicorn.Server(uvicorn.Config(create_app(pool, rate_limiter), log_level=log_level,
                                           access_log=log_level == "debug",
                                           lifespan="off", timeout_graceful_shutdown=3, **ssl_options))
    try:
        server.run(sockets=[sock])
    finally:
        pool.stop()
        store.close()
    return 0


def default_db_path() -> str:
    import os
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "gpuwire", "pool.db")
