"""Plumbing shared by the benchmarks: child processes, the run context, figures, result files.

Sits under ``bench.__main__`` (the runner) and above each benchmark module. Every child
process a benchmark needs (a ``gpuwire serve`` node, a delay proxy) is started through
``Context.spawn`` so the runner can kill it by pid at the end, on error, or when a benchmark
overruns its time limit (killing the node makes a blocked client raise ``ConnectionLost``,
so a hung benchmark fails instead of hanging the run).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- child processes


def _readline_with_timeout(stream, timeout: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0] if out else ""


class Child:
    """A child process that prints ``... listening on HOST:PORT ...`` first on stdout."""

    def __init__(self, cmd: list[str], *, what: str, env: dict | None = None, startup_timeout: float = 90.0):
        self.what = what
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.pid = self.proc.pid
        self.stderr_lines: list[str] = []
        line = _readline_with_timeout(self.proc.stdout, startup_timeout)
        match = re.search(r"listening on \[?([^\s\]]+)\]?:(\d+)", line or "")
        if not match:
            self.proc.kill()
            rest = self.proc.stderr.read() if self.proc.stderr else ""
            self.kill()
            raise RuntimeError(f"{what} did not start: printed {line!r}; stderr: {rest[-2000:]}")
        self.banner = line.strip()
        self.host, self.port = match.group(1), int(match.group(2))
        self.address = f"{self.host}:{self.port}"
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                del self.stderr_lines[:-200]
        except (OSError, ValueError):
            pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def rss(self) -> int:
        """The child's resident set size in bytes (0 once it is gone)."""
        return rss_bytes(self.pid)

    def log_tail(self, n: int = 20) -> str:
        return "".join(self.stderr_lines[-n:])

    def kill(self) -> None:
        """SIGKILL by pid and reap; harmless when already gone."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream:
                    stream.close()
            except OSError:
                pass


class Worker:
    """A child process with no banner (a load generator): JSON config in on stdin, lines out."""

    def __init__(self, cmd: list[str], *, what: str, env: dict | None = None):
        self.what = what
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})}, cwd=REPO)
        self.pid = self.proc.pid
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    _drain = Child._drain
    alive = Child.alive
    kill = Child.kill

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def readline(self, timeout: float) -> str:
        line = _readline_with_timeout(self.proc.stdout, timeout)
        if not line:
            raise RuntimeError(f"{self.what} (pid {self.pid}) said nothing within {timeout:g} s; "
                               f"stderr: {''.join(self.stderr_lines[-20:])[-2000:]}")
        return line


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process (this one by default), from /proc; 0 if unknown."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def wait_idle(pid: int, *, timeout: float = 20.0, window: float = 0.3) -> bool:
    """Wait until process ``pid`` uses (almost) no CPU for ``window`` seconds: a node that just
    started may still be warming up in the background (imports), which would otherwise be
    charged to the first figures measured against it. False if it never settled."""
    deadline = time.monotonic() + timeout
    last = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(window)
        now = cpu_seconds(pid)
        if now - last <= 0.02:
            return True
        last = now
    return False


def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default), from /proc; 0 if unknown."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------- results


@dataclass
class Result:
    """What one benchmark reports: figures, and errors of the parts that failed."""

    name: str
    description: str = ""
    figures: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    status: str = "ok"  # ok | failed | skipped
    config: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    duration_s: float = 0.0

    def add(self, figure: str, value, unit: str, baseline=None, ratio="auto", target=None, ok=None, note=None,
            baseline_label=None):
        """One figure. ``ratio`` defaults to value/baseline when both are numbers."""
        if ratio == "auto":
            ratio = (value / baseline) if _num(value) and _num(baseline) and baseline else None
        entry = {"figure": figure, "value": _round(value), "unit": unit, "baseline": _round(baseline),
                 "ratio": _round(ratio)}
        if baseline_label:
            entry["baseline_is"] = baseline_label
        if target is not None:
            entry["target"] = target
            entry["ok"] = ok
        if note:
            entry["note"] = note
        self.figures.append(entry)
        return entry

    def fail(self, part: str, exc: BaseException) -> None:
        """Record a failed part (a model, a size): the error, its traceback, a figure row."""
        message = f"{type(exc).__name__}: {exc}"
        self.errors.append({"part": part, "error": message,
                            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))})
        self.figures.append({"figure": f"{part}: FAILED", "value": None, "unit": "", "baseline": None,
                             "ratio": None, "error": message})
        self.status = "failed"

    def skip(self, reason: str) -> None:
        self.status = "skipped"
        self.figures.append({"figure": f"skipped: {reason}", "value": None, "unit": "", "baseline": None,
                             "ratio": None})

    def to_json(self, env: dict) -> dict:
        return {"name": self.name, "description": self.description, "status": self.status,
                "figures": self.figures, "errors": self.errors, "config": self.config,
                "duration_s": round(self.duration_s, 2), **env}


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _round(x):
    if isinstance(x, float):
        return float(f"{x:.4g}")
    return x


def environment(threads: int) -> dict:
    import torch

    import gpuwire
    sha, dirty = git_state()
    return {
        "machine": {"cpu_count": os.cpu_count(),
                    "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "intra_op_threads": threads,
                    "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None},
        "torch_version": torch.__version__,
        "gpuwire_version": gpuwire.__version__,
        "git_sha": sha,
        "git_dirty": dirty,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def git_state() -> tuple[str | None, bool | None]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout
        return sha, bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------- the run context


class Context:
    """What a benchmark gets: the settings, a node (started on demand), child processes."""

    def __init__(self, *, quick: bool, threads: int, log=print):
        self.quick = quick
        self.threads = threads
        self.log = log
        self._children: list[Child] = []
        self._nodes: dict[str, Child] = {}
        self._lock = threading.Lock()
        self.aborted: str | None = None  # set by abort(): no new children until the next benchmark

    # children
    def spawn(self, cmd: list[str], *, what: str, env: dict | None = None) -> Child:
        return self._start(Child, cmd, what, env)

    def worker(self, cmd: list[str], *, what: str, env: dict | None = None) -> Worker:
        """A banner-less child (killed with the others at the end, on error or overrun)."""
        return self._start(Worker, cmd, what, env)

    def _start(self, kind, cmd: list[str], what: str, env: dict | None):
        if self.aborted:
            raise TimeoutError(f"not starting a {what}: {self.aborted}")
        child = kind(cmd, what=what, env=env)
        with self._lock:
            self._children.append(child)
        return child

    def kill(self, child) -> None:
        child.kill()
        with self._lock:
            if child in self._children:
                self._children.remove(child)
            for key, node in list(self._nodes.items()):
                if node is child:
                    del self._nodes[key]

    def abort(self, reason: str) -> None:
        """Kill every child now (a blocked client then raises ConnectionLost) and start no more."""
        self.aborted = reason
        self.kill_all()

    def kill_all(self) -> None:
        with self._lock:
            children, self._children = self._children, []
            self._nodes.clear()
        for child in children:
            child.kill()

    # nodes
    def node(self, backend: str = "cpu", *extra: str, fresh: bool = False, env: dict | None = None) -> Child:
        """A live ``gpuwire serve`` on loopback with ``--threads`` = the local thread count
        (``extra``: more ``serve`` options; ``fresh``: a new node, not the run's shared one;
        ``env``: more environment for it, e.g. ``GPUWIRE_PROFILE_SESSIONS``)."""
        key = (backend, *extra)
        node = self._nodes.get(key)
        if node is not None and node.alive and not fresh:
            return node
        if node is not None:
            self.kill(node)
        cmd = [sys.executable, "-m", "gpuwire", "serve", "--host", "127.0.0.1", "--port", "0",
               "--backend", backend, "--threads", str(self.threads), "--log-level", "warning", "--exit-with-stdin",
               *extra]
        node = self.spawn(cmd, what=f"gpuwire node ({backend})", env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **(env or {})})
        self._nodes[key] = node
        wait_idle(node.pid)
        return node

    def attach(self, address: str | None = None, backend: str = "cpu") -> str:
        """A fresh gpuwire session (on ``address``, else on this run's node)."""
        import gpuwire
        address = address or self.node(backend).address
        gpuwire.attach(address)
        return address

    def proxy(self, target: str, one_way_ms: float) -> Child:
        cmd = [sys.executable, "-m", "bench.delay_proxy", "--target", target, "--delay-ms", repr(one_way_ms),
               "--exit-with-stdin"]
        return self.spawn(cmd, what="delay proxy", env={"PYTHONPATH": str(REPO)})


# ---------------------------------------------------------------- timing helpers


def wait_for_files(directory: Path, pattern: str, timeout: float) -> list[Path]:
    """The files matching ``pattern`` in ``directory`` once there is one (a node writes its
    sessions' profiles when they end: whole, or not there), else [] after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        found = sorted(directory.glob(pattern))
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def median(xs) -> float:
    return statistics.median(xs)


def quantiles(xs) -> tuple[float, float]:
    xs = sorted(xs)
    if len(xs) < 4:
        return xs[0], xs[-1]
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def detach() -> None:
    try:
        import gpuwire
        gpuwire.detach()
    except Exception:  # noqa: BLE001 - best effort between benchmarks
        pass
