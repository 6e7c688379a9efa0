"""Lease tokens: what a node accepts (valid) and refuses (expired, tampered, other node, other pool)."""

import base64
import json
import time

import jwt
import pytest

from gpuwire.pool.agent import make_token_verifier
from gpuwire.pool.tokens import (Signer, TokenError, TokenExpired, TokenInvalid, TokenWrongNode, load_public_key,
                                 verify)

GIB = 1 << 30


@pytest.fixture(scope="module")
def signer():
    return Signer.generate()


def issue(signer, **overrides):
    claims = dict(lease_id="l-1", tenant="team-a", node_id="node-1", device=0, memory=4 * GIB, share=0.25,
                  expires_at=time.time() + 60)
    claims.update(overrides)
    return signer.issue(**claims)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def test_valid_token_returns_the_claims(signer):
    claims = verify(issue(signer), signer.public_pem(), "node-1")
    assert claims["lease"] == "l-1" and claims["jti"] == "l-1"
    assert claims["tenant"] == "team-a" and claims["node"] == "node-1" and claims["device"] == 0
    assert claims["memory"] == 4 * GIB and claims["share"] == 0.25
    assert claims["exp"] > time.time()
    assert jwt.get_unverified_header(issue(signer)) == {"alg": "EdDSA", "kid": signer.kid, "typ": "JWT"}


def test_expired_token(signer):
    token = issue(signer, expires_at=time.time() - 30)
    with pytest.raises(TokenExpired, match="expired"):
        verify(token, signer.public_key, "node-1")
    # within the clock-skew leeway it still passes
    verify(issue(signer, expires_at=time.time() - 1), signer.public_key, "node-1", leeway=5)


def test_token_for_another_node(signer):
    with pytest.raises(TokenWrongNode, match="node-2"):
        verify(issue(signer, node_id="node-2"), signer.public_key, "node-1")


def test_tampered_claims_are_refused(signer):
    header, payload, signature = issue(signer).split(".")
    claims = json.loads(_unb64(payload))
    claims["memory"] = 80 * GIB  # ask for more than the lease gave
    forged = ".".join([header, _b64(json.dumps(claims).encode()), signature])
    with pytest.raises(TokenInvalid, match="signature"):
        verify(forged, signer.public_key, "node-1")


def test_tampered_signature_is_refused(signer):
    header, payload, signature = issue(signer).split(".")
    raw = bytearray(_unb64(signature))
    raw[0] ^= 1
    with pytest.raises(TokenInvalid):
        verify(".".join([header, payload, _b64(bytes(raw))]), signer.public_key, "node-1")


def test_token_of_another_pool_is_refused(signer):
    with pytest.raises(TokenInvalid):
        verify(issue(Signer.generate()), signer.public_key, "node-1")


def test_unsigned_and_symmetric_tokens_are_refused(signer):
    claims = jwt.decode(issue(signer), options={"verify_signature": False})
    unsigned = jwt.encode(claims, None, algorithm="none")
    with pytest.raises(TokenInvalid):
        verify(unsigned, signer.public_key, "node-1")
    # HS256 "signed" with the public key's text: the classic algorithm-confusion attack
    confused = jwt.encode(claims, "x" * 32, algorithm="HS256")
    with pytest.raises(TokenInvalid):
        verify(confused, signer.public_key, "node-1")


@pytest.mark.parametrize("bad", [dict(share=1.5), dict(share=0.0), dict(memory=-1), dict(device=-1)])
def test_claims_out_of_range_are_refused(bad):
    signer = Signer.generate()
    claims = {"iss": "gpuwire-pool", "aud": "gpuwire-node", "jti": "l", "lease": "l", "tenant": "t", "node": "node-1",
              "device": 0, "memory": 1, "share": 0.5, "iat": int(time.time()), "exp": int(time.time()) + 60, **bad}
    token = jwt.encode(claims, signer.private_key, algorithm="EdDSA")
    with pytest.raises(TokenInvalid):
        verify(token, signer.public_key, "node-1")


@pytest.mark.parametrize("garbage", ["", "not-a-token", "a.b.c", "x" * 10000, None])
def test_garbage_is_refused(signer, garbage):
    with pytest.raises(TokenError):
        verify(garbage, signer.public_key, "node-1")


def test_make_token_verifier_from_pem_text_and_file(signer, tmp_path):
    token = issue(signer)
    assert make_token_verifier(signer.public_pem(), "node-1")(token)["lease"] == "l-1"
    path = tmp_path / "pool.pub"
    path.write_text(signer.public_pem())
    verify_file = make_token_verifier(str(path), "node-1")
    assert verify_file(token)["share"] == 0.25
    with pytest.raises(TokenWrongNode):
        make_token_verifier(signer.public_key, "node-9")(token)


def test_signing_key_round_trips_through_pem(signer):
    again = Signer.from_pem(signer.private_pem())
    assert again.kid == signer.kid
    verify(again.issue(lease_id="l", tenant="t", node_id="n", device=1, memory=0, share=1.0,
                       expires_at=time.time() + 10), load_public_key(signer.public_pem()), "n")
