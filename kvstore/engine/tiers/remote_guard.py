"""What the remote tier does not take on trust: a Redis that refuses writes, and
records that nobody holding the deployment's key wrote.

Refusals. An error reply from a reachable server (``WRONGTYPE`` because a key
under our prefix holds a value we did not write, ``NOREPLICAS`` with
``min-replicas-to-write`` unmet, ``READONLY`` from a replica, ``NOPERM`` from an
ACL) is not an outage: reads may well still work, so it does not count towards
the tier's circuit breaker. Writes that keep being refused trip a breaker of
their own (``Refusals.writes``): while it is open puts are skipped before they
are encoded, after ``cooldown_ms`` one put is let through as a trial. Every
refusal is counted and logged, at most once per ``LOG_EVERY_S``.

Sealed values (``remote.auth_key_file``). A record in L3 may be followed by a
40-byte trailer: ``TRAILER_TAG`` and an HMAC-SHA256, keyed with the deployment's
key, over ``DOMAIN`` and the whole record (header and payload). The MAC covers
the payload too, not only the header that carries its checksum: xxh3 is not a
cryptographic hash, so whoever can read one authentic record could pair its
header with another payload of the same checksum. The layout is in
docs/records.md.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
from collections.abc import Sequence

from kvstore.clock import Clock, monotonic
from kvstore.config import RemoteConfig
from kvstore.errors import CorruptRecord, TierError
from kvstore.records import RecordHeader, parse_header, verify
from kvstore.retry import BreakerState, CircuitBreaker

log = logging.getLogger("kvstore.engine.tiers.remote")

LOG_EVERY_S = 30.0  # one warning per kind of trouble in this long, with a count of the rest
TRAILER_TAG = b"KVSMAC01"  # the trailer's magic; its last two digits are its version
MAC_BYTES = hashlib.sha256().digest_size
TRAILER_BYTES = len(TRAILER_TAG) + MAC_BYTES
DOMAIN = b"kvstore-remote-record-v1\x00"  # so the key's MACs mean nothing anywhere else

# What an operator should look at, by the first word of the server's error reply.
_HINTS = {
    "WRONGTYPE": "a key under this prefix holds a value kvstore did not write: "
    "another application using the same prefix?",
    "NOREPLICAS": "the server's min-replicas-to-write is not met",
    "READONLY": "the URL names a read-only replica",
    "NOPERM": "the ACL user may not run this command or touch this key",
    "OOM": "maxmemory reached with a noeviction policy",
}
_REPLY = re.compile(r"\b(" + "|".join(_HINTS) + r")\b")
# The client libraries turn some replies into classes and drop the reply's first word.
_BY_CLASS = {"ReadOnlyError": "READONLY", "NoPermissionError": "NOPERM", "OutOfMemoryError": "OOM"}


class Refused(TierError):
    """The remote answered, and refused the command (an error reply, not an outage)."""


class ForgedRecord(CorruptRecord):
    """A self-consistent record without a valid MAC, read by a tier that has the key."""


class RateLimitedLog:
    """Warnings of one kind at most once per ``every_s`` (on the injected clock)."""

    def __init__(self, every_s: float = LOG_EVERY_S, *, clock: Clock = monotonic) -> None:
        self._every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``kind`` was logged less than ``every_s`` ago."""
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._every_s:
                self._quiet[kind] = self._quiet.get(kind, 0) + 1
                return False
            self._last[kind] = now
            quiet = self._quiet.pop(kind, 0)
        if quiet:
            msg += " (%d more like it since the last message)"
            args = (*args, quiet)
        log.warning(msg, *args)
        return True


