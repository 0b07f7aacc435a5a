"""More segments from one store client (``SegmentCalls``, a base class of ``Store``): memory
contributed to the pool after ``connect``, new engine memory or memory of the caller's (an mmap
of a file on /dev/shm, a DAX device), each its own segment at the master, heartbeated and
re-mounted with the first; ``unmount_segment`` takes one out again (its objects leave the pool,
as with any segment that goes, unless they have replicas elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidekv.errors import ConfigError

if TYPE_CHECKING:
    from tidekv.store.client.store import Store


class SegmentCalls:
    """The segment methods of ``Store`` (mixed in)."""

    def mount_segment(self: Store, size: int | None = None, *, memory: Any = None) -> str:
        """Contributes ``size`` bytes of new engine memory, or ``memory`` (a writable buffer or an
        ``(address, length)`` pair of this process's, registered here), as one more segment;
        returns its name (what ``preferred_segment`` and ``copy_to`` take).

        Raises:
            ConfigError: both or neither of ``size`` and ``memory``; a pool sharded over master
                groups (a segment belongs to one group; give each group's share at ``connect``).
        """
        if (size is None) == (memory is None):
            raise ConfigError("mount_segment takes a size or memory, one of the two")
        if len(self._groups) != 1:
            raise ConfigError(f"mount_segment on a pool of {len(self._groups)} master groups: not supported; "
                              "size the segment at Store.connect (it is carved between the groups)")
        region = self.engine.allocate(size) if memory is None else self.engine.register(memory)
        try:
            return self._groups[0].member.mount_extra(region)
        except BaseException:
            self.engine.unregister(region)
            raise

    def unmount_segment(self: Store, name: str) -> None:
        """Takes a segment ``mount_segment`` mounted out of the pool and unregisters its memory.

        Raises:
            ConfigError: not a segment this client mounted with ``mount_segment``.
        """
        self._groups[0].member.unmount_extra(name)

    @property
    def extra_segments(self: Store) -> list[str]:
        """The names of the segments ``mount_segment`` mounted and that are still mounted."""
        return list(self._groups[0].member.extra)

    def unmount_disks(self: Store, grace_s: float = 0.0) -> None:
        """Takes this holder's disk tier (``disk_paths``) out of the pool: the master drops its
        disks and every object only they held, reads already handed out are served for ``grace_s``
        more, then the tier's files are removed. Memory stays as it is.

        Raises:
            ConfigError: this store has no disk tier (or unmounted it already).
        """
        if self._disk is None or self._disk.closed:
            raise ConfigError("this store has no disk tier to unmount (disk_paths is not set, or it was unmounted)")
        self._reader.tier = None
        self._disk.unmount(grace_s)

    @property
    def disk_reads_served(self: Store) -> int:
        """Reads of this holder's disk records it served to other clients (its disk server)."""
        return self._disk.server.served if self._disk is not None else 0
