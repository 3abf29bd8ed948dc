"""The KVStore gRPC servicer: the wire contract (proto/) over a TieredStore.

Every method runs under ``calls.rpc``: it counts and times the call, refuses new
calls while the server shuts down, and turns any exception into a gRPC status with a
message saying what was wrong (``kvstore.protocol.status_of``); an unexpected
exception is logged with its traceback and returned as INTERNAL. No request can
take the server down.

The shared-memory data plane (leases and reservations, which belong to an owner:
the ``x-kvstore-session`` metadata of the call, tracked in ``holds``) is
``plane.SharedMemoryPlane``; the Put/Get streams live in ``streams``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import grpc
import numpy as np

from kvstore.engine.store import TieredStore
from kvstore.errors import (
    CorruptRecord,
    InvalidArgument,
)
from kvstore.keys import (
    FINGERPRINT_BYTES,
    KEY_BYTES,
    ChunkKey,
    Fingerprint,
    Namespace,
)
from kvstore.protocol import (
    SESSION_HEADER,
    chunk_to_pb,
    error_trailers,
    lookup_to_pb,
    namespace_from_pb,
    namespace_to_pb,
    stats_to_pb,
    status_of,
    status_to_pb,
    unframe,
)
from kvstore.records import RecordHeader, check_put, parse_header
from kvstore.types import ChunkView, LookupResult, NamespaceMatch, PutStatus, TierLevel
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

from .calls import FINISHING, Status, rpc
from .config import ServerConfig
from .holds import Holds
from .info import make_info
from .metrics import Metrics
from .names import NameBook
from .plane import SharedMemoryPlane
from .streams import Watchdog, pieces, receive_put, send_get, touching
from .tenants import Denied, Tenants

log = logging.getLogger("kvstore.server")


@functools.lru_cache(maxsize=256)
def _described(raw: bytes) -> Namespace:
    """A namespace a lookup describes, by its wire bytes: an engine sends the same one
    with every lookup, and parsing it and hashing its fingerprint each time cost ~0.05 ms
    of a 0.4 ms Lookup. Namespaces are immutable; a bad one raises and is not kept."""
    return namespace_from_pb(pb.Namespace.FromString(raw))


class KVStoreService(SharedMemoryPlane, pb_grpc.KVStoreServicer):
    def __init__(
        self,
        store: TieredStore,
        config: ServerConfig,
        *,
        metrics: Metrics | None = None,
        auth_required: bool = False,
        tenants: Tenants | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._closing = False
        self._active = 0  # calls in flight, Session streams excepted
        self._lease_s = store.config.memory.lease_ms / 1000.0
        self.holds = Holds(store)
        # Streams idle for a whole lease, or too slow for their size, are cancelled.
        self.watchdog = Watchdog(
            self._lease_s,
            min_rate=config.stream_min_bytes_per_s,
            limits={
                "data": (config.max_data_streams, "max_concurrent_rpcs less a reserve"),
                "session": (config.max_sessions, f"max_sessions={config.max_sessions}"),
            },
            tenant_share=config.tenant_stream_share,
        )
        self.names = NameBook()  # namespaces clients described, bounded by bytes
        self.counts: Counter[tuple[str, str]] = Counter()  # (method, code) -> calls
        self.tenants = tenants or Tenants()
        self._info, self._tenant_info = make_info(store, config, auth_required)

    def offer_express(self, path: str) -> None:
        """Tell clients (Info) where the express plane listens (``server.express``)."""
        for info in (self._info, self._tenant_info):
            info.express_socket = path

    # -- bookkeeping of calls ----------------------------------------------------------------------
    def _enter(self, name: str) -> bool:
        with self._lock:
            if self._closing and name not in FINISHING:
                return False
            if name != "Session":
                self._active += 1
            return True

    def _leave(self, name: str, code: grpc.StatusCode, t0: float, entered: bool) -> None:
        seconds = time.perf_counter() - t0
        with self._lock:
            if entered and name != "Session":
                self._active -= 1
                if self._active == 0:
                    self._idle.notify_all()
            self.counts[(name, code.name)] += 1
        if self.metrics is not None:
            self.metrics.observe(name, code.name, seconds)
        log.debug("rpc %s %s %.3f ms", name, code.name, seconds * 1000)

    def _failed(
        self, name: str, e: Exception, context: grpc.ServicerContext
    ) -> tuple[grpc.StatusCode, str]:
        if isinstance(e, Status):
            return e.code, str(e)
        if isinstance(e, Denied):
            return grpc.StatusCode.PERMISSION_DENIED, f"{name}: {e}"
        if isinstance(e, grpc.RpcError) or not context.is_active():
            return grpc.StatusCode.CANCELLED, f"{name}: the call ended before it completed"
        code, msg = status_of(e)
        if trailers := error_trailers(e):  # e.g. NamespaceNotRegistered: put_chunk retries
            context.set_trailing_metadata(trailers)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", name, exc_info=e)
        else:
            log.debug("%s: %s: %s", name, code.name, msg)
        return code, f"{name}: {msg}"

    def shutdown(self, grace_s: float) -> bool:
        """Refuse new calls and wait for in-flight ones (Sessions excepted); True if drained."""
        deadline = time.monotonic() + grace_s
        with self._lock:
            self._closing = True
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def sweep(self) -> int:
        """Cancel idle and too slow streams (called periodically, beside the store's own
        ``upkeep``, which reclaims expired holds); how many streams were cancelled."""
        return self.watchdog.sweep()

    def request_counts(self) -> dict[str, int]:
        with self._lock:
            out: Counter[str] = Counter()
            for (method, code), n in self.counts.items():
                out[method if code == "OK" else f"{method}:{code}"] += n
            return dict(out)

    # -- argument parsing --------------------------------------------------------------------------
    def _tenant(self, context: grpc.ServicerContext) -> str | None:
        """The calling tenant (None: the admin token, or no tenants configured)."""
        return self.tenants.of(context.invocation_metadata()) if self.tenants else None

    def _owner(self, context: grpc.ServicerContext, named: str = "") -> str:
        """Who holds leases: ``<tenant>/<session id>`` (``/<session id>`` without tenants).

        Every owner a client can name has a "/", so none is ``SERVER_OWNER``, the owner
        of the server's own stream holds; a session id guessed or copied from another
        tenant names nothing. A call without a session id is anonymous (""): its holds
        are reached only by their ids, which are random (``MemoryTier``).
        """
        owner = named[:128]
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_HEADER and not owner:
                owner = str(value)[:128]
        return f"{self._tenant(context) or ''}/{owner}" if owner else ""

    def _visible(self, tenant: str | None, key: ChunkKey) -> bool:
        """Whether the caller may see this chunk (it is in the index, in a namespace of its)."""
        if tenant is None:
            return True
        fp = self.store.fingerprint_of(key)
        return fp is not None and self.tenants.owns(tenant, fp)

    @staticmethod
    def _key(raw: bytes, what: str = "key") -> ChunkKey:
        if len(raw) != KEY_BYTES:
            raise InvalidArgument(f"{what} is {len(raw)} bytes; chunk keys are {KEY_BYTES}")
        return ChunkKey(raw)

    def _keys(self, raws: Any) -> list[ChunkKey]:
        return [self._key(k, f"key #{i}") for i, k in enumerate(raws)]

    @staticmethod
    def _fingerprint(raw: bytes) -> Fingerprint:
        if len(raw) != FINGERPRINT_BYTES:
            raise InvalidArgument(
                f"fingerprint is {len(raw)} bytes; namespace fingerprints are {FINGERPRINT_BYTES}"
            )
        return Fingerprint(raw)

    def _header(self, raw: bytes) -> RecordHeader:
        """A verified, self-consistent RAW record header from a client."""
        try:
            header = parse_header(raw)
        except CorruptRecord as e:
            raise InvalidArgument(f"malformed record header: {e}") from e
        if len(raw) != header.header_size:
            raise InvalidArgument(
                f"malformed record header: {len(raw)} bytes, its fields say {header.header_size}"
            )
        # Before any payload is read or staged (the store checks again, with the key).
        check_put(header, max_chunk_bytes=self.store.config.max_chunk_bytes)
        return header

    def _shm_refusal(self, context: grpc.ServicerContext) -> str | None:
        """Why the shared-memory plane is not offered to this caller; None: it is."""
        if not self.config.shm:
            return "the shared-memory data plane is disabled on this server (shm=false)"
        if self._tenant(context) is not None:
            return (
                "the shared-memory data plane is not offered to tenants (whoever maps "
                "the arena can read every record): use Put and Get"
            )
        return None

    def _shm_enabled(self, context: grpc.ServicerContext) -> None:
        why = self._shm_refusal(context)
        if why is not None:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION, why)

    def _moved(self, direction: str, plane: str, nbytes: int) -> None:
        if self.metrics is not None:
            self.metrics.moved(direction, plane, nbytes)

    # -- info and lookup ---------------------------------------------------------------------------
    @rpc
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return self._info if self._tenant(context) is None else self._tenant_info

    @rpc
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        fp = self._fingerprint(request.fingerprint)
        if len(request.token_ids) % 4:
            raise InvalidArgument(
                f"token_ids is {len(request.token_ids)} bytes; "
                "expected u32 little-endian ids (a multiple of 4 bytes)"
            )
        ns = None
        if request.HasField("namespace"):
            raw = request.namespace.SerializeToString()
            # Only small ones are kept: a client could otherwise fill the cache with
            # namespaces of megabytes (their extra fields).
            ns = _described(raw) if len(raw) <= 4096 else namespace_from_pb(request.namespace)
            if ns.fingerprint != fp:
                raise InvalidArgument(
                    "namespace does not match fingerprint (its fingerprint is "
                    f"{ns.fingerprint.hex()}, the request says {fp.hex()})"
                )
        tenant = self._tenant(context)
        self.tenants.prove(tenant, ns)
        if ns is not None:
            self.names.remember(fp, ns, request.namespace.ByteSize())
        if tenant is None:  # a tenant has no filter: its counts would be made up
            self.store.count_lookups(request.filtered_lookups, request.filtered_tokens)
        if request.chunk_keys or request.n_tokens:
            if tenant is not None:
                raise Denied(
                    "tenants look up by token_ids (keys could name another tenant's chunks)"
                )
            if request.token_ids:
                raise InvalidArgument("give token_ids or chunk_keys, not both")
            if request.explain:
                raise InvalidArgument(
                    "explain needs token_ids: other namespaces key the same tokens otherwise"
                )
            result, needs = self.store.lookup_keys(
                fp,
                request.chunk_keys,
                request.n_tokens,
                request.sub_hashes,
                sub_hashes_of=(
                    request.sub_hashes_of if request.HasField("sub_hashes_of") else None
                ),
                min_tokens=request.min_tokens,
                granularity=request.granularity or None,
                count=not request.repeat,
            )
            self._prefetch(request, fp, result)
            msg = lookup_to_pb(result)
            if needs is not None:
                msg.needs_sub_hashes = needs  # asked again with them: lent then
            elif request.HasField("lend_from"):
                self.lend_into(msg, request, result, context)
            return msg
        tokens = np.frombuffer(request.token_ids, dtype="<u4")
        result = self.store.lookup(
            fp,
            tokens,
            min_tokens=request.min_tokens,
            granularity=request.granularity or None,
            count=not request.repeat,
        )
        self._prefetch(request, fp, result)
        if request.explain:
            result = replace(result, other_namespaces=self._explain(fp, tokens, result, tenant))
        msg = lookup_to_pb(result)
        if request.HasField("lend_from"):
            self.lend_into(msg, request, result, context)
        return msg

    def _prefetch(self, request: pb.LookupRequest, fp: Fingerprint, result: LookupResult) -> None:
        """With ``prefetch``: the matched chunks not in L1 start their way there (queued,
        not waited for: ``TieredStore.prefetch``)."""
        if request.prefetch:
            below = [m.key for m in result.chunks if m.tier != TierLevel.MEMORY]
            if below:
                self.store.prefetch(fp, below, skip_disk=request.client_reads_disk)

    def _explain(
        self, fp: Fingerprint, tokens: np.ndarray, result: Any, tenant: str | None
    ) -> tuple[NamespaceMatch, ...]:
        out = []
        for other in self.store.namespaces():
            if other == fp or not self.tenants.owns(tenant, other):
                continue
            r = self.store.lookup(other, tokens, count=False, local=True)
            if r.matched_tokens > result.matched_tokens:
                out.append(NamespaceMatch(other, r.matched_tokens, self.names.get(other)))
        out.sort(key=lambda m: -m.matched_tokens)
        return tuple(out)

    # -- remote data plane -------------------------------------------------------------------------
    @rpc
    def Put(
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> pb.PutResponse:
        tenant = self._tenant(context)
        cid, watch = self.watchdog.watch(context, "data", tenant)
        try:
            parts = pieces(touching(request_iterator, watch.touch))
            field, first = next(parts, (0, memoryview(b"")))
            if field != 1:
                raise InvalidArgument("the first message of a Put stream must carry the header")
            header = self._header(bytes(first))
            self.tenants.require(tenant, header.fingerprint)
            status = receive_put(self.store, header, parts, watch)
        finally:
            self.watchdog.done(cid)
        if status == PutStatus.STORED:
            self._moved("in", "grpc", header.stored_size)
        return pb.PutResponse(status=status_to_pb(status), key=header.key)

    @rpc
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        sent = 0
        key, tenant = self._key(request.key), self._tenant(context)
        if tenant is not None and key in self.store and not self._visible(tenant, key):
            return  # another tenant's chunk: a miss
        cid, watch = self.watchdog.watch(context, "data", tenant)
        frames = send_get(self.store, key, self.config.piece_bytes, watch)
        try:
            for msg in frames:
                if not sent and tenant is not None:  # a chunk only the remote tier knew
                    _, header = unframe(msg, pb.GetResponse)
                    if not self.tenants.owns(tenant, parse_header(header).fingerprint):
                        return
                sent += len(msg)
                yield msg
                watch.touch()
        finally:
            frames.close()  # gives back the lease of an unfinished stream now
            self.watchdog.done(cid)
        if sent:
            self._moved("out", "grpc", sent)

    # -- management --------------------------------------------------------------------------------
    @rpc
    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext) -> pb.ExistsResponse:
        keys, tenant = self._keys(request.keys), self._tenant(context)
        found = self.store.contains(keys)
        if tenant is not None:  # only chunks of the caller's namespaces (indexed ones)
            found = [
                t if self._visible(tenant, k) else () for k, t in zip(keys, found, strict=True)
            ]
        return pb.ExistsResponse(found=[pb.TierSet(tiers=list(t)) for t in found])

    @rpc
    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        tenant = self._tenant(context)
        keys = [k for k in self._keys(request.keys) if self._visible(tenant, k)]
        return pb.DeleteResponse(deleted=sum(self.store.delete(k) for k in keys))

    @rpc
    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearResponse:
        if request.all == bool(request.fingerprint):
            raise InvalidArgument("give either a namespace fingerprint or all=true (not both)")
        fp = None if request.all else self._fingerprint(request.fingerprint)
        tenant = self._tenant(context)
        if tenant is not None and fp is None:
            raise Denied(f"tenant {tenant!r} may clear its own namespaces, not all")
        if fp is not None:
            self.tenants.require(tenant, fp)
        return pb.ClearResponse(removed=self.store.clear(fp))

    @rpc
    def Pin(self, request: pb.PinRequest, context: grpc.ServicerContext) -> pb.PinResponse:
        tenant = self._tenant(context)
        keys = [k for k in self._keys(request.keys) if self._visible(tenant, k)]
        return pb.PinResponse(changed=sum(self.store.pin(k, request.pinned) for k in keys))

    def table_figures(self) -> dict[str, float]:
        """The server's own tables and stream limits, for the metrics endpoint."""
        names, dog = self.names, self.watchdog
        return {
            "namespace_descriptions_bytes": names.bytes,
            "namespace_descriptions_too_large": names.too_large,
            "namespace_descriptions_forgotten": names.forgotten,
            "tenant_namespaces_forgotten": self.tenants.forgotten,
            "streams_refused": dog.refused,
            "streams_cancelled": dog.cancelled,  # idle or too slow
            "streams_cancelled_slow": dog.too_slow,
        }

    @rpc
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        stats = self.store.stats()
        tenant = self._tenant(context)
        if tenant is not None:  # its own chunks and namespaces; tier figures are server-wide
            mine = {
                fp: n for fp, n in self.store.namespaces().items() if self.tenants.owns(tenant, fp)
            }
            stats.chunks, stats.namespaces = sum(mine.values()), len(mine)
            for tier in stats.tiers:  # figures only: paths and addresses are the operator's
                tier.detail = {
                    k: v for k, v in tier.detail.items() if isinstance(v, int | float | bool)
                }
        leases = stats.tiers[0].detail.get("active_leases", 0) if stats.tiers else 0
        return stats_to_pb(
            stats,
            active_leases=leases if isinstance(leases, int) else 0,
            uptime_s=int(time.monotonic() - self._started),
            requests=self.request_counts(),
        )

    @rpc
    def List(self, request: pb.ListRequest, context: grpc.ServicerContext) -> pb.ListResponse:
        fp = self._fingerprint(request.fingerprint) if request.fingerprint else None
        tenant = self._tenant(context)
        if fp is not None:
            self.tenants.require(tenant, fp)
        size = request.page_size or 100
        if size > 1000:
            raise InvalidArgument(f"page_size={size}: at most 1000")
        after = b""
        if request.page_token:
            try:
                after = bytes.fromhex(request.page_token)
            except ValueError:
                after = b""
            if len(after) != KEY_BYTES:
                raise InvalidArgument(
                    f"page_token {request.page_token[:80]!r} is not one this server handed out"
                )

        def keep(v: ChunkView) -> bool:
            return (
                v.key > after
                and (not request.tier or request.tier in v.tiers)
                and (not request.pinned_only or v.pinned)
                and self.tenants.owns(tenant, v.fingerprint)
            )

        views = sorted((v for v in self.store.scan(fp) if keep(v)), key=lambda v: v.key)
        page = views[:size]
        token = page[-1].key.hex() if len(views) > size else ""
        return pb.ListResponse(chunks=[chunk_to_pb(v) for v in page], next_page_token=token)

    @rpc
    def Namespaces(
        self, request: pb.NamespacesRequest, context: grpc.ServicerContext
    ) -> pb.NamespacesResponse:
        tenant = self._tenant(context)
        counts = {
            fp: n for fp, n in self.store.namespaces().items() if self.tenants.owns(tenant, fp)
        }
        sizes: Counter[bytes] = Counter()
        for v in self.store.scan():
            sizes[v.fingerprint] += v.raw_size
        names = self.names.snapshot()
        out = []
        for fp, n in sorted(counts.items()):
            ns = names.get(fp)
            out.append(
                pb.NamespaceInfo(
                    fingerprint=fp,
                    chunks=n,
                    bytes=sizes[fp],
                    namespace=namespace_to_pb(ns) if ns else None,
                )
            )
        return pb.NamespacesResponse(namespaces=out)
