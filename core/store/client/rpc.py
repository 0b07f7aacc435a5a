"""MasterChannel: a client's request/reply channel to the master (``tidekv.channel``).

Thread-safe (one call at a time). The connection is made on first use and again after any
failure (a new connection needs a new hello: ``master_client`` sends it), and authenticated both
ways. Errors come back typed, mapped in ``protocol.SPEC``: MasterUnavailableError when the master
cannot be reached or does not answer in time (saying whether the request may have reached it),
MasterNotReadyError when it answered that it does not serve (recovering, or not the leader),
ProtocolVersionError on version skew, ConfigError for a refused argument, AuthenticationError when
either side failed the handshake. What this adds to the channel: batches split to the master's
limits. Following a leader and retrying are ``master_client``'s business, not this channel's.
"""

from __future__ import annotations

import ssl
from typing import Any

import msgspec
from tidekv.channel import Client
from tidekv.config import DEFAULT_MAX_BATCH_KEYS
from tidekv.store.wire import protocol as p


class MasterChannel(Client):
    def __init__(self, address: str, client_id: str, timeout_s: float, busy_poll_us: int = 0,
                 secret: str | None = None, tls: ssl.SSLContext | None = None, tenant: str = "") -> None:
        super().__init__(address, p.SPEC, timeout_s, secret=secret, tls=tls, tenant=tenant,
                         busy_poll_us=busy_poll_us, reconnect_idle=False)
        self.client_id = client_id
        # Learned from the master's hello reply (``max_message_bytes`` too); before (or without)
        # a hello, the master's default: a client that never says hello (lookups) still splits.
        self.max_batch_keys: int | None = DEFAULT_MAX_BATCH_KEYS

    @property
    def master_on_this_host(self) -> bool | None:
        """Whether the master shares this process's network; None until connected."""
        return self.server_on_this_host

    def call(self, body: msgspec.Struct, timeout_s: float | None = None) -> Any:
        """Sends one request and returns its result; one naming more keys than the master takes
        goes in parts, each within its limit, and the results come back merged.

        Raises:
            MasterUnavailableError: the master cannot be reached or gives no reply within the timeout.
            ProtocolVersionError: the master speaks another protocol version.
            ConfigError: the master refused an argument.
            RpcError: the master found the request malformed.
        """
        keys = getattr(body, "keys", None)
        if self.max_batch_keys is not None and keys is not None and len(keys) > self.max_batch_keys:
            parts = p.split_request(body, self.max_batch_keys)
            return p.merge_results(body, [super(MasterChannel, self).call(part, timeout_s) for part in parts])
        return super().call(body, timeout_s)
