"""The pool over HTTPS (certificates from `gpuwire certs init`), and no plain HTTP off loopback."""

import os
import subprocess
import sys

import pytest

from gpuwire.pool.client import PoolClient, PoolUnreachable
from gpuwire.security.tls import init_certs

from .conftest import PoolProcess

pytestmark = pytest.mark.timeout(90)


def test_https_pool_trusted_through_gpuwire_tls_ca(tmp_path, monkeypatch):
    certs = init_certs(tmp_path / "certs", ["127.0.0.1", "localhost"])
    monkeypatch.setenv("GPUWIRE_TLS_CA", certs["ca"])
    pool = PoolProcess(str(tmp_path), "--tls-cert", certs["pool"], "--tls-key", certs["pool_key"])
    try:
        assert pool.url.startswith("https://127.0.0.1:")
        with PoolClient(pool.url, pool.admin_key) as client:
            assert client.version()["api"] == "v1"
        monkeypatch.delenv("GPUWIRE_TLS_CA")
        with PoolClient(pool.url, pool.admin_key) as untrusting:
            with pytest.raises(PoolUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
                untrusting.health()
    finally:
        pool.kill()


def test_plain_http_off_loopback_is_refused(tmp_path):
    result = subprocess.run([sys.executable, "-m", "gpuwire", "pool", "--host", "0.0.0.0", "--port", "0",
                             "--db", str(tmp_path / "p.db")], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "GPUWIRE_ADMIN_KEY": ""})
    assert result.returncode == 2 and "refusing to serve plain HTTP" in result.stderr
