"""The pool's HTTP API against a real ``gpuwire pool`` process: auth, tenants, nodes, leases,
quotas, capacity errors, bad input. Nodes here are registered over HTTP (no node process)."""

import time

import httpx
import pytest

from gpuwire.pool.agent import make_token_verifier
from gpuwire.pool.client import PoolError
from gpuwire.pool.tokens import TokenWrongNode

from .conftest import fake_gpu, unique, wait_until

GIB = 1 << 30
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def pool_proc(tmp_path_factory):
    from .conftest import PoolProcess
    # nodes registered over HTTP never heartbeat: give them minutes; leases expire on time (no grace)
    proc = PoolProcess(str(tmp_path_factory.mktemp("pool")), "--heartbeat-interval", "100", "--restart-grace", "0")
    yield proc
    proc.kill()


def raw(pool_proc, method, path, key=None, **kwargs):
    headers = kwargs.pop("headers", {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, pool_proc.url + path, headers=headers, timeout=10, **kwargs)


# ---------------------------------------------------------------- auth

def test_health_needs_no_key_and_everything_else_does(pool_proc):
    assert raw(pool_proc, "GET", "/v1/health").json()["status"] == "ok"
    for method, path in [("GET", "/v1/version"), ("GET", "/v1/nodes"), ("GET", "/v1/leases"), ("POST", "/v1/leases"),
                         ("GET", "/v1/tenants"), ("POST", "/v1/keys"), ("GET", "/v1/status"),
                         ("POST", "/v1/nodes/x/heartbeat"), ("GET", "/v1/signing-key")]:
        reply = raw(pool_proc, method, path, json={})
        assert reply.status_code == 401, (method, path, reply.text)
        assert reply.headers["www-authenticate"] == "Bearer"
        assert "API key" in reply.json()["message"]
    assert raw(pool_proc, "GET", "/v1/version", key=pool_proc.admin_key).json()["api"] == "v1"


def test_wrong_or_malformed_key_is_401(pool_proc):
    wrong = pool_proc.admin_key[:-4] + "AAAA"
    for key in (wrong, "gpw_00000000_" + "x" * 40, "nonsense"):
        reply = raw(pool_proc, "GET", "/v1/version", key=key)
        assert reply.status_code == 401 and reply.json()["error"] == "unauthorized"
    reply = raw(pool_proc, "GET", "/v1/version", headers={"Authorization": "Basic Zm9vOmJhcg=="})
    assert reply.status_code == 401


def test_tenant_node_and_admin_rights(admin, make_tenant, fake_node):
    tenant = make_tenant()
    for call in (lambda: tenant.create_tenant(unique("x")), lambda: tenant.create_key(tenant=tenant.tenant),
                 lambda: tenant.keys(), lambda: tenant.register_node("sneaky", "127.0.0.1:1", [fake_gpu()])):
        with pytest.raises(PoolError) as err:
            call()
        assert err.value.status == 403 and "admin" in err.value.message
    with pytest.raises(PoolError) as err:
        admin.request_lease(share=0.5)
    assert err.value.status == 403 and "tenant" in err.value.message
    with pytest.raises(PoolError) as err:
        fake_node.client.request_lease(share=0.5)
    assert err.value.status == 403
    with pytest.raises(PoolError) as err:
        fake_node.client.tenants()
    assert err.value.status == 403
    assert "sneaky" not in [n["id"] for n in admin.nodes()]


def test_revoked_key_is_refused(admin, make_tenant):
    tenant = make_tenant()
    assert tenant.leases() == []
    key_id = next(k["id"] for k in admin.keys() if k["tenant"] == tenant.tenant)
    admin.revoke_key(key_id)
    with pytest.raises(PoolError) as err:
        tenant.leases()
    assert err.value.status == 401 and "revoked" in err.value.message
    assert "hash" not in admin.keys()[0] and "key" not in admin.keys()[0]


def test_openapi_schema(pool_proc):
    schema = raw(pool_proc, "GET", "/v1/openapi.json").json()
    for path in ("/v1/health", "/v1/version", "/v1/nodes", "/v1/nodes/{node_id}/heartbeat", "/v1/leases",
                 "/v1/leases/{lease_id}", "/v1/leases/{lease_id}/renew", "/v1/tenants", "/v1/keys"):
        assert path in schema["paths"], path
    assert "LeaseIn" in schema["components"]["schemas"]


# ---------------------------------------------------------------- tenants

def test_tenants(admin, make_tenant):
    tenant = make_tenant(max_gpus=2, max_memory="8GiB")
    with pytest.raises(PoolError) as err:
        admin.create_tenant(tenant.tenant)
    assert err.value.status == 409
    everyone = {t["name"]: t for t in admin.tenants()}
    assert everyone[tenant.tenant]["max_memory"] == 8 * GIB and everyone[tenant.tenant]["max_gpus"] == 2
    assert [t["name"] for t in tenant.tenants()] == [tenant.tenant]  # a tenant sees only itself
    with pytest.raises(PoolError) as err:
        admin.create_key(tenant="no-such-tenant")
    assert err.value.status == 404


# ---------------------------------------------------------------- nodes

def test_register_and_heartbeat(admin, fake_node):
    node_id = fake_node(gpus=[fake_gpu(0), fake_gpu(1, memory=8 * GIB, name="NVIDIA L4")], labels={"zone": "z1"})
    node = admin.node(node_id)
    assert node["state"] == "alive" and node["labels"] == {"zone": "z1"}
    assert [(g["index"], g["name"], g["memory"]) for g in node["gpus"]] == [
        (0, "NVIDIA A100-SXM4-80GB", 16 * GIB), (1, "NVIDIA L4", 8 * GIB)]
    reply = fake_node.client.heartbeat(node_id, usage={"sessions": 3, "bytes_in_use": 1234})
    assert reply["state"] == "alive" and reply["heartbeat_interval"] == 100
    node = admin.node(node_id)
    assert node["usage"] == {"sessions": 3, "bytes_in_use": 1234} and node["heartbeat_age"] < 5
    with pytest.raises(PoolError) as err:
        fake_node.client.heartbeat("never-registered")
    assert err.value.status == 404 and "register" in err.value.message


def test_node_restart_fails_its_leases(admin, make_tenant, fake_node):
    tag = unique("restart")
    node_id = unique("n")
    fake_node.client.register_node(node_id, "127.0.0.1:9", [fake_gpu()], labels={"t": tag}, boot_id="boot-1")
    tenant = make_tenant()
    lease = tenant.request_lease(share=0.5, labels={"t": tag})
    with pytest.raises(PoolError) as err:
        fake_node.client.heartbeat(node_id, boot_id="boot-2")
    assert err.value.status == 409 and "register again" in err.value.message
    fake_node.client.register_node(node_id, "127.0.0.1:9", [fake_gpu()], labels={"t": tag}, boot_id="boot-2")
    view = tenant.get_lease(lease.id)
    assert view["state"] == "failed" and "restarted" in view["reason"]
    fake_node.client.deregister_node(node_id)


# ---------------------------------------------------------------- leases

def test_lease_request_renew_release(admin, make_tenant, fake_node, pool_proc):
    tag = unique("life")
    node_id = fake_node(labels={"t": tag})
    tenant = make_tenant()
    lease = tenant.request_lease(share=0.25, memory="2GiB", labels={"t": tag}, ttl=30)
    data = lease.data
    assert data["state"] == "active" and data["tenant"] == tenant.tenant
    assert data["node_id"] == node_id and data["device"] == 0 and data["address"].startswith("127.0.0.1:")
    assert data["memory"] == 2 * GIB and data["share"] == 0.25 and data["token"]
    assert 25 < data["expires_at"] - time.time() <= 30
    # the token is what the node checks, locally, with the pool's public key
    node_key = fake_node.client.api_key
    claims = make_token_verifier(pool_proc.url, node_id, api_key=node_key)(data["token"])
    assert (claims["lease"], claims["tenant"], claims["memory"], claims["share"]) == (
        lease.id, tenant.tenant, 2 * GIB, 0.25)
    with pytest.raises(TokenWrongNode):
        make_token_verifier(pool_proc.url, "other-node", api_key=node_key)(data["token"])

    first_expiry = data["expires_at"]
    time.sleep(0.05)
    renewed = lease.renew(ttl=40)
    assert renewed["expires_at"] > first_expiry and renewed["ttl"] == 40 and renewed["token"]
    assert [l["id"] for l in tenant.leases()] == [lease.id]
    assert lease.id in [l["id"] for l in admin.leases()]
    gpu = admin.node(node_id)["gpus"][0]
    assert gpu["used_share"] == 0.25 and gpu["used_memory"] == 2 * GIB and gpu["leases"] == [lease.id]

    assert lease.release()["state"] == "released"
    assert tenant.release(lease.id)["state"] == "released"  # idempotent
    with pytest.raises(PoolError) as err:
        tenant.renew(lease.id)
    assert err.value.status == 409 and "released" in err.value.message
    assert tenant.leases() == [] and tenant.leases(state="all")[0]["state"] == "released"
    assert admin.node(node_id)["gpus"][0]["used_share"] == 0


def test_other_tenants_cannot_see_or_touch_a_lease(make_tenant, fake_node):
    tag = unique("iso")
    fake_node(labels={"t": tag})
    owner, other = make_tenant(), make_tenant()
    lease = owner.request_lease(share=0.5, labels={"t": tag})
    for call in (other.get_lease, other.renew, other.release):
        with pytest.raises(PoolError) as err:
            call(lease.id)
        assert err.value.status == 404
    assert other.leases() == []
    assert owner.get_lease(lease.id)["state"] == "active"


def test_409_when_nothing_fits_says_what_is_free(make_tenant, fake_node):
    tag = unique("full")
    node_id = fake_node(gpus=[fake_gpu(0, memory=8 * GIB)], labels={"t": tag})
    tenant = make_tenant()
    tenant.request_lease(share=0.75, memory="6GiB", labels={"t": tag})
    with pytest.raises(PoolError) as err:
        tenant.request_lease(share=0.5, memory="1GiB", labels={"t": tag})
    assert err.value.status == 409 and err.value.code == "no_capacity"
    assert "largest free compute share" in err.value.message and "0.25" in err.value.message
    free = [g for g in err.value.body["free"]["gpus"] if g["node_id"] == node_id]
    assert free == [{"node_id": node_id, "device": 0, "name": "NVIDIA A100-SXM4-80GB", "backend": "cuda",
                     "memory": 8 * GIB, "free_memory": 2 * GIB, "free_share": 0.25, "sessions": 1,
                     "max_sessions": 8, "whole_free": False}]
    with pytest.raises(PoolError) as err:
        tenant.request_lease(gpus=1, labels={"t": tag})
    assert err.value.status == 409 and "whole" in err.value.message
    with pytest.raises(PoolError) as err:  # can never fit: said so, whatever the wait
        tenant.request_lease(memory="9GiB", labels={"t": tag})
    assert err.value.status == 409 and "even when it is empty" in err.value.message
    assert len(tenant.leases()) == 1


def test_quotas(make_tenant, fake_node):
    tag = unique("quota")
    fake_node(gpus=[fake_gpu(0), fake_gpu(1)], labels={"t": tag})
    tenant = make_tenant(max_gpus=1, max_memory="4GiB")
    tenant.request_lease(share=0.5, memory="2GiB", labels={"t": tag})
    tenant.request_lease(share=0.25, memory="1GiB", labels={"t": tag})
    with pytest.raises(PoolError) as err:
        tenant.request_lease(share=0.5, memory="512MiB", labels={"t": tag})
    assert err.value.status == 409 and err.value.code == "quota_exceeded" and "0.75 of its 1 GPU" in err.value.message
    with pytest.raises(PoolError) as err:
        tenant.request_lease(share=0.25, memory="2GiB", labels={"t": tag})
    assert err.value.status == 409 and "memory" in err.value.message
    with pytest.raises(PoolError) as err:
        tenant.request_lease(gpus=2, labels={"t": tag})
    assert err.value.status == 403 and "at most 1 GPU" in err.value.message
    with pytest.raises(PoolError) as err:
        tenant.request_lease(share=0.1, memory="5GiB", labels={"t": tag})
    assert err.value.status == 403
    assert len(tenant.leases()) == 2
    usage = tenant.tenants()[0]
    assert usage["used_gpus"] == 0.75 and usage["used_memory"] == 3 * GIB


def test_lease_expires_unless_renewed(make_tenant, fake_node):
    tag = unique("ttl")
    fake_node(labels={"t": tag})
    tenant = make_tenant()
    forgotten = tenant.request_lease(share=0.5, labels={"t": tag}, ttl=1)
    kept = tenant.request_lease(share=0.5, labels={"t": tag}, ttl=1)
    keeper = kept.keep_alive()
    view = wait_until(lambda: (v := tenant.get_lease(forgotten.id))["state"] == "expired" and v, timeout=10,
                      what="the lease to expire")
    assert "not renewed" in view["reason"]
    time.sleep(1.2)
    assert tenant.get_lease(kept.id)["state"] == "active" and keeper.renewals >= 3
    kept.release()
    assert kept.data["state"] == "released"
    assert not keeper.is_alive()


# ---------------------------------------------------------------- bad input

BAD_LEASES = [
    ("{not json", 400), ('{"gpus": 1,}', 400), ("[]", 422), ('"share"', 422),
    ('{"gpus": 1, "colour": "red"}', 422),          # unknown field
    ('{"memory": -1}', 422), ('{"memory": "-1GiB"}', 422), ('{"memory": "2PiB"}', 422),
    ('{"memory": 99999999999999999999999}', 422), ('{"memory": "lots"}', 422),
    ('{"share": 0}', 422), ('{"share": 1.5}', 422), ('{"share": -0.5}', 422), ('{"share": NaN}', 422),
    ('{"share": "0.5"}', 422), ('{"gpus": 0}', 422), ('{"gpus": 1000}', 422), ('{"gpus": true}', 422),
    ('{"gpus": 1.5}', 422), ('{"wait": -1}', 422), ('{"wait": 1e12}', 422), ('{"ttl": 0}', 422),
    ('{"priority": 1000}', 422), ('{"labels": {"a": 1}}', 422), ('{"labels": "zone=a"}', 422),
    ('{"model": ""}', 422), ('{"gpus": 2, "share": 0.5}', 422),
]


@pytest.mark.parametrize("body,status", BAD_LEASES)
def test_bad_lease_requests_are_4xx_and_store_nothing(pool_proc, make_tenant, fake_node, body, status):
    fake_node()
    tenant = make_tenant()
    reply = raw(pool_proc, "POST", "/v1/leases", key=tenant.api_key, content=body,
                headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    assert reply.json()["message"]
    assert tenant.leases(state="all") == []


def test_bad_admin_and_node_input_stores_nothing(pool_proc, admin, fake_node):
    tenants_before = len(admin.tenants())
    nodes_before = len(admin.nodes())
    for body in ({"name": "../etc"}, {"name": ""}, {"name": "ok", "max_gpus": -1}, {"name": "ok", "max_memory": "-5"},
                 {"name": "ok", "quota": 1}, {"name": "x" * 100}):
        reply = raw(pool_proc, "POST", "/v1/tenants", key=pool_proc.admin_key, json=body)
        assert reply.status_code == 422, (body, reply.text)
    node_key = fake_node.client.api_key
    for body in ({"id": "n", "address": "127.0.0.1:1", "gpus": []},
                 {"id": "n", "address": "127.0.0.1:1", "gpus": [fake_gpu(0), fake_gpu(0)]},
                 {"id": "n", "address": "no-port", "gpus": [fake_gpu()]},
                 {"id": "bad id!", "address": "127.0.0.1:1", "gpus": [fake_gpu()]},
                 {"id": "n", "address": "127.0.0.1:1", "gpus": [fake_gpu(memory=-1)]},
                 {"id": "n", "address": "127.0.0.1:1", "gpus": [{**fake_gpu(), "extra": 1}]}):
        reply = raw(pool_proc, "POST", "/v1/nodes", key=node_key, json=body)
        assert reply.status_code == 422, (body, reply.text)
    for body in ({"role": "wizard"}, {"role": "tenant"}, {"role": "node", "tenant": "x"}):
        reply = raw(pool_proc, "POST", "/v1/keys", key=pool_proc.admin_key, json=body)
        assert reply.status_code in (404, 422), (body, reply.text)
    huge = '{"name": "' + "a" * (300 << 10) + '"}'
    reply = raw(pool_proc, "POST", "/v1/tenants", key=pool_proc.admin_key, content=huge,
                headers={"Content-Type": "application/json"})
    assert reply.status_code == 413
    assert len(admin.tenants()) == tenants_before and len(admin.nodes()) == nodes_before
    assert raw(pool_proc, "GET", "/v1/no-such-thing", key=pool_proc.admin_key).status_code == 404
    assert raw(pool_proc, "GET", "/v1/leases?state=bogus", key=pool_proc.admin_key).status_code == 422
