"""TLS on the data plane: certificates from `gpuwire certs init`, verified by clients;
mutual TLS; plain TCP refused on reachable addresses."""

import os
import subprocess
import sys

import pytest

from gpuwire.client.errors import NodeUnreachable
from gpuwire.client.runtime import Runtime
from tests.conftest import NodeProcess


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    result = subprocess.run([sys.executable, "-m", "gpuwire", "certs", "init", "--dir", str(folder)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return folder


@pytest.fixture
def tls_env(monkeypatch):
    def use(**values):
        for key in ("GPUWIRE_TLS_CA", "GPUWIRE_TLS_CERT", "GPUWIRE_TLS_KEY"):
            monkeypatch.delenv(key, raising=False)
        for key, value in values.items():
            monkeypatch.setenv(key, str(value))
    return use


def test_tls_node_serves_verified_clients(certs, tls_env):
    node = NodeProcess("--tls-cert", str(certs / "node.pem"), "--tls-key", str(certs / "node-key.pem"))
    try:
        tls_env(GPUWIRE_TLS_CA=certs / "ca.pem")
        rt = Runtime(node.address)
        sid = rt.allocate(1 << 20)
        rt.write(sid, 0, memoryview(b"\x05" * (1 << 20)))  # large payload through TLS (no sendmsg)
        assert bytes(rt.read(sid, 0, 1 << 20)) == b"\x05" * (1 << 20)
        rt.close()
        tls_env()
        with pytest.raises(NodeUnreachable, match="not a gpuwire node"):
            Runtime(node.address, connect_timeout=5)  # plain client: clean error, no hang
    finally:
        node.kill()


def test_wrong_ca_is_rejected(certs, tls_env, tmp_path):
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-m", "gpuwire", "certs", "init", "--dir", str(other)], check=True,
                   capture_output=True, timeout=60)
    node = NodeProcess("--tls-cert", str(certs / "node.pem"), "--tls-key", str(certs / "node-key.pem"))
    try:
        tls_env(GPUWIRE_TLS_CA=other / "ca.pem")
        with pytest.raises(NodeUnreachable, match="not trusted"):
            Runtime(node.address, connect_timeout=5)
    finally:
        node.kill()


def test_mutual_tls_requires_a_client_certificate(certs, tls_env):
    node = NodeProcess("--tls-cert", str(certs / "node.pem"), "--tls-key", str(certs / "node-key.pem"),
                       "--tls-client-ca", str(certs / "ca.pem"))
    try:
        tls_env(GPUWIRE_TLS_CA=certs / "ca.pem")
        with pytest.raises(NodeUnreachable):
            Runtime(node.address, connect_timeout=5)
        tls_env(GPUWIRE_TLS_CA=certs / "ca.pem", GPUWIRE_TLS_CERT=certs / "client.pem",
                GPUWIRE_TLS_KEY=certs / "client-key.pem")
        rt = Runtime(node.address)
        rt.synchronize()
        rt.close()
    finally:
        node.kill()


def test_plain_tcp_on_a_reachable_address_is_refused():
    result = subprocess.run([sys.executable, "-m", "gpuwire", "serve", "--host", "0.0.0.0", "--port", "0",
                             "--backend", "cpu"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "refusing to serve plain TCP" in result.stderr and "--insecure" in result.stderr
