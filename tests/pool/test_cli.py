"""The pool's commands as a user types them: tenant, key, ls, smi --pool, pool, demo."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from .conftest import NodeProcess, unique, wait_until

pytestmark = pytest.mark.timeout(120)
GIB = 1 << 30


def gpuwire(*args, env=None, timeout=90):
    """The command in a real subprocess."""
    full_env = {**os.environ, "GPUWIRE_POOL": "", "GPUWIRE_API_KEY": "", "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpuwire", *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env)


def cli(*args, env=None):
    """The command in this process (typer's runner): the same code, without a 2 s interpreter start."""
    from typer.testing import CliRunner

    from gpuwire.cli import app
    result = CliRunner().invoke(app, list(args), env={"GPUWIRE_POOL": "", "GPUWIRE_API_KEY": "", **(env or {})})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    result.returncode = result.exit_code
    return result


def test_tenant_key_ls_and_smi_commands(tmp_path, pool_proc, admin):
    as_admin = {"GPUWIRE_POOL": pool_proc.url, "GPUWIRE_API_KEY": pool_proc.admin_key}
    name = unique("team")
    made = cli("tenant", "create", name, "--max-gpus", "2", "--max-memory", "8GiB", env=as_admin)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"created tenant {name} (max GPUs 2, max memory 8GiB)"

    key = cli("key", "create", "--tenant", name, env=as_admin)
    assert key.returncode == 0, key.stderr
    tenant_key = key.stdout.strip()
    assert re.fullmatch(r"gpw_[0-9a-f]{8}_\S+", tenant_key) and "shown only this once" in key.stderr

    node_key = admin.create_key(role="node")["key"]
    node = NodeProcess(str(tmp_path), pool_proc.url, node_key, unique("cli-node"))
    try:
        wait_until(lambda: node.node_id in [n["id"] for n in admin.nodes()], what="registration")
        from gpuwire.pool.client import PoolClient
        lease = PoolClient(pool_proc.url, tenant_key).request_lease(share=0.25, memory="1GiB")

        listed = cli("ls", "nodes", "--json", "--pool", pool_proc.url, env={"GPUWIRE_API_KEY": tenant_key})
        assert listed.returncode == 0, listed.stderr
        assert node.node_id in [n["id"] for n in json.loads(listed.stdout)]

        smi = gpuwire("smi", "--pool", pool_proc.url, env={"GPUWIRE_API_KEY": pool_proc.admin_key})
        assert smi.returncode == 0, smi.stderr
        for text in ("Nodes and GPUs", node.node_id, node.address, "Leases", lease.id, name, "Tenants",
                     "0.25 / 2", "1GiB / 8GiB", "Free:"):
            assert text in smi.stdout, (text, smi.stdout)

        smi_json = cli("smi", "--pool", pool_proc.url, "--json", env={"GPUWIRE_API_KEY": tenant_key})
        status = json.loads(smi_json.stdout)
        assert [l["id"] for l in status["leases"]] == [lease.id]          # a tenant sees its own leases
        assert [t["name"] for t in status["tenants"]] == [name]
        assert node.node_id in [n["id"] for n in status["nodes"]]
        lease.release()
    finally:
        node.kill()


def test_cli_errors_are_one_clear_line(pool_proc):
    as_admin = {"GPUWIRE_POOL": pool_proc.url, "GPUWIRE_API_KEY": pool_proc.admin_key}
    bad_size = cli("tenant", "create", "x", "--max-memory", "lots", env=as_admin)
    assert bad_size.returncode == 2 and "invalid size 'lots'" in bad_size.stderr
    wrong_key = cli("tenant", "list", env={**as_admin, "GPUWIRE_API_KEY": "wrong"})
    assert wrong_key.returncode == 1 and wrong_key.stderr.strip() == "gpuwire: invalid or revoked API key"
    no_pool = cli("ls", "leases")
    assert no_pool.returncode == 1 and "GPUWIRE_POOL" in no_pool.stderr
    busy = gpuwire("pool", "--port", str(pool_proc.port), "--db", os.path.join(pool_proc.folder, "other.db"))
    assert busy.returncode == 2 and "cannot listen" in busy.stderr


def test_first_start_prints_an_admin_key_once_and_stores_it_hashed(tmp_path):
    from .conftest import Proc
    db = str(tmp_path / "fresh.db")
    proc = Proc("fresh", ["pool", "--port", "0", "--db", db, "--log-level", "warning"], str(tmp_path))
    try:
        key = proc.wait_for(r"admin API key \(shown once, stored hashed\): (\S+)").group(1)
        url = proc.wait_for(r"gpuwire pool listening on (http://\S+)").group(1)
        from gpuwire.pool.client import PoolClient
        assert PoolClient(url, key).tenants() == []
    finally:
        proc.kill()
    with open(db, "rb") as f:
        assert key.encode() not in f.read()


def test_demo_runs_end_to_end():
    demo = subprocess.Popen([sys.executable, "-m", "gpuwire", "demo"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, "GPUWIRE_POOL": "", "GPUWIRE_API_KEY": "", "COLUMNS": "200"})
    try:
        out, err = demo.communicate(timeout=100)
    finally:
        if demo.poll() is None:  # hung: kill the demo and whatever it started (its own process group)
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    assert demo.returncode == 0, out + err
    placed = re.findall(r"lease (l-\w+): share (\S+) with 1GiB -> (\S+) GPU 0", out)
    assert [share for _, share, _ in placed] == ["0.25", "0.25", "0.5"]
    assert len({node for _, _, node in placed}) == 1                      # packed onto one GPU
    whole = re.search(r"a whole GPU -> (\S+) GPU 0", out).group(1)
    assert whole != placed[0][2]                                          # the other GPU, kept whole
    assert "waiting for a GPU: 1st in queue" in out and "the queued request got lease" in out
    assert len(re.findall(r"job on lease l-\w+: node \S+, loss", out)) == 4
    assert "Nodes and GPUs" in out and "Free:" in out
    stopped = re.search(r"stopped 3 processes \((.*)\)", out).group(1)
    for pid in re.findall(r"pid (\d+)", stopped):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
