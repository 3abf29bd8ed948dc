"""Tenants: bearer tokens that name a tenant, and the namespaces each tenant owns.

With ``tenant_tokens`` (a file of ``tenant:token`` lines) every call must carry
one of those tokens, or the admin ``token``, which sees everything. A tenant
sees only namespaces it has *proved* are its own: a Lookup that carries the
full ``Namespace`` whose ``salt`` is the tenant's name (or starts with
``<tenant>|``, as the vLLM connector adds per-request cache salts). The
fingerprint is a keyed hash of every namespace field, salt included, so no
tenant can present a namespace of its own that hashes to another tenant's
fingerprint; knowing another tenant's fingerprint or chunk keys is not enough.

Once proved, the fingerprint is the tenant's (in memory: after a restart the
first Lookup of each namespace proves it again, and the connector looks up
before every load and save). Each tenant keeps at most
``max_namespaces_per_tenant`` (a server setting) proved namespaces: past that its least recently
proved one is forgotten (counted, logged), so a put into it is refused with
``NamespaceNotRegistered`` until a Lookup proves it again (``put_chunk`` does
that by itself); no tenant can fill another tenant's table. Every call is then
scoped:

- Put and Reserve need the record's fingerprint to be the caller's; a chunk
  key binds its fingerprint (key = hash(parent, fingerprint, tokens)), so a
  tenant cannot write under another's keys either;
- Get, Acquire, Exists, Delete and Pin treat another tenant's chunk as a miss;
- List and Namespaces show only the caller's namespaces; Stats counts only its
  chunks and namespaces (the per-tier figures stay server-wide); Clear needs a
  namespace of the caller's, never ``all``;
- leases and reservations belong to ``<tenant>/<session>``, so a session id
  guessed or copied from another tenant names nothing;
- the shared-memory data plane is not offered to tenants: a process that can
  map the arena can read every record in it, so tenants stream over gRPC.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from kvstore.errors import ConfigError, NamespaceNotRegistered, PermissionDenied
from kvstore.keys import Fingerprint, Namespace
from kvstore.protocol import AUTH_HEADER

log = logging.getLogger("kvstore.server")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# Proved namespaces remembered per tenant: one tenant that proves a flood of them
# forgets its own oldest, never another tenant's (the table is bounded by tenants x this).
MAX_NAMESPACES_PER_TENANT = 10_000


class Denied(PermissionDenied):
    """The caller's tenant may not do this (PERMISSION_DENIED)."""


def read_tenant_tokens(path: str, admin_token: str = "") -> dict[str, str]:
    """token -> tenant from a file of ``tenant:token`` lines (# comments, blank lines)."""
    try:
        with open(os.path.expanduser(path)) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"tenant_tokens={path!r}: cannot read it: {e}") from e
    out: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, token = line.partition(":")
        tenant, token = tenant.strip(), token.strip()
        where = f"tenant_tokens={path!r} line {n}"
        if not sep or not token:
            raise ConfigError(f"{where}: expected tenant:token")
        if not _NAME.fullmatch(tenant):
            raise ConfigError(f"{where}: tenant {tenant!r} must be 1-64 of [A-Za-z0-9_.-]")
        if token in out or (admin_token and hmac.compare_digest(token, admin_token)):
            raise ConfigError(
                f"{where}: the token of {tenant!r} is already used by "
                f"{out.get(token, 'the admin token')!r}; tokens must be unique"
            )
        out[token] = tenant
    if not out:
        raise ConfigError(f"tenant_tokens={path!r} names no tenant")
    return out


def salt_of_tenant(salt: str, tenant: str) -> bool:
    return salt == tenant or salt.startswith(f"{tenant}|")


class Tenants:
    """Which tenant a call is from, and which namespaces each tenant has proved its own."""

    def __init__(
        self,
        tokens: Mapping[str, str] | None = None,
        *,
        max_per_tenant: int = MAX_NAMESPACES_PER_TENANT,
    ) -> None:
        self.max_per_tenant = max_per_tenant
        self._by_token = {f"Bearer {t}": name for t, name in (tokens or {}).items()}
        self._lock = threading.Lock()
        self._owner: dict[Fingerprint, str] = {}
        self._proved: dict[str, OrderedDict[Fingerprint, None]] = {}  # tenant -> LRU first
        self.forgotten = 0  # proved namespaces dropped to keep a tenant under its bound

    def __bool__(self) -> bool:
        return bool(self._by_token)

    def of(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The calling tenant; None for the admin token or when there are no tenants.

        The auth interceptor has already refused calls without a valid token.
        """
        if not self._by_token:
            return None
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                given = value.decode() if isinstance(value, bytes) else value
                return self._by_token.get(given)
        return None

    def prove(self, tenant: str | None, ns: Namespace | None) -> None:
        """A tenant's Lookup: it must carry the full namespace, salted with the tenant's name."""
        if tenant is None:
            return
        if ns is None or not salt_of_tenant(ns.salt, tenant):
            raise Denied(
                f"tenant {tenant!r} must send the full Namespace with its lookups, with "
                f"salt={tenant!r} (or '{tenant}|...'); got "
                f"{'none' if ns is None else f'salt={ns.salt!r}'}"
            )
        fp = ns.fingerprint
        with self._lock:
            owner = self._owner.get(fp)
            if owner is None:
                self._owner[fp] = tenant
                mine = self._proved.setdefault(tenant, OrderedDict())
                mine[fp] = None
                if len(mine) > self.max_per_tenant:
                    old, _ = mine.popitem(last=False)
                    del self._owner[old]
                    self.forgotten += 1
                    if self.forgotten & (self.forgotten - 1) == 0:  # 1, 2, 4, ...: rate-limited
                        log.warning(
                            "tenant %r proved more than %d namespaces: its oldest are "
                            "forgotten (%d so far) until a lookup proves them again",
                            tenant,
                            self.max_per_tenant,
                            self.forgotten,
                        )
            elif owner == tenant:
                self._proved[tenant].move_to_end(fp)
            else:  # two salts hashing alike: never in practice
                raise Denied(f"namespace {fp.hex()} belongs to another tenant")

    def owns(self, tenant: str | None, fp: bytes) -> bool:
        if tenant is None:
            return True
        with self._lock:
            return self._owner.get(Fingerprint(fp)) == tenant

    def require(self, tenant: str | None, fp: bytes) -> None:
        if not self.owns(tenant, fp):
            raise NamespaceNotRegistered(
                f"namespace {bytes(fp).hex()} is not a namespace of tenant {tenant!r} "
                "(not registered): look a prompt up with the full Namespace "
                f"(salt={tenant!r}) first"
            )

    def owned(self, tenant: str) -> set[Fingerprint]:
        with self._lock:
            return set(self._proved.get(tenant, ()))
