"""The one exception hierarchy of kvstore.

Expected outcomes (a miss, a full tier, a pending write) are return values, never
exceptions. What is raised here means a broken invariant, a bad argument or a
backend that failed; every backend error is re-raised as one of these with
``raise ... from`` so callers catch one root and still see the cause.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Root of every error kvstore raises on purpose."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid; the message says what is allowed."""


class InvalidArgument(KVStoreError, ValueError):
    """A call got a value it cannot accept (wrong dtype, shape, size, token count)."""


class CorruptRecord(KVStoreError):
    """A stored record failed verification (magic, version, header or payload checksum).

    Tiers turn this into a counted miss; it only escapes from the low-level
    record decoder so the caller can decide what to count.
    """


class TierError(KVStoreError):
    """A tier's backend failed (I/O error, LMDB error, lost connection)."""


class TierUnavailable(TierError):
    """A remote tier is down or its circuit breaker is open; callers skip it."""


class StoreClosed(KVStoreError):
    """The store (or tier) was used after close()."""


class DeadlineExceeded(TierError):
    """A call did not finish within its deadline."""


# -- errors of the client SDK (kvstore.Client): gRPC statuses mapped to this hierarchy --


class ServerUnavailable(KVStoreError):
    """The server cannot be reached, is shutting down, or a tier it needed is down."""


class Unauthenticated(KVStoreError):
    """The server refused the call: missing or wrong token (UNAUTHENTICATED, PERMISSION_DENIED)."""


class NotFound(KVStoreError, LookupError):
    """The server does not know a lease or reservation the call named (NOT_FOUND)."""


class ResourceExhausted(KVStoreError):
    """A request went over a server limit (message size, max_chunk_bytes, concurrent RPCs)."""


class ServerError(KVStoreError):
    """The server failed while handling the call (INTERNAL, UNKNOWN and other statuses)."""
