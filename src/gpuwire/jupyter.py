"""IPython/Jupyter integration: ``%load_ext gpuwire`` then ``%gpuwire attach [--node HOST:PORT]``.

Sits at the user edge, inside a running kernel: the same attach (and CUDA compatibility) as
``gpuwire run``, without restarting the kernel.
"""

from __future__ import annotations

import argparse
import shlex

_USAGE = """%gpuwire attach [--node HOST:PORT] [--token TOKEN] [--no-cuda-compat]
%gpuwire status
%gpuwire detach"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%gpuwire", add_help=False)
    parser.add_argument("action", choices=["attach", "status", "detach"])
    parser.add_argument("--node")
    parser.add_argument("--token")
    parser.add_argument("--no-cuda-compat", action="store_true")
    return parser


def gpuwire_magic(line: str) -> str:
    import gpuwire

    try:
        args = _parser().parse_args(shlex.split(line))
    except SystemExit:
        return "usage:\n" + _USAGE
    if args.action == "attach":
        runtime = gpuwire.attach(args.node, token=args.token, cuda_compat=not args.no_cuda_compat)
        info = runtime.device_info
        compat = "" if args.no_cuda_compat else "; 'cuda' now means this device"
        return f"gpuwire: attached to {info.get('name')} on node {runtime.address}{compat}"
    if args.action == "detach":
        gpuwire.detach()
        return "gpuwire: detached"
    stats = gpuwire.stats()
    if not stats.get("connected"):
        return "gpuwire: not attached (run %gpuwire attach)"
    return (f"gpuwire: node {stats['node']}, {stats['ops_sent']} ops sent, {stats['round_trips']} round trips, "
            f"{stats['live_storages']} live remote storages")


def load_ipython_extension(ipython) -> None:
    ipython.register_magic_function(gpuwire_magic, magic_kind="line", magic_name="gpuwire")
