"""The master's side of mount proofs (``tidekv.store.wire.mount_proof``): before it accepts a
mount, the master asks the named engine itself, over that engine's listener and with the secret
that engine's tenant proves, whether it vouches for the proof (``check``). An engine vouches only
for a live region of its own and a proof its own process made; a process that names someone
else's engine and memory cannot make one.

The check runs off the master's event loop (``server``), so an engine that is slow to answer
delays no one else's requests. ``MasterConfig.verify_mounts`` turns it on ("auto": when the
master has a secret). Neighbours: ``service`` (asks for the check), ``connection`` (runs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidekv import _native
from tidekv.errors import AuthenticationError
from tidekv.store.wire.mount_proof import context

if TYPE_CHECKING:
    from tidekv.store.master.session import Session

CHECK_TIMEOUT_S = 5.0
"""How long the master waits for an engine to answer a check (connect, handshake, verdict)."""


def check(engine: str, secret: str | None, client_id: str, segment: str, base: int, capacity: int, proof: bytes,
          timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Asks ``engine`` ("host:port") whether it vouches for a mount's proof (names as the master
    holds them). Blocks; returns when it does.

    Raises:
        AuthenticationError: the proof is not that engine's (another process made it, or none
            was sent), or the engine refused the secret.
        SegmentNotRegisteredError: no live region of that engine covers the range.
        PeerUnavailableError, TransferTimeoutError, ProtocolVersionError: the engine could not
            be asked.
        ConfigError: the engine name or the proof is malformed.
    """
    if len(proof) != 32:
        raise AuthenticationError(f"a mount of engine {engine}'s memory must carry that engine's region proof "
                                  f"(32 bytes; got {len(proof)}): this master verifies mounts (verify_mounts)",
                                  peer=engine)
    _native.check_region_proof(engine, secret or "", context(client_id, segment), base, capacity, proof,
                               int(timeout_s * 1000))


class Unproven(Exception):
    """Raised by the master's mount handler for a mount its engine has not vouched for yet:
    ``handle`` answers the request with a ``PendingMount`` instead of a reply."""

    def __init__(self, engine: str, secret: str | None, client_id: str, segment: str, base: int, capacity: int,
                 proof: bytes) -> None:
        super().__init__(f"mount of segment {segment!r} waits for engine {engine} to vouch for it")
        self.engine, self.secret, self.client_id, self.segment = engine, secret, client_id, segment
        self.base, self.capacity, self.proof = base, capacity, proof

    @property
    def key(self) -> tuple[str, str, str, int, int, bytes]:
        """What a check vouched for: the same mount, handled again, goes through."""
        return (self.engine, self.client_id, self.segment, self.base, self.capacity, self.proof)


class PendingMount:
    """A mount request waiting for its check: the server runs ``run`` off its event loop, then
    gives the outcome to ``MasterService.checked``, which handles ``data`` again (or refuses it)."""

    __slots__ = ("data", "request_id", "session", "unproven")

    def __init__(self, data: bytes, request_id: int, session: Session | None, unproven: Unproven) -> None:
        self.data, self.request_id, self.session, self.unproven = data, request_id, session, unproven

    def run(self) -> None:
        u = self.unproven
        check(u.engine, u.secret, u.client_id, u.segment, u.base, u.capacity, u.proof)
