"""Errors raised by communicators.

Every error names the collective by its `tag` (e.g. "layer 3 dispatch") and, where the
backend can tell, the peer rank at fault, so a failed step points at a layer and a rank.
The recovery path is the same for all of them: `abort()` the communicator, then build a
new one (new rendezvous: new port or new NCCL unique id).
"""

from __future__ import annotations

import functools

RECOVERY_HINT = "Rebuild the communicator (abort(), then create a new one)"


class CommError(RuntimeError):
    """Base class of every communicator error."""


class CommClosedError(CommError):
    """A collective was called on a communicator after `close()` or `abort()`."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        super().__init__(f"collective {tag!r} called on a closed communicator")

    def __reduce__(self):
        return (type(self), (self.tag,))


class CollectiveTimeout(CommError):
    """A collective did not complete before its deadline.

    `peer` is the rank this rank was still waiting for, or None when the backend
    cannot tell (NCCL completes a whole group at once).
    """

    def __init__(self, *, tag: str, timeout_s: float, peer: int | None, world_size: int) -> None:
        self.tag = tag
        self.timeout_s = timeout_s
        self.peer = peer
        self.world_size = world_size
        if peer is None:
            waiting_for = f"an unknown peer (of {world_size}; the backend cannot tell which)"
        else:
            waiting_for = f"rank {peer} (of {world_size})"
        super().__init__(
            f"collective {tag!r} timed out after {timeout_s:.1f} s waiting for {waiting_for}; "
            f"the peer may be dead or stuck. {RECOVERY_HINT}"
        )

    def __reduce__(self):
        # Keyword-only constructor: pickle (e.g. through Ray) by keywords.
        keywords = dict(
            tag=self.tag,
            timeout_s=self.timeout_s,
            peer=self.peer,
            world_size=self.world_size,
        )
        return (functools.partial(type(self), **keywords), ())


class PeerLostError(CommError):
    """The connection to a peer broke during a collective (the peer process most likely died)."""

    def __init__(self, *, tag: str, peer: int, world_size: int, detail: str) -> None:
        self.tag = tag
        self.peer = peer
        self.world_size = world_size
        self.detail = detail
        super().__init__(
            f"collective {tag!r} lost rank {peer} (of {world_size}): {detail}. {RECOVERY_HINT}"
        )

    def __reduce__(self):
        # Keyword-only constructor: pickle (e.g. through Ray) by keywords.
        keywords = dict(
            tag=self.tag,
            peer=self.peer,
            world_size=self.world_size,
            detail=self.detail,
        )
        return (functools.partial(type(self), **keywords), ())


class CollectiveMismatch(CommError):
    """A peer entered a different collective than this rank (its tag differs).

    All ranks must call collectives in the same order with the same tag; a mismatch
    means the ranks' programs diverged, and the data they would exchange is meaningless.
    """

    def __init__(self, *, tag: str, peer: int, world_size: int) -> None:
        self.tag = tag
        self.peer = peer
        self.world_size = world_size
        super().__init__(
            f"collective {tag!r}: rank {peer} (of {world_size}) is in a different collective "
            f"(its tag checksum differs); all ranks must call collectives in the same order "
            f"with the same tag. {RECOVERY_HINT}"
        )

    def __reduce__(self):
        # Keyword-only constructor: pickle (e.g. through Ray) by keywords.
        keywords = dict(
            tag=self.tag,
            peer=self.peer,
            world_size=self.world_size,
        )
        return (functools.partial(type(self), **keywords), ())

