"""Lease tokens: JWTs signed by the pool with Ed25519, verified by nodes locally.

Sits between the pool (which signs one token per GPU of a lease) and a node (which checks the
token a client presents, with the pool's *public* key only: no call back to the pool, so a
pool outage never stops admission of an already-leased client).

A token is a compact JWS (``alg: EdDSA``, ``kid``: the key's fingerprint) whose claims are::

    iss "gpuwire-pool"   aud "gpuwire-node"   sub  tenant
    jti  lease id         lease  lease id      tenant  tenant name
    node node id          device device index  memory  budget in bytes   share  0 < share <= 1
    iat  issued (unix s)  exp    lease expiry (unix s)

``verify`` checks, in order: the token's form, the signature (Ed25519 only: ``none``/HS256
tokens are refused), issuer and audience, expiry (with a little leeway for clock skew), the
claims' types and ranges, and that ``node`` is the verifying node. Each failure raises a
``TokenError`` subclass whose message says what to do.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALGORITHM = "EdDSA"
ISSUER = "gpuwire-pool"
AUDIENCE = "gpuwire-node"
REQUIRED_CLAIMS = ("iss", "aud", "exp", "iat", "jti", "lease", "tenant", "node", "device", "memory", "share")
DEFAULT_LEEWAY = 5.0


class TokenError(Exception):
    """A lease token was refused; the message says why and what to do."""


class TokenExpired(TokenError):
    pass


class TokenInvalid(TokenError):
    """Malformed, tampered with, signed by another key, or with claims out of range."""


class TokenWrongNode(TokenError):
    pass


class TokenUnverifiable(TokenError):
    """The node does not know the pool's public key yet (the pool could not be reached to fetch it)."""


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_public_key(key: str | bytes | Ed25519PublicKey) -> Ed25519PublicKey:
    """An Ed25519 public key from PEM text/bytes (or the key itself)."""
    if isinstance(key, Ed25519PublicKey):
        return key
    data = key.encode() if isinstance(key, str) else key
    loaded = serialization.load_pem_public_key(data)
    if not isinstance(loaded, Ed25519PublicKey):
        raise ValueError("the pool's public key must be an Ed25519 key")
    return loaded


class Signer:
    """The pool's signing key and the tokens it issues."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self.private_key = private_key
        self.public_key = private_key.public_key()
        self.kid = key_id(self.public_key)

    @classmethod
    def generate(cls) -> "Signer":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: str | bytes) -> "Signer":
        key = serialization.load_pem_private_key(pem.encode() if isinstance(pem, str) else pem, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the pool's signing key must be an Ed25519 key")
        return cls(key)

    def private_pem(self) -> str:
        return self.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()).decode()

    def public_pem(self) -> str:
        return self.public_key.public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo).decode()

    def issue(self, *, lease_id: str, tenant: str, node_id: str, device: int, memory: int, share: float,
              expires_at: float, now: float | None = None, address: str | None = None) -> str:
        now = time.time() if now is None else now
        claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": tenant, "jti": lease_id, "lease": lease_id,
                  "tenant": tenant, "node": node_id, "device": int(device), "memory": int(memory),
                  "share": float(share), "iat": int(now), "exp": int(expires_at)}
        if address:
            # where the node listens: a node moving a session (drain) connects only to the address
            # a token signed for the same lease names, never to one a client made up
            claims["addr"] = address
        return jwt.encode(claims, self.private_key, algorithm=ALGORITHM, headers={"kid": self.kid})


def verify(token: str, public_key: str | bytes | Ed25519PublicKey, node_id: str, *,
           leeway: float = DEFAULT_LEEWAY) -> dict[str, Any]:
    """The claims of ``token`` if the pool signed it for ``node_id`` and it has not expired.

    Raises ``TokenExpired``, ``TokenWrongNode`` or ``TokenInvalid`` (all ``TokenError``).
    """
    claims = verify_signature(token, public_key, leeway=leeway)
    if claims["node"] != node_id:
        raise TokenWrongNode(f"this lease token is for node {claims['node']!r}, not this node ({node_id!r}): "
                             "connect to the node the lease names")
    return claims


def verify_signature(token: str, public_key: str | bytes | Ed25519PublicKey, *,
                     leeway: float = DEFAULT_LEEWAY) -> dict[str, Any]:
    """The claims of ``token`` if the pool signed it and it has not expired, whichever node it
    names: for checking a token meant for another node (the target of a session move)."""
    if not isinstance(token, str) or not token or len(token) > 8192:
        raise TokenInvalid("no lease token, or not a token: ask the pool for a lease (gpuwire run --pool ...)")
    key = load_public_key(public_key)
    try:
        claims = jwt.decode(token, key, algorithms=[ALGORITHM], audience=AUDIENCE, issuer=ISSUER, leeway=leeway,
                            options={"require": list(REQUIRED_CLAIMS)})
    except jwt.ExpiredSignatureError:
        raise TokenExpired("the lease token has expired: renew the lease with the pool "
                           "(the client renews in the background while the job runs) or ask for a new one") from None
    except jwt.InvalidSignatureError:
        raise TokenInvalid("the lease token's signature does not verify: it was altered, or another pool "
                           "signed it") from None
    except jwt.PyJWTError as exc:
        raise TokenInvalid(f"invalid lease token: {exc}") from None
    _check_claims(claims)
    return claims


def _check_claims(claims: dict) -> None:
    def bad(what: str):
        raise TokenInvalid(f"invalid lease token: {what}")
    for name in ("lease", "tenant", "node"):
        if not isinstance(claims[name], str) or not claims[name]:
            bad(f"claim {name!r} must be a non-empty string")
    if type(claims["device"]) is not int or claims["device"] < 0:
        bad("claim 'device' must be a device index")
    if type(claims["memory"]) is not int or claims["memory"] < 0:
        bad("claim 'memory' must be a byte count")
    share = claims["share"]
    if type(share) not in (int, float) or not (0.0 < share <= 1.0):
        bad("claim 'share' must be in (0, 1]")
    if "addr" in claims and (not isinstance(claims["addr"], str) or not claims["addr"]):
        bad("claim 'addr' must be a non-empty string")
