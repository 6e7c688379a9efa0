"""The ``gpuwire`` command line: ``serve`` (a node), ``version``, ``info``.

Sits at the outer edge: parses options, sets up logging, starts the parts in ``node`` and
``client``. Later commands (pool, run, smi …) join here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Optional

import typer

from ._process import exit_when_stdin_closes
from ._version import __version__
from .pool.sizes import parse_size

app = typer.Typer(
    help="gpuwire: network-attached GPUs for PyTorch.\n\n"
         "One machine, no GPU needed:  gpuwire run python train.py   (an embedded CPU node)\n\n"
         "A GPU box:  gpuwire serve --port 7070, then on your machine:  "
         "gpuwire run --node gpu-box:7070 -- python train.py   (\"cuda\" means the remote GPU)\n\n"
         "Many GPU boxes:  gpuwire pool; gpuwire serve --pool URL on each box; "
         "gpuwire run --pool URL --share 0.25 --memory 4GiB -- python train.py\n\n"
         "Try it all on loopback:  gpuwire demo",
    no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(7070, help="TCP port (0 picks a free one; the chosen one is printed)."),
    backend: str = typer.Option("auto", help="auto: CUDA if present, else CPU. cpu: a software GPU. cuda: require CUDA."),
    device_index: int = typer.Option(0, "--device", help="CUDA device index to serve."),
    token: Optional[str] = typer.Option(None, help="Require this token from clients (or set GPUWIRE_NODE_TOKEN)."),
    max_sessions: int = typer.Option(64, help="Most concurrent client sessions."),
    session_memory: Optional[str] = typer.Option(None, help="Memory budget of each session, e.g. 4GiB "
                                                            "(default: the whole device)."),
    idle_timeout: Optional[float] = typer.Option(
        None, help="Drop a session that completes no command for this many seconds (default: never; dead peers "
                   "are found by TCP keepalive, and a partial frame trickling in is dropped after 60 s)."),
    handshake_timeout: float = typer.Option(10.0, help="Seconds a new connection gets to complete its handshake "
                                                       "(overall, not per read: a slow-loris gets no slot)."),
    threads: Optional[int] = typer.Option(None, help="Intra-op CPU threads for the CPU backend (default: torch's)."),
    tls_cert: Optional[str] = typer.Option(None, help="Serve TLS with this certificate (see `gpuwire certs init`)."),
    tls_key: Optional[str] = typer.Option(None, help="Private key of --tls-cert."),
    tls_client_ca: Optional[str] = typer.Option(None, help="Require client certificates signed by this CA (mutual TLS)."),
    insecure: bool = typer.Option(False, help="Allow plain TCP on a non-loopback address (not recommended)."),
    lease_grace: float = typer.Option(30.0, help="With --pool: seconds a session outlives its lease token's expiry "
                                                 "(renewals pause while the pool restarts)."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    pool: Optional[str] = typer.Option(None, help="Register with the pool at this URL and heartbeat to it "
                                                  "(API key: GPUWIRE_API_KEY, a node or admin key)."),
    node_id: Optional[str] = typer.Option(None, help="This node's id in the pool (default: HOSTNAME-PORT)."),
    advertise: Optional[str] = typer.Option(None, help="HOST:PORT clients reach this node at (default: the "
                                                       "listen address)."),
    pool_memory: Optional[str] = typer.Option(None, help="GPU memory offered to the pool, e.g. 8GiB "
                                                         "(default: all of it)."),
    listen_fd: Optional[int] = typer.Option(None, "--listen-fd", hidden=True,
                                            help="Serve on this inherited listening socket (the embedded node)."),
    exit_with_stdin: bool = typer.Option(False, "--exit-with-stdin", hidden=True,
                                         help="Exit when stdin closes (used by the embedded node)."),
    restart_on_crash: bool = typer.Option(
        False, "--restart-on-crash",
        help="Run the node in a child process and start it again on the same address when it dies (a kernel "
             "crash, the out-of-memory killer): its sessions are lost, clients are told why and start new ones. "
             "For a node no supervisor (systemd, Kubernetes) restarts."),
):
    """Run a GPU node: serve PyTorch ops to gpuwire clients over TCP."""
    if restart_on_crash:
        if listen_fd is not None:
            typer.echo("gpuwire serve: --restart-on-crash binds its own socket; drop --listen-fd", err=True)
            raise typer.Exit(2)
        from .supervisor import node_arguments, supervise
        raise typer.Exit(supervise(node_arguments(sys.argv), host, port))
    import torch

    from .node import Backend, NodeServer
    from .node.backend import BackendUnavailable

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if threads:
        torch.set_num_threads(threads)
    try:
        chosen = Backend.select(backend, device_index)
    except BackendUnavailable as exc:
        typer.echo(f"gpuwire serve: {exc}", err=True)
        raise typer.Exit(2)
    if chosen.kind == "cpu":
        from ._memory import keep_freed_heap
        keep_freed_heap()  # kernel outputs stay in the heap between steps (see there)
    token = token or os.environ.get("GPUWIRE_NODE_TOKEN") or None
    from .security.tls import TLSConfigError, is_loopback, server_context
    tls = None
    if tls_cert or tls_key:
        try:
            tls = server_context(tls_cert, tls_key, tls_client_ca)
        except TLSConfigError as exc:
            typer.echo(f"gpuwire serve: {exc}", err=True)
            raise typer.Exit(2)
    elif not is_loopback(host):
        if not insecure:
            typer.echo(f"gpuwire serve: refusing to serve plain TCP on {host}, which other machines can reach; "
                       "pass --tls-cert/--tls-key (make them with `gpuwire certs init --hosts HOSTNAME`), "
                       "or --insecure to accept the risk", err=True)
            raise typer.Exit(2)
        logging.getLogger("gpuwire.node").warning(
            "serving plain TCP on %s with --insecure: anyone on the network can read and inject tensors", host)
    try:
        budget = parse_size(session_memory) if session_memory else None
        if budget == 0:
            raise ValueError("--session-memory must be positive")
    except ValueError as exc:
        typer.echo(f"gpuwire serve: {exc}", err=True)
        raise typer.Exit(2)
    # a kernel's TORCH_WARN_ONCE is passed on every time: "once" is once per client program (whose
    # filters show it once per line), not once for every tenant this node will ever serve
    torch.set_warn_always(True)
    server = NodeServer(host, port, backend=chosen, token=token, max_sessions=max_sessions, idle_timeout=idle_timeout,
                        handshake_timeout=handshake_timeout,
                        session_memory=budget, tls=tls)
    server.restarted_after = os.environ.get("GPUWIRE_NODE_RESTARTED_AFTER") or None
    try:
        bound_host, bound_port = server.adopt_listener(listen_fd) if listen_fd is not None else server.bind()
    except OSError as exc:
        typer.echo(f"gpuwire serve: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2)
    info = chosen.describe()
    label = "software GPU" if info["software"] else "GPU"
    label += ", TLS" if tls else ""
    shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"gpuwire node listening on {shown_host}:{bound_port} (backend {chosen.kind}, {label}: {info['name']})",
          flush=True)
    if exit_with_stdin:
        threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    agent = None
    # SIGTERM during registration is held until the agent exists, so the pool hears the node leave: a
    # supervisor may stop the node the moment it shows up in the pool.
    terminate_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminate_requested.set())
    if pool:  # register with the pool and heartbeat (src/gpuwire/pool/agent.py)
        from .pool.agent import AgentError, start_agent
        try:
            agent = start_agent(pool, backend_info=info, host=bound_host, port=bound_port, node_id=node_id,
                                advertise=advertise, memory=parse_size(pool_memory) if pool_memory else None,
                                max_sessions=max_sessions, server=server)
            server.token_verifier = agent.token_verifier()  # sessions now need a lease token
            server.lease_grace = lease_grace
        except (AgentError, ValueError) as exc:
            typer.echo(f"gpuwire serve: {exc}", err=True)
            server.close()
            raise typer.Exit(2)
    leaving = []

    def leave(*_):
        # (once: a second SIGTERM, which systemd's signal to a whole process group and a
        # supervisor's passing it on make, ran this again inside the first's Event.set, whose
        # lock it then waited for for ever)
        if leaving:
            return
        leaving.append(True)
        if agent is not None:
            agent.stop()
        server.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    if terminate_requested.is_set():
        leave()
    try:
        from .node.session import start_meta_warm_up
        start_meta_warm_up()  # the node process only: not in programs that embed a node
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if agent is not None:
            agent.stop()
        server.close()


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "allow_interspersed_args": False})
def run(
    ctx: typer.Context,
    node: Optional[str] = typer.Option(None, help="HOST:PORT of the node (default: GPUWIRE_NODE, else an "
                                                  "embedded CPU node for this run)."),
    token: Optional[str] = typer.Option(None, help="Token the node requires (default: GPUWIRE_TOKEN)."),
    cuda_compat: bool = typer.Option(True, "--cuda-compat/--no-cuda-compat",
                                     help="Make 'cuda' mean the gpuwire device (torch.cuda.*, .cuda(), autocast)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not print where the GPU is."),
    pool: Optional[str] = typer.Option(None, envvar="GPUWIRE_POOL",
                                       help="Get the GPU from this pool (URL; API key: GPUWIRE_API_KEY)."),
    gpus: int = typer.Option(1, help="With --pool: GPUs to lease."),
    memory: Optional[str] = typer.Option(None, help="With --pool: memory budget, e.g. 4GiB (default: whole GPU)."),
    share: float = typer.Option(1.0, help="With --pool: compute share of the GPU, 0 < share <= 1."),
    wait: float = typer.Option(600.0, help="With --pool: seconds to wait in the queue when nothing is free."),
    durability: Optional[str] = typer.Option(
        None, envvar="GPUWIRE_DURABILITY",
        help="What survives a failure: 'none' (a lost connection ends the program), 'reconnect' (network cuts "
             "up to GPUWIRE_RECONNECT_GRACE s; the default without a pool) or 'checkpoint' (also the loss of the "
             "node: snapshots + a replay log, rebuilt on a replacement GPU; the default with --pool)."),
):
    """Run COMMAND with its GPU work on a gpuwire node.

    Examples:

      gpuwire run python train.py --device cuda

      gpuwire run --node gpu-box:7070 -- python -m mypkg.train

      gpuwire run -- nvidia-smi
    """
    from .launcher import run as run_command
    request = {"gpus": gpus, "share": share, "wait": wait}
    if memory:
        request["memory"] = memory
    if durability is not None and durability not in ("none", "reconnect", "checkpoint"):
        raise typer.BadParameter("choose none, reconnect or checkpoint", param_hint="--durability")
    raise typer.Exit(run_command(list(ctx.args), node=node, token=token, cuda_compat=cuda_compat, quiet=quiet,
                                 pool=pool, lease_request=request, durability=durability))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def smi(
    ctx: typer.Context,
    node: Optional[str] = typer.Option(None, help="HOST:PORT of the node (default: GPUWIRE_NODE)."),
    token: Optional[str] = typer.Option(None, help="Token the node requires (default: GPUWIRE_TOKEN)."),
    json_output: bool = typer.Option(False, "--json", help="Print everything the node reports, as JSON."),
    nvidia_smi: bool = typer.Option(False, "--nvidia-smi", hidden=True),
    pool: Optional[str] = typer.Option(None, help="Show a pool instead (URL): every node, GPU, lease, tenant and "
                                                  "the free capacity (API key: GPUWIRE_API_KEY)."),
):
    """Show a node's GPU, memory, utilization and sessions (nvidia-smi style).

    Also understands nvidia-smi's -L and --query-gpu=name,memory.total,memory.used --format=csv[,noheader][,nounits].
    """
    if pool:
        from .pool.cli import smi_pool
        raise typer.Exit(smi_pool(pool, None, as_json=json_output))
    from . import smi as smi_module
    raise typer.Exit(smi_module.main(list(ctx.args), node, token, as_json=json_output))


certs_app = typer.Typer(help="Certificates for TLS between clients, nodes and the pool.", no_args_is_help=True)
app.add_typer(certs_app, name="certs")


@certs_app.command("init")
def certs_init(
    directory: Optional[str] = typer.Option(None, "--dir", help="Where to write them (default ~/.config/gpuwire/certs)."),
    hosts: str = typer.Option("127.0.0.1,::1,localhost", help="Comma-separated names/addresses the node and pool "
                                                              "certificates are valid for."),
    force: bool = typer.Option(False, help="Replace an existing set."),
):
    """Create a private CA plus node, pool and client certificates signed by it."""
    from .security.tls import DEFAULT_DIR, TLSConfigError, init_certs
    try:
        paths = init_certs(directory or DEFAULT_DIR, [h.strip() for h in hosts.split(",") if h.strip()], force=force)
    except TLSConfigError as exc:
        typer.echo(f"gpuwire certs init: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote a CA and node/pool/client certificates to {os.path.dirname(paths['ca'])}")
    typer.echo(f"  node:   gpuwire serve --host 0.0.0.0 --tls-cert {paths['node']} --tls-key {paths['node_key']}")
    typer.echo(f"  client: export GPUWIRE_TLS_CA={paths['ca']}")
    typer.echo(f"  mutual TLS: add --tls-client-ca {paths['ca']} to serve, and export "
               f"GPUWIRE_TLS_CERT={paths['client']} GPUWIRE_TLS_KEY={paths['client_key']}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                "allow_interspersed_args": False, "help_option_names": []})
def bench(ctx: typer.Context):
    """Run the benchmarks beside their local baselines (python -m bench; --help for its options).

    Examples:

      gpuwire bench --quick

      gpuwire bench --only per_op,step_ratio

      gpuwire bench --only gpu          (on a machine with an NVIDIA GPU)
    """
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    if not (repo / "bench" / "__main__.py").is_file():
        typer.echo("gpuwire bench: the benchmarks ship with the source tree (bench/ beside src/), not with an "
                   "installed wheel: clone the repository, `pip install -e .` it and run `gpuwire bench` again",
                   err=True)
        raise typer.Exit(2)
    args = list(ctx.args)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(repo / "bench" / "results")]  # beside the benchmarks, wherever this runs from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "bench", *args], env)


@app.command()
def version():
    """Print the gpuwire, protocol and torch versions."""
    import torch

    from .protocol import PROTOCOL_VERSION
    print(f"gpuwire {__version__} (protocol v{PROTOCOL_VERSION}, torch {torch.__version__})")


from .pool.cli import register as _register_pool_commands  # noqa: E402 - pool, tenant, key, ls, demo

_register_pool_commands(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
