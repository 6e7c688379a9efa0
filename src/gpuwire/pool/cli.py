"""The pool's commands: ``gpuwire pool``, ``tenant``, ``key``, ``ls``, ``demo``, and ``smi --pool``.

Sits at the CLI edge. ``register(app)`` adds the commands to the ``gpuwire`` typer app; heavy
modules (FastAPI, SQLAlchemy) are imported only by the command that needs them, so the rest
of the CLI starts as fast as before. Every client command takes ``--pool`` (default
GPUWIRE_POOL) and ``--api-key`` (default GPUWIRE_API_KEY), prints a rich table, or JSON with
``--json``, and exits 1 with the pool's message when the pool refuses.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer

from .._process import exit_when_stdin_closes
from .sizes import format_size, parse_size

POOL_OPTION = typer.Option(None, "--pool", envvar="GPUWIRE_POOL", help="Pool URL, e.g. http://pool:7000 "
                                                                       "(default: GPUWIRE_POOL).")
KEY_OPTION = typer.Option(None, "--api-key", envvar="GPUWIRE_API_KEY", help="API key (default: GPUWIRE_API_KEY).")
JSON_OPTION = typer.Option(False, "--json", help="Print JSON instead of a table.")


def _client(pool: Optional[str], api_key: Optional[str]):
    from .client import PoolClient, PoolError
    try:
        return PoolClient(pool, api_key)
    except PoolError as exc:
        _fail(exc.message)


def _fail(message: str, code: int = 1):
    typer.echo(f"gpuwire: {message}", err=True)
    raise typer.Exit(code)


def _call(fn, *args, **kwargs):
    from .client import PoolError
    try:
        return fn(*args, **kwargs)
    except PoolError as exc:
        _fail(exc.message)


def _console():
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else 160)


def _size_option(text: Optional[str], what: str) -> Optional[int]:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=what) from None


def _ago(ts: Optional[float]) -> str:
    if not ts:
        return "-"
    delta = time.time() - ts
    return f"{delta:.1f}s ago" if delta < 120 else f"{delta / 60:.0f}m ago"


def _share(value) -> str:
    return "-" if value is None else f"{float(value):g}"


# ---------------------------------------------------------------- gpuwire pool

def pool_command(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(7000, help="TCP port (0 picks a free one; the chosen one is printed)."),
    db: Optional[str] = typer.Option(None, help="SQLite file for the pool's state, or a database URL "
                                                "(default: ~/.local/share/gpuwire/pool.db)."),
    admin_key: Optional[str] = typer.Option(None, envvar="GPUWIRE_ADMIN_KEY",
                                            help="Accept this admin API key (else one is made and printed on "
                                                 "first start; default: GPUWIRE_ADMIN_KEY)."),
    heartbeat_interval: float = typer.Option(2.0, help="Seconds between node heartbeats."),
    heartbeat_misses: int = typer.Option(3, help="Missed heartbeats before a node is declared dead."),
    lease_ttl: float = typer.Option(60.0, help="Seconds a lease lives unless renewed (clients renew at ttl/3)."),
    max_sessions_per_gpu: int = typer.Option(8, help="Most leases on one GPU."),
    restart_grace: Optional[float] = typer.Option(None, help="After a restart, seconds leases get to be renewed "
                                                             "(default: max(2 x heartbeat timeout, 10))."),
    tls_cert: Optional[str] = typer.Option(None, help="Serve HTTPS with this certificate (see `gpuwire certs init`)."),
    tls_key: Optional[str] = typer.Option(None, help="Private key of --tls-cert."),
    tls_client_ca: Optional[str] = typer.Option(None, help="Require client certificates signed by this CA."),
    insecure: bool = typer.Option(False, help="Allow plain HTTP on a non-loopback address (not recommended)."),
    rate_limit: Optional[str] = typer.Option(None, envvar="GPUWIRE_POOL_RATE_LIMIT",
                                             help="Requests/s per API key by role, RATE/BURST or off (default: "
                                                  "tenant=20/40,node=100/200,admin=off,failed-auth=5/30)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    exit_with_stdin: bool = typer.Option(False, "--exit-with-stdin", hidden=True,
                                         help="Exit when stdin closes (used by gpuwire demo)."),
):
    """Run the pool: the control plane that leases nodes' GPUs (whole or in slices) to tenants.

    Clients trust an HTTPS pool through GPUWIRE_TLS_CA (and GPUWIRE_TLS_CERT/KEY for mutual TLS)."""
    import logging

    from .core import PoolConfig
    from .service import run
    if heartbeat_interval <= 0 or heartbeat_misses < 1 or lease_ttl < 1 or max_sessions_per_gpu < 1:
        _fail("heartbeat interval must be > 0, misses >= 1, lease ttl >= 1 and max sessions per GPU >= 1", 2)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if exit_with_stdin:
        import threading
        threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    config = PoolConfig(heartbeat_interval=heartbeat_interval, heartbeat_misses=heartbeat_misses, lease_ttl=lease_ttl,
                        max_sessions_per_gpu=max_sessions_per_gpu, restart_grace=restart_grace)
    raise typer.Exit(run(host, port, db, admin_key=admin_key, config=config, log_level=log_level.lower(),
                         tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca, insecure=insecure,
                         rate_limits=rate_limit))


# ---------------------------------------------------------------- tenants and keys

tenant_app = typer.Typer(help="Tenants and their quotas (admin key).", no_args_is_help=True, rich_markup_mode=None)
key_app = typer.Typer(help="API keys (admin key). Keys are shown once and stored hashed.", no_args_is_help=True,
                      rich_markup_mode=None)


@tenant_app.command("create")
def tenant_create(
    name: str = typer.Argument(..., help="Tenant name (letters, digits, . _ -)."),
    max_gpus: Optional[float] = typer.Option(None, help="Most GPUs' worth at once (gpus x share; 0.5 = half a GPU)."),
    max_memory: Optional[str] = typer.Option(None, help="Most GPU memory at once, e.g. 8GiB."),
    pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION, as_json: bool = JSON_OPTION,
):
    """Create a tenant with quotas."""
    client = _client(pool, api_key)
    tenant = _call(client.create_tenant, name, max_gpus=max_gpus, max_memory=_size_option(max_memory, "--max-memory"))
    if as_json:
        print(json.dumps(tenant, indent=2))
    else:
        print(f"created tenant {tenant['name']} (max GPUs {_quota(tenant['max_gpus'])}, max memory "
              f"{format_size(tenant['max_memory']) if tenant['max_memory'] is not None else 'unlimited'})")


def _quota(value) -> str:
    return "unlimited" if value is None else f"{value:g}"


@tenant_app.command("list")
def tenant_list(pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION, as_json: bool = JSON_OPTION):
    """List tenants with their quotas and what they hold now."""
    tenants = _call(_client(pool, api_key).tenants)
    if as_json:
        print(json.dumps(tenants, indent=2))
        return
    _console().print(_tenants_table(tenants))


@key_app.command("create")
def key_create(
    tenant: Optional[str] = typer.Option(None, help="The tenant the key acts for."),
    role: Optional[str] = typer.Option(None, help="tenant (default with --tenant), node (for gpuwire serve "
                                                  "--pool) or admin."),
    name: str = typer.Option("", help="A note to recognise the key by."),
    pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION, as_json: bool = JSON_OPTION,
):
    """Create an API key; prints the key alone on stdout (it is not shown again)."""
    role = role or ("tenant" if tenant else None)
    if role is None:
        _fail("say whose key it is: --tenant NAME, or --role node / --role admin", 2)
    created = _call(_client(pool, api_key).create_key, tenant=tenant, role=role, name=name)
    if as_json:
        print(json.dumps(created, indent=2))
        return
    print(created["key"])
    who = f"tenant {created['tenant']}" if created["tenant"] else f"role {created['role']}"
    typer.echo(f"gpuwire: created API key {created['id']} for {who}; it is shown only this once", err=True)


@key_app.command("list")
def key_list(pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION, as_json: bool = JSON_OPTION):
    """List API keys (ids, roles, tenants; never the keys themselves)."""
    keys = _call(_client(pool, api_key).keys)
    if as_json:
        print(json.dumps(keys, indent=2))
        return
    from rich.table import Table
    table = Table(title="API keys")
    for col in ("id", "role", "tenant", "name", "created", "revoked"):
        table.add_column(col)
    for k in keys:
        table.add_row(k["id"], k["role"], k["tenant"] or "-", k["name"] or "-", _ago(k["created_at"]),
                      "yes" if k["revoked"] else "")
    _console().print(table)


@key_app.command("revoke")
def key_revoke(key_id: str = typer.Argument(..., help="The key's id (gpuwire key list)."),
               pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION):
    """Revoke an API key."""
    _call(_client(pool, api_key).revoke_key, key_id)
    print(f"revoked API key {key_id}")


# ---------------------------------------------------------------- ls and smi --pool

def ls_command(
    what: str = typer.Argument(..., help="nodes or leases."),
    all_leases: bool = typer.Option(False, "--all", help="leases: also those that ended."),
    pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION, as_json: bool = JSON_OPTION,
):
    """List the pool's nodes (with their GPUs) or leases."""
    client = _client(pool, api_key)
    if what in ("nodes", "node"):
        nodes = _call(client.nodes)
        if as_json:
            print(json.dumps(nodes, indent=2))
        else:
            _console().print(_nodes_table(nodes))
    elif what in ("leases", "lease"):
        leases = _call(client.leases, state="all" if all_leases else None)
        if as_json:
            print(json.dumps(leases, indent=2))
        else:
            _console().print(_leases_table(leases))
    else:
        _fail(f"ls: unknown {what!r}; use `gpuwire ls nodes` or `gpuwire ls leases`", 2)


