"""Shared-secret authentication of tidekv's control planes: one challenge–response, both ways.

Each side sends a fresh 32-byte nonce and proves the secret with an HMAC-SHA-256 over both (the
secret never travels); the MACs name the channel label and the role, so a proof is worthless on
another channel or direction. Messages: ``Greeting`` (client nonce, tenant), ``Challenge`` (server
nonce and MAC, empty without a secret), ``Proof``. The client checks the server's MAC before it
sends anything that matters: a side with a secret refuses one without (``AuthenticationError``),
and vice versa. A tenant named in the Greeting selects that tenant's secret and the label
``L/tenant``.

The handshake classes do no I/O: ``tidekv.channel`` (and the master's own connection,
``store.master.connection``) send and receive the bytes. Neighbours: ``config`` (where the secret is
read: ``TIDEKV_SECRET`` or ``TIDEKV_SECRET_FILE``).
Design notes: docs/channels.md#tidekvauth
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

import msgspec
from tidekv.errors import AuthenticationError

AUTH_VERSION = 1
"""Version of this exchange, in every Greeting."""
NONCE_BYTES = 32
MAC_BYTES = 32


class Greeting(msgspec.Struct, tag="auth_greeting", array_like=True):
    version: int
    nonce: bytes
    tenant: str = ""  #: the tenant the client acts as (the master's ``store.master.tenants``); "" = none


class Challenge(msgspec.Struct, tag="auth_challenge", array_like=True):
    nonce: bytes
    mac: bytes  #: the server's proof; b"" when it has no secret


class Proof(msgspec.Struct, tag="auth_proof", array_like=True):
    mac: bytes


Message = Greeting | Challenge | Proof

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview, expected: type[msgspec.Struct], peer: str) -> msgspec.Struct:
    """Decodes one handshake message of the ``expected`` type.

    Raises:
        AuthenticationError: not that message (naming what arrived instead).
    """
    try:
        message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AuthenticationError(f"{peer} sent no {expected.__name__} during the handshake ({exc})", peer=peer) from None
    if not isinstance(message, expected):
        raise AuthenticationError(f"{peer} sent {type(message).__name__} where {expected.__name__} belongs", peer=peer)
    return message


def decode_any(data: bytes | memoryview) -> Message | None:
    """The handshake message ``data`` holds, or None when it is not one (a channel's own message)."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(secret: str, label: str, role: str, first: bytes, second: bytes) -> bytes:
    return hmac.digest(secret.encode(), b"tidekv/%s/%s" % (label.encode(), role.encode()) + first + second,
                       hashlib.sha256)


def _tenant_label(label: str, tenant: str) -> str:
    return f"{label}/{tenant}" if tenant else label


def _check_nonce(nonce: bytes, peer: str) -> None:
    if len(nonce) != NONCE_BYTES:
        raise AuthenticationError(f"{peer} sent a nonce of {len(nonce)} bytes, not {NONCE_BYTES}", peer=peer)


class ClientHandshake:
    """The connecting side. ``greeting()``, then ``challenged(reply)`` which checks the server
    and returns the Proof to send.

    Args:
        secret: the shared secret, or None.
        label: the channel ("master", "weights", "pd").
        peer: the server's address, for error messages.
        tenant: the tenant this client acts as ("" = none).
    """

    def __init__(self, secret: str | None, label: str, peer: str, tenant: str = "") -> None:
        self.secret = secret
        self.label = label
        self.peer = peer
        self.tenant = tenant
        self.nonce = new_nonce()

    def greeting(self) -> bytes:
        return encode(Greeting(AUTH_VERSION, self.nonce, self.tenant))

    def challenged(self, data: bytes | memoryview) -> bytes:
        """Checks the server's Challenge; returns the encoded Proof to send.

        Raises:
            AuthenticationError: the server did not prove our secret, or wants one we lack.
        """
        challenge = decode(data, Challenge, self.peer)
        assert isinstance(challenge, Challenge)
        _check_nonce(challenge.nonce, self.peer)
        what = f"{self.label} channel of {self.peer}" + (f" (as tenant {self.tenant!r})" if self.tenant else "")
        label = _tenant_label(self.label, self.tenant)
        if self.secret is None:
            if challenge.mac:
                raise AuthenticationError(f"the {what} requires a shared secret; set TIDEKV_SECRET (or "
                                          "TIDEKV_SECRET_FILE) to the one it uses", peer=self.peer)
            return encode(Proof(b""))
        if not challenge.mac:
            raise AuthenticationError(f"the {what} does not authenticate (it has no secret) while this side has "
                                      "one; set the same TIDEKV_SECRET there, or unset it here", peer=self.peer)
        expected = _mac(self.secret, label, "server", self.nonce, challenge.nonce)
        if not hmac.compare_digest(expected, challenge.mac):
            raise AuthenticationError(f"the {what} failed to prove the shared secret (another secret, or not the "
                                      "server it claims to be)", peer=self.peer)
        return encode(Proof(_mac(self.secret, label, "client", challenge.nonce, self.nonce)))


class ServerHandshake:
    """The accepting side. ``greeted(data)`` returns the Challenge to send; ``proved(data)``
    checks the client's Proof.

    Args:
        secret: the shared secret, or None (then any client passes).
        label: the channel.
        peer: the client's address, for error messages.
        tenants: the secret of each tenant a client may name (None: the shared secret); None
            when this server has no tenants (a Greeting naming one is refused).
    """

    def __init__(self, secret: str | None, label: str, peer: str,
                 tenants: Mapping[str, str | None] | None = None) -> None:
        self.secret = secret
        self.label = label
        self.peer = peer
        self.tenants = tenants
        self.tenant = ""  # the tenant the client named (after ``greeted``)
        self.nonce = new_nonce()
        self.client_nonce = b""

    def greeted(self, data: bytes | memoryview) -> bytes:
        """Raises AuthenticationError for anything but a Greeting of this version."""
        greeting = decode(data, Greeting, self.peer)
        assert isinstance(greeting, Greeting)
        if greeting.version != AUTH_VERSION:
            raise AuthenticationError(f"{self.peer} greets with authentication version {greeting.version}; this side "
                                      f"speaks {AUTH_VERSION}", peer=self.peer)
        _check_nonce(greeting.nonce, self.peer)
        if greeting.tenant:
            if self.tenants is None:
                raise AuthenticationError(f"{self.peer} names tenant {greeting.tenant!r}, but this {self.label} "
                                          "serves no tenants (no --tenants-file); unset TIDEKV_TENANT there",
                                          peer=self.peer)
            if greeting.tenant not in self.tenants:
                raise AuthenticationError(f"{self.peer} names tenant {greeting.tenant!r}, which this {self.label} "
                                          "does not know (its --tenants-file)", peer=self.peer)
            own = self.tenants[greeting.tenant]
            if own is not None:
                self.secret = own
            self.tenant = greeting.tenant
            self.label = _tenant_label(self.label, self.tenant)
        self.client_nonce = greeting.nonce
        mac = _mac(self.secret, self.label, "server", greeting.nonce, self.nonce) if self.secret else b""
        return encode(Challenge(self.nonce, mac))

    def proved(self, data: bytes | memoryview) -> None:
        """Raises AuthenticationError unless ``data`` is a Proof of our secret (any Proof passes
        when we have none)."""
        proof = decode(data, Proof, self.peer)
        assert isinstance(proof, Proof)
        if self.secret is None:
            return
        expected = _mac(self.secret, self.label, "client", self.nonce, self.client_nonce)
        if not hmac.compare_digest(expected, proof.mac):
            raise AuthenticationError(f"{self.peer} did not prove the shared secret on the {self.label} channel "
                                      "(no secret, or another one)", peer=self.peer)