class Refusals:
    """Counts and logs error replies; holds writes back while they keep being refused."""

    def __init__(self, config: RemoteConfig, name: str, *, clock: Clock = monotonic) -> None:
        self.writes = CircuitBreaker.from_config(config, clock=clock)
        self._name = name
        self._log = RateLimitedLog(clock=clock)
        self._lock = threading.Lock()
        self.count = 0  # error replies, reads and writes
        self.writes_refused = 0  # puts that failed on one
        self.writes_skipped = 0  # puts not tried while the write breaker was open
        self.last: str | None = None

    def saw(self, op: str, error: BaseException) -> None:
        """An error reply to ``op`` (any command): count it, log it (rate-limited)."""
        text = f"{type(error).__name__}: {error}"
        found = _REPLY.search(str(error))  # pipelines put "Command # n (...)" before it
        word = _BY_CLASS.get(type(error).__name__) or (found.group(1) if found else "other")
        hint = _HINTS.get(word, "the server answered with an error")
        with self._lock:
            self.count += 1
            self.last = f"{op}: {text}"
        self._log.warn(f"refused:{word}", "%s refused %s: %s (%s)", self._name, op, text, hint)

    def write_allowed(self) -> bool:
        """Whether a put may go out now (False while refused writes hold the breaker open)."""
        if self.writes.allow():
            return True
        with self._lock:
            self.writes_skipped += 1
        return False

    def write_refused(self, error: BaseException) -> None:
        with self._lock:
            self.writes_refused += 1
        self.writes.record_failure(error.__cause__ or error)

    def write_accepted(self) -> None:
        self.writes.record_success()

    @property
    def degraded(self) -> bool:
        """True since a write was refused, until a write is accepted again."""
        return self.writes.state is not BreakerState.CLOSED or self.writes.consecutive_failures > 0

    def detail(self) -> dict[str, object]:
        with self._lock:
            return {
                "degraded": self.degraded,
                "refused": self.count,
                "last_refusal": self.last,
                "writes": self.writes.state.value,
                "writes_refused": self.writes_refused,
                "writes_skipped": self.writes_skipped,
                "writes_retry_in_s": round(self.writes.retry_in_s(), 3),
            }


class RecordSeal:
    """HMAC-SHA256 trailers for records in L3, with the key of ``remote.auth_key_file``."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def __repr__(self) -> str:  # the key never leaves this object
        return "RecordSeal(<key hidden>)"

    def trailer(self, parts: Sequence[bytes | memoryview]) -> bytes:
        """The trailer of the record made of ``parts`` (header, payload) in order."""
        mac = hmac.new(self._key, DOMAIN, hashlib.sha256)
        for part in parts:
            mac.update(part)
        return TRAILER_TAG + mac.digest()

    def check(self, record: memoryview, trailer: memoryview | None) -> bool:
        return self.check_parts((record,), trailer)

    def check_parts(
        self, parts: Sequence[bytes | memoryview], mac: bytes | memoryview | None
    ) -> bool:
        """Whether ``mac`` (a trailer without its tag) is the MAC of the record made of
        ``parts`` in order (a record read in pieces: header, then payload)."""
        if mac is None:
            return False
        return hmac.compare_digest(self.trailer(parts)[len(TRAILER_TAG) :], mac)


def open_value(
    value: bytes | memoryview, key: bytes, seal: RecordSeal | None
) -> tuple[RecordHeader, memoryview]:
    """The verified record in a value read from L3: (header, the record without its trailer).

    Raises CorruptRecord when the record does not verify, ForgedRecord when ``seal``
    is given and the value carries no valid MAC. Without a seal a trailer is
    ignored: a server without the key serves what servers with the key wrote.
    """
    view = memoryview(value)
    size = parse_header(view, expect_key=key).record_size
    trailer: memoryview | None = None
    if len(view) == size + TRAILER_BYTES and view[size : size + len(TRAILER_TAG)] == TRAILER_TAG:
        trailer = view[size + len(TRAILER_TAG) :]
    elif len(view) != size:
        raise CorruptRecord(f"remote value is {len(view)} bytes, its record {size}")
    record = view[:size]
    header = verify(record, expect_key=key)
    if seal is not None and not seal.check(record, trailer):
        raise ForgedRecord("no valid MAC" if trailer is not None else "record carries no MAC")
    return header, record