def smi_pool(pool: Optional[str], api_key: Optional[str] = None, as_json: bool = False) -> int:
    """``gpuwire smi --pool URL``: every node, GPU, lease, tenant and the free capacity."""
    from .client import PoolError, PoolClient
    try:
        with PoolClient(pool, api_key) as client:
            status = client.status()
    except PoolError as exc:
        print(f"gpuwire smi: {exc.message}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status, indent=2))
    else:
        render_status(status, client.url)
    return 0


def render_status(status: dict, url: str, console=None) -> None:
    console = console or _console()
    nodes = status["nodes"]
    alive = sum(1 for n in nodes if n["state"] == "alive")
    info = status["pool"]
    console.print(f"gpuwire pool {url}  (gpuwire {info['version']})   nodes: {alive} alive, {len(nodes) - alive} dead"
                  f"   queue: {info['queue_length']}   lease ttl {info['lease_ttl']:g}s, heartbeat "
                  f"{info['heartbeat_interval']:g}s (dead after {info['heartbeat_timeout']:g}s)", highlight=False)
    console.print(_nodes_table(nodes))
    console.print(_leases_table(status["leases"]))
    if status["tenants"]:
        console.print(_tenants_table(status["tenants"]))
    free = status["free"]
    largest = free.get("largest_slice")
    slice_text = (f"; largest slice: share {largest['share']:g} with {format_size(largest['memory'])} on "
                  f"{largest['node_id']} GPU {largest['device']}" if largest else "")
    console.print(f"Free: {free['whole_gpus']} of {free['total_gpus']} GPU(s) whole, compute share "
                  f"{free['free_share']:g} and {format_size(free['free_memory'])} in all{slice_text}", highlight=False)


def _nodes_table(nodes: list[dict]):
    from rich.table import Table
    table = Table(title="Nodes and GPUs")
    for col in ("node", "address", "state", "heartbeat", "GPU", "name", "backend", "memory used/total",
                "share used", "leases", "sessions"):
        table.add_column(col, overflow="fold")
    for n in nodes:
        state = n["state"] if n["state"] == "alive" else f"{n['state']}: {n.get('reason') or ''}"
        sessions = str(n.get("usage", {}).get("sessions", "-")) if n["state"] == "alive" else "-"
        if not n["gpus"]:
            table.add_row(n["id"], n["address"], state, _ago(n["last_heartbeat"]), "-", "", "", "", "", "", sessions)
        for i, g in enumerate(n["gpus"]):
            name = g["name"] if len(g["name"]) <= 60 else g["name"][:57] + "..."
            table.add_row(n["id"] if i == 0 else "", n["address"] if i == 0 else "", state if i == 0 else "",
                          _ago(n["last_heartbeat"]) if i == 0 else "", str(g["index"]), name, g["backend"],
                          f"{format_size(g['used_memory'])} / {format_size(g['memory'])}",
                          "whole" if g.get("exclusive") else f"{g['used_share']:g}",
                          str(len(g["leases"])) + f"/{g['max_sessions']}", sessions if i == 0 else "")
    return table


def _leases_table(leases: list[dict]):
    from rich.table import Table
    table = Table(title="Leases")
    for col in ("lease", "tenant", "state", "node", "GPU", "memory", "share", "expires / position", "reason"):
        table.add_column(col, overflow="fold")
    for l in leases:
        where = l["allocations"] or [{}]
        if l["state"] == "queued":
            when = l.get("position_text") or "queued"
        elif l["state"] == "active" and l.get("expires_in") is not None:
            when = f"in {l['expires_in']:.0f}s"
        else:
            when = "-"
        for i, a in enumerate(where):
            first = i == 0
            table.add_row(l["id"] if first else "", l["tenant"] if first else "", l["state"] if first else "",
                          a.get("node_id") or "-", str(a.get("device", "-")),
                          format_size(a.get("memory") if a else l["request"]["memory"]),
                          _share(a.get("share") if a else l["request"]["share"]),
                          when if first else "", (l.get("reason") or "") if first and l["state"] != "active" else "")
    return table


def _tenants_table(tenants: list[dict]):
    from rich.table import Table
    table = Table(title="Tenants")
    for col in ("tenant", "GPUs used / max", "memory used / max", "active", "queued"):
        table.add_column(col)
    for t in tenants:
        max_memory = format_size(t["max_memory"]) if t["max_memory"] is not None else "unlimited"
        table.add_row(t["name"], f"{t['used_gpus']:g} / {_quota(t['max_gpus'])}",
                      f"{format_size(t['used_memory'])} / {max_memory}", str(t["active_leases"]),
                      str(t["queued_leases"]))
    return table


# ---------------------------------------------------------------- demo

# ---------------------------------------------------------------- drain

def drain_command(
    node: str = typer.Argument(..., help="The node's id (gpuwire ls nodes)."),
    deadline: Optional[float] = typer.Option(
        None, help="Seconds the sessions get to move; sessions still there then are ended (clients with "
                   "checkpoints rebuild elsewhere). Default: no deadline."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until every session has moved off."),
    timeout: float = typer.Option(3600.0, help="With --wait: give up waiting after this many seconds."),
    pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION, as_json: bool = JSON_OPTION,
):
    """Take a node out of service without stopping its jobs: the pool places nothing new on it, and
    each session moves to another node at its next sync point (tensors copied node to node). The
    node leaves the pool (state 'drained') once empty; `gpuwire undrain NODE` takes it back."""
    client = _client(pool, api_key)
    view = _call(client.drain_node, node, deadline=deadline)
    leases = sum(len(g.get("leases") or ()) for g in view.get("gpus", ()))
    if not as_json:
        typer.echo(f"gpuwire: draining {node}: {leases} session(s) to move"
                   + (f", deadline {deadline:g} s" if deadline else ""), err=True)
    started, last = time.monotonic(), None
    while wait and view.get("state") == "draining":
        if time.monotonic() - started > timeout:
            _fail(f"{node} still has sessions after {timeout:g} s; it stays draining (see `gpuwire ls nodes`)")
        time.sleep(0.5)
        view = _call(client.node, node)
        left = sum(len(g.get("leases") or ()) for g in view.get("gpus", ()))
        if left != last and not as_json:
            typer.echo(f"gpuwire: {node}: {left} session(s) left", err=True)
            last = left
        if left == 0 and view.get("state") == "draining":
            view = {**view, "state": "drained"}  # the pool records it at the node's next heartbeat
    if as_json:
        print(json.dumps(view, indent=2))
    elif wait:
        typer.echo(f"gpuwire: {node} is drained after {time.monotonic() - started:.1f} s: it takes no new work "
                   f"(`gpuwire undrain {node}` to take it back)", err=True)


def undrain_command(
    node: str = typer.Argument(..., help="The node's id."),
    pool: Optional[str] = POOL_OPTION, api_key: Optional[str] = KEY_OPTION, as_json: bool = JSON_OPTION,
):
    """Take a drained (or draining) node back into service."""
    view = _call(_client(pool, api_key).undrain_node, node)
    if as_json:
        print(json.dumps(view, indent=2))
    else:
        typer.echo(f"gpuwire: {node} is {view.get('state')}", err=True)


def demo_command(
    jobs: bool = typer.Option(True, "--jobs/--no-jobs", help="Run a tiny torch job on each lease's node."),
    node_memory: str = typer.Option("4GiB", help="GPU memory each demo node offers the pool."),
):
    """One command: a pool and 2 CPU nodes on loopback, a tenant, 3 jobs sharing one GPU, then clean up."""
    from .demo import run_demo
    raise typer.Exit(run_demo(jobs=jobs, node_memory=_size_option(node_memory, "--node-memory")))


def register(app: typer.Typer) -> None:
    """Add the pool's commands to the ``gpuwire`` app."""
    app.command("pool")(pool_command)
    app.add_typer(tenant_app, name="tenant")
    app.add_typer(key_app, name="key")
    app.command("ls")(ls_command)
    app.command("demo")(demo_command)
    app.command("drain")(drain_command)
    app.command("undrain")(undrain_command)
