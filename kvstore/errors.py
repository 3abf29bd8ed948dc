"""The one exception hierarchy of kvstore.

Expected outcomes (a miss, a full tier, a pending write) are return values, never
exceptions. What is raised here means a broken invariant, a bad argument or a
backend that failed; every backend error is re-raised as one of these with
``raise ... from`` so callers catch one root and still see the cause.

Every class carries the gRPC status a server answers with when it escapes a call
(``code``, a ``grpc.StatusCode`` name: this module stays free of grpc), and where
the code alone does not say which class it was, a ``reason`` sent beside it in the
call's trailing metadata. ``client_class`` is the one table back: the class a client
raises for a status. ``kvstore.protocol`` (what a server sends) and ``kvstore.sdk.wire``
(what a client reads back) do the gRPC half.
"""

from __future__ import annotations

from typing import ClassVar, Literal

# The names of grpc.StatusCode, OK excepted (tests/test_errors.py checks them against grpc).
Code = Literal[
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
]


class KVStoreError(Exception):
    """Root of every error kvstore raises on purpose."""

    # The status a server answers with when this escapes a call. A subclass without
    # its own reads as a server fault, which is what an unclassified error is.
    code: ClassVar[Code] = "INTERNAL"
    # Sent beside the code (trailing metadata) when the client must tell this class
    # from the others with the same code and act on it; "" sends nothing.
    reason: ClassVar[str] = ""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid; the message says what is allowed."""

    # Raised while serving a call, it is the server's own configuration at fault.
    code: ClassVar[Code] = "INTERNAL"


class InvalidArgument(KVStoreError, ValueError):
    """A call got a value it cannot accept (wrong dtype, shape, size, token count)."""

    code: ClassVar[Code] = "INVALID_ARGUMENT"


class CorruptRecord(KVStoreError):
    """A stored record failed verification (magic, version, header or payload checksum).

    Tiers turn this into a counted miss; it only escapes from the low-level
    record decoder so the caller can decide what to count.
    """

    code: ClassVar[Code] = "DATA_LOSS"


class TierError(KVStoreError):
    """A tier's backend failed (I/O error, LMDB error, lost connection)."""

    code: ClassVar[Code] = "INTERNAL"


class TierUnavailable(TierError):
    """A remote tier is down or its circuit breaker is open; callers skip it."""

    code: ClassVar[Code] = "UNAVAILABLE"


class StoreClosed(KVStoreError):
    """The store (or tier) was used after close()."""

    code: ClassVar[Code] = "UNAVAILABLE"


class DeadlineExceeded(KVStoreError):
    """A call to the server did not finish within its deadline (DEADLINE_EXCEEDED).

    Not a ``TierError``: a tier that misses its deadline raises ``TierUnavailable``
    (the remote is treated as down); this is the client's view of a slow server.
    """

    code: ClassVar[Code] = "DEADLINE_EXCEEDED"


# -- errors of the client SDK (kvstore.Client): gRPC statuses mapped to this hierarchy --


class ServerUnavailable(KVStoreError):
    """The server cannot be reached, is shutting down, or a tier it needed is down."""

    code: ClassVar[Code] = "UNAVAILABLE"


class Unauthenticated(KVStoreError):
    """The server refused the call: missing or wrong token (UNAUTHENTICATED)."""

    code: ClassVar[Code] = "UNAUTHENTICATED"


class PermissionDenied(KVStoreError):
    """The token is valid but its tenant may not do this (PERMISSION_DENIED).

    Not an ``Unauthenticated``: a better token will not help, the call is refused
    whoever asks it under this tenant (the CLI says so apart)."""

    code: ClassVar[Code] = "PERMISSION_DENIED"


class NamespaceNotRegistered(PermissionDenied):
    """A tenant named a namespace the server does not know as the tenant's (yet).

    A Lookup that carries the full ``Namespace`` proves it (docs/security.md);
    ``Client.put_chunk`` does that and retries when it holds the ``Namespace``.
    """

    code: ClassVar[Code] = "PERMISSION_DENIED"
    reason = "NAMESPACE_NOT_REGISTERED"


class NotFound(KVStoreError, LookupError):
    """The server does not know a lease or reservation the call named (NOT_FOUND)."""

    code: ClassVar[Code] = "NOT_FOUND"


class ResourceExhausted(KVStoreError):
    """A request went over a server limit (message size, max_chunk_bytes, concurrent RPCs)."""

    code: ClassVar[Code] = "RESOURCE_EXHAUSTED"


class ChunkTooLarge(InvalidArgument):
    """A record larger than ``max_chunk_bytes``: a bad argument to a put, sent as the
    server limit it is (RESOURCE_EXHAUSTED; clients read it back as ResourceExhausted)."""

    code: ClassVar[Code] = "RESOURCE_EXHAUSTED"


class ServerError(KVStoreError):
    """The server failed while handling the call (INTERNAL, UNKNOWN and other statuses)."""

    code: ClassVar[Code] = "INTERNAL"


# -- statuses back to classes (the client's side) -----------------------------------------

# What a client raises for each code: the classes a client sees, each under its own
# code, plus two codes no kvstore error is sent with; any other code is a ServerError.
_CLIENT_CLASSES: tuple[type[KVStoreError], ...] = (
    InvalidArgument,
    NotFound,
    CorruptRecord,
    DeadlineExceeded,
    ServerUnavailable,
    Unauthenticated,
    PermissionDenied,
    ResourceExhausted,
    ServerError,
)
_BY_CODE: dict[str, type[KVStoreError]] = {
    **{cls.code: cls for cls in _CLIENT_CLASSES},
    "OUT_OF_RANGE": InvalidArgument,
    "CANCELLED": ServerUnavailable,  # the call or the server went away mid-call
}
_BY_REASON: dict[str, type[KVStoreError]] = {NamespaceNotRegistered.reason: NamespaceNotRegistered}


def client_class(code: str, reason: str = "") -> type[KVStoreError]:
    """The class a client raises for status ``code`` (a grpc.StatusCode name) and ``reason``.

    A reason names its class only together with that class's code, so a reason a
    newer or older server sends with another code cannot change what the code means.
    """
    by_reason = _BY_REASON.get(reason)
    if by_reason is not None and by_reason.code == code:
        return by_reason
    return _BY_CODE.get(code, ServerError)
