"""``gpuwire smi`` and the ``nvidia-smi`` stand-in under ``gpuwire run``.

Sits at the CLI edge: asks a node for its device, memory, utilization and sessions (one
``Query("node")``), and prints them as the table nvidia-smi users know, or as the CSV that
``--query-gpu=... --format=csv`` scripts parse, or as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ._version import __version__

MIB = 1 << 20
QUERY_FIELDS = {
    "index": lambda n, a: ("0", ""),
    "name": lambda n, a: (n["device"]["name"], ""),
    "uuid": lambda n, a: (f"GPU-gpuwire-{a}", ""),
    "driver_version": lambda n, a: (f"gpuwire-{n['server_version']}", ""),
    "memory.total": lambda n, a: (str(n["device"]["total_memory"] // MIB), " MiB"),
    "memory.used": lambda n, a: (str(n["bytes_in_use"] // MIB), " MiB"),
    "memory.free": lambda n, a: (str(max(n["device"]["total_memory"] - n["bytes_in_use"], 0) // MIB), " MiB"),
    "utilization.gpu": lambda n, a: (str(round(n["utilization"])), " %"),
    "utilization.memory": lambda n, a: (str(round(100 * n["bytes_in_use"] / max(n["device"]["total_memory"], 1))), " %"),
    "compute_cap": lambda n, a: ("8.0" if n["device"].get("software") else f"{n['device']['major']}.{n['device']['minor']}", ""),
    "temperature.gpu": lambda n, a: ("N/A", ""),
    "power.draw": lambda n, a: ("N/A", ""),
    "pci.bus_id": lambda n, a: (f"gpuwire:{a}", ""),
    "count": lambda n, a: ("1", ""),
}
UNITS_IN_HEADER = {"memory.total": " [MiB]", "memory.used": " [MiB]", "memory.free": " [MiB]",
                   "utilization.gpu": " [%]", "utilization.memory": " [%]"}


class SmiError(Exception):
    pass


def fetch(address: str, token: str | None) -> tuple[dict, str]:
    from .client.probe import NodeProbe  # (not the runtime: it imports torch, 2-3 s a call)
    with NodeProbe(address, token=token) as probe:
        info = probe.query("node")
        own = probe.welcome.session_id
    info["sessions"] = [s for s in info["sessions"] if s["id"] != own]
    return info, own


def query_csv(info: dict, address: str, fields: list[str], fmt: str) -> str:
    options = {o.strip() for o in fmt.split(",")}
    if "csv" not in options:
        raise SmiError(f"unsupported --format {fmt!r}; use csv, optionally with noheader and/or nounits")
    unknown = [f for f in fields if f not in QUERY_FIELDS]
    if unknown:
        raise SmiError(f"Field \"{unknown[0]}\" is not a valid field to query. Supported: {', '.join(QUERY_FIELDS)}")
    lines = []
    if "noheader" not in options:
        lines.append(", ".join(f + UNITS_IN_HEADER.get(f, "") for f in fields))
    values = []
    for f in fields:
        value, unit = QUERY_FIELDS[f](info, address)
        values.append(value if "nounits" in options or value == "N/A" else value + unit)
    lines.append(", ".join(values))
    return "\n".join(lines)


def table(info: dict, address: str) -> str:
    dev = info["device"]
    name = dev["name"]
    short = name if len(name) <= 36 else name[:33] + "..."
    used, total = info["bytes_in_use"] // MIB, dev["total_memory"] // MIB
    width = 91
    line = "+" + "-" * (width - 2) + "+"
    out = [time.strftime("%a %b %d %H:%M:%S %Y"), line,
           f"| NVIDIA-SMI (gpuwire {__version__})".ljust(40) + f"Node: {address}".ljust(32)
           + f"Backend: {dev['backend']}".ljust(18) + "|",
           "|" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "|",
           "| GPU  Name                               | Bus-Id                 | Volatile Uncorr. ECC |",
           "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
           "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|",
           f"|   0  {short:<35}| {('gpuwire:' + address)[:22]:<22} | {'N/A':>20} |",
           f"| N/A   N/A    P0               N/A / N/A | {f'{used}MiB / {total}MiB':>22} | "
           f"{str(round(info['utilization'])) + '%':>8}      Default |",
           line]
    if dev.get("software"):
        out.append("  Software GPU: this node runs ops on its CPU (gpuwire CPU backend).")
    out += ["", line, "| Processes:".ljust(width - 1) + "|",
            "|  GPU   PID   Client                               Session        Ops         GPU Memory |",
            "|" + "=" * (width - 2) + "|"]
    if not info["sessions"]:
        out.append("|  No running processes found".ljust(width - 1) + "|")
    for s in info["sessions"]:
        out.append(f"|    0 {s['pid']:>6}   {s['peer'][:35]:<35}  {s['id']:<13} {s['ops']:>10} "
                   f"{str(s['bytes_in_use'] // MIB) + 'MiB':>13} |")
    out.append(line)
    return "\n".join(out)


def main(argv: list[str], address: str | None, token: str | None, as_json: bool = False) -> int:
    """nvidia-smi-compatible entry: returns the exit code."""
    address = address or os.environ.get("GPUWIRE_NODE")
    token = token or os.environ.get("GPUWIRE_TOKEN")
    query, fmt, list_gpus = None, "csv", False
    for arg in argv:
        if arg.startswith("--query-gpu="):
            query = [f.strip() for f in arg.split("=", 1)[1].split(",") if f.strip()]
        elif arg.startswith("--format="):
            fmt = arg.split("=", 1)[1]
        elif arg in ("-L", "--list-gpus"):
            list_gpus = True
        elif arg in ("-h", "--help"):
            print("gpuwire nvidia-smi: shows the remote GPU of this gpuwire session.\n"
                  "  (no options)                 the usual table\n"
                  "  -L                           list GPUs\n"
                  "  --query-gpu=F1,F2 --format=csv[,noheader][,nounits]\n"
                  f"  fields: {', '.join(QUERY_FIELDS)}")
            return 0
    if not address:
        print("NVIDIA-SMI has failed because no gpuwire node is configured: set GPUWIRE_NODE=host:port "
              "or run under `gpuwire run`", file=sys.stderr)
        return 9
    from .client.errors import GpuwireError
    try:
        info, _ = fetch(address, token)
    except GpuwireError as exc:
        print(f"NVIDIA-SMI has failed because it couldn't communicate with the gpuwire node: {exc}", file=sys.stderr)
        return 9
    if as_json:
        print(json.dumps(info, indent=2))
    elif list_gpus:
        print(f"GPU 0: {info['device']['name']} (UUID: GPU-gpuwire-{address})")
    elif query:
        try:
            print(query_csv(info, address, query, fmt))
        except SmiError as exc:
            print(str(exc), file=sys.stderr)
            return 2
    else:
        print(table(info, address))
    return 0
