"""What the blocking and the asyncio clients share: their state and settings, the channel,
the arena checks and how requests are built.

``kvstore.sdk.client.Client`` and ``kvstore.sdk.aio.AsyncClient`` differ only in how they
wait. Their state and settings (``ClientBase``), when shared memory can be used and how
requests are built live here; which URL means what is ``kvstore.sdk.endpoint``, a chunk's
header and a Get stream put back together ``kvstore.sdk.chunks``; the operations
themselves are written once in ``kvstore.sdk.client_core`` and
``kvstore.sdk.client_writes``; leases and reservations in the arena are ``kvstore.sdk.shm``.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import xxhash

from kvstore import accel
from kvstore.arena import ArenaView, as_u8
from kvstore.clock import Clock, monotonic
from kvstore.errors import InvalidArgument, KVStoreError, ServerError
from kvstore.keys import (
    ROOT,
    Fingerprint,
    chunk_prefix,
    sub_hashes,
)
from kvstore.protocol import (
    AUTH_HEADER,
    SERVICE_NAME,
    SESSION_HEADER,
    boot_id,
    frame,
    namespace_from_pb,
    namespace_to_pb,
)
from kvstore.records import (
    RecordHeader,
    check_put,
)
from kvstore.sdk.chunks import NamespaceLike, namespace_fingerprint
from kvstore.sdk.endpoint import check_default_socket, parse_url, read_tls_ca
from kvstore.sdk.presence import PresenceView
from kvstore.sdk.shm import prefault, retire
from kvstore.sdk.wire import NamespaceInfo, ServerInfo, error_from_rpc
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger("kvstore.sdk.client")

CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    # Idle links: a ping every 30 s, with calls in flight or none, keeps a quiet connection
    # alive through NATs, load balancers and firewalls that drop idle ones, and finds a
    # peer gone silent within 40 s, so the next call dials again instead of waiting out its
    # deadline on a dead connection. The server takes pings up to once a second
    # (server/main.py), so these never get the connection closed for pinging too often.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # What bounds the wait for a ping's answer in grpcio 1.85 (measured: with only
    # keepalive_timeout_ms, a link that went silent stayed READY for as long as we watched,
    # every call on it waiting out its deadline; the default of this one is a minute).
    ("grpc.http2.ping_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # the default, 2, stops pinging a quiet link
]


LEASE_MARGIN = 0.5  # a lease is trusted for this share of its length, client-side
PUT_METHOD = f"/{SERVICE_NAME}/Put"
GET_METHOD = f"/{SERVICE_NAME}/Get"


class ClientBase:
    """What the blocking and the asyncio client share: settings, arena checks, messages."""

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        tls_ca: str | bytes | None = None,
        tls_server_name: str | None = None,
        timeout: float = 10.0,
        shm: bool | None = None,
        verify: bool = True,
    ) -> None:
        """``verify``: checksum what ``get``/``get_into`` copy out of shared memory here,
        instead of the server checking the pages before the lease. Both verify every
        byte; here the bytes are hashed as they are copied (one pass with the native
        module; cheaper than the server's pass over the pages), and a rogue writer on the
        host changing pages mid-read is caught too. ``verify=False`` leaves it to the server."""
        self.endpoint = parse_url(url)
        check_default_socket(self.endpoint)
        self.url = self.endpoint.url
        self.timeout = timeout
        self.verify = verify
        self.session_id = uuid.uuid4().hex
        token = token if token is not None else os.environ.get("KVSTORE_TOKEN", "")
        self._metadata: tuple[tuple[str, str], ...] = ((SESSION_HEADER, self.session_id),)
        if token:
            self._metadata += ((AUTH_HEADER, f"Bearer {token}"),)
        self._shm_pref = shm
        self._ca = read_tls_ca(tls_ca)
        self._options = list(CHANNEL_OPTIONS)
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))
        self._info: ServerInfo | None = None
        self._arena: ArenaView | None = None
        self._shm_checked = False  # Info looked at and the arena opened (or refused)
        self._arena_id: tuple[str, int, int, str] | None = None
        # L2's data file, read-only, where loans are read (``acquire_many(disk=True)``):
        # what the server offers (path, inode, map size; on the arena's host), and the
        # mapping, made by the first call that asks for loans.
        self._disk: ArenaView | None = None
        self._disk_id: tuple[str, int, int] | None = None
        self._disk_lock = threading.Lock()
        # The server's presence filter, where this client maps it: lookups of prompts
        # nothing was stored for are answered here (``kvstore.sdk.presence``).
        self._presence = PresenceView()
        # False: every lookup is asked of the server, the presence filter left unread (a
        # benchmark of the server's own answer to a miss). Not with ``shm=False`` either.
        self.use_presence = True
        self._session_refused = False  # the server has no room for our Session stream
        # The Session stream keeping this client's holds alive: a thread or a task.
        self._session: Any = None
        self._closed = False
        self._prefault_stop = threading.Event()
        self._clock: Clock = monotonic  # when leases and reservations surely hold
        # Lookups send the prompt's chunk keys and sub-hashes (48 bytes a chunk at the
        # default sizes) instead of its token ids (1 KiB a chunk) where the server takes
        # them; False always sends the ids (the way servers before it were asked).
        self.lookup_by_keys = True
        # Up to this many chunks a lookup by keys also carries every chunk's sub-hashes
        # (the partial match of the chunk where matching stops), one round trip whatever
        # the answer. A longer prompt sends its keys alone: hashing 16 sub-hashes a chunk
        # costs the client ~3x the keys (~1 ms for 128k tokens), so the server asks for
        # the one chunk's it needs, a second round trip only where a partial match may be.
        self.inline_sub_hashes = 64
        self._open()

    def _open(self) -> None:
        """The transport's channel (``_open_channel``) and its own state."""
        raise NotImplementedError

    def _open_channel(self, channels: Any, unary: Sequence[str], put: str) -> None:
        """The gRPC channel to the endpoint, its stub and a handle per method, made by
        ``channels``: ``grpc`` for the blocking transport, ``grpc.aio`` for asyncio."""
        ep = self.endpoint
        self._channel = (
            channels.secure_channel(ep.target, self._credentials(), self._options)
            if ep.tls
            else channels.insecure_channel(ep.target, self._options)
        )
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._methods: dict[str, Any] = {m: getattr(self._stub, m) for m in unary}
        self._methods[put] = self._channel.stream_unary(
            PUT_METHOD, request_serializer=None, response_deserializer=pb.PutResponse.FromString
        )
        self._get_raw = self._channel.unary_stream(
            GET_METHOD,
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=None,
        )

    def _session_alive(self) -> bool:
        """Whether the Session stream is still running (each transport knows how)."""
        raise NotImplementedError

    def _plane_ready(self) -> bool:
        """The data plane was chosen and nothing asks to look again: no Info needed.

        Looked at again when the Session ended (the server may have restarted with a
        new arena), and where an arena is mapped but its Session not started yet."""
        if not self._shm_checked:
            return False
        if self._session is None:
            return self._arena is None or self._session_refused
        return self._session_alive()

    def _pipelines(self) -> bool:
        """Whether calls in a pipe (``client_core.Pipe``) overlap with this client's own
        work: over the express plane they do; a gRPC call costs more than the overlap
        saves (the calls of ``put_many`` in parts took 9.4-9.9 ms for 16 MiB against
        5.9 ms in one part, with either client), so there plans send in one part."""
        return False

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._ca)

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _error(self, e: grpc.RpcError, what: str) -> KVStoreError:
        return error_from_rpc(e, what, self.url)

    def _open_arena(self, info: ServerInfo) -> ArenaView | None:
        """The server's arena if this client shares its host and may map it."""
        if self._shm_pref is False:
            return None
        why = ""
        if not info.shm_path:
            why = "the server does not offer shared memory"
        elif not info.boot_id or info.boot_id != boot_id():
            why = "the server runs on another host (boot ids differ)"
        else:
            try:
                arena = ArenaView.open(
                    info.shm_path, info.shm_size, writable=True, inode=info.shm_inode
                )
                self._arena_id = (info.shm_path, info.shm_inode, info.shm_size, info.boot_id)
                threading.Thread(
                    target=prefault,
                    args=(arena, self._prefault_stop),
                    name="kvstore-prefault",
                    daemon=True,
                ).start()
                return arena
            except KVStoreError as e:
                why = f"cannot map {info.shm_path}: {e}"
        if self._shm_pref:
            raise KVStoreError(f"shared memory was requested (shm=True) but cannot be used: {why}")
        log.debug("shared memory not used: %s", why)
        return None

    def _open_disk(self, info: ServerInfo) -> None:
        """Note L2's data file if the server lends it and this client maps its arena (the
        server's host); a mapping of another file (a restart) goes. The file is mapped
        by ``_disk_view``, on the first call that asks for loans: a client that never
        does (a saver) reserves no address space for it."""
        ident = (info.disk_path, info.disk_inode, info.disk_map_size)
        with self._disk_lock:
            if self._disk_id == ident:
                return
            old, self._disk = self._disk, None
            self._disk_id = ident if info.disk_path and self._arena is not None else None
        if old is not None:
            self._retire_arena(old)

    def _disk_view(self) -> ArenaView | None:
        """L2's data file, mapped read-only on first use; None where the server lends no
        file or this client cannot map it (its chunks in L2 are then promoted into L1)."""
        with self._disk_lock:
            if self._disk is not None or self._disk_id is None:
                return self._disk
            path, inode, size = self._disk_id
            try:
                self._disk = ArenaView.open(path, size, writable=False, growing=True, inode=inode)
            except KVStoreError as e:
                log.debug("L2 loans not used: cannot map %s: %s", path, e)
            if self._disk is None:
                self._disk_id = None  # not tried again until the server offers it anew
            return self._disk

    def _retire_arena(self, arena: ArenaView) -> None:
        """Unmap a restarted server's old arena on a thread of its own: this mapping is
        often the last hold on the old file's pages, and unmapping a populated 1 GiB
        arena frees them there (~0.2 s here), which would delay the call that found the
        new arena (the first load after a restart: 240 ms for a 10 ms AcquireMany)."""
        threading.Thread(target=retire, args=(arena,), name="kvstore-unmap", daemon=True).start()

    def _same_arena(self, info: ServerInfo) -> bool:
        return self._arena_id == (info.shm_path, info.shm_inode, info.shm_size, info.boot_id)

    def _session_ended(self, e: grpc.RpcError) -> None:
        """Note why the Session stream ended; leases then only live out their lease_ms."""
        if self._closed:
            return
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._session_refused = True
            log.warning(
                "kvstore server %s refused a session (%s); leases of this client "
                "will expire on their own",
                self.url,
                e.details(),
            )
        else:
            log.debug("session stream ended: %s", e)

    def _verified(self, header: RecordHeader, data: Any) -> bool:
        """The payload read from shared memory hashes right (the server left it to us).

        False sends the read to Get, where the server verifies the record itself and,
        if it is corrupt, deletes and counts it: the caller gets a miss or a good copy
        from a lower tier, never these bytes."""
        return not self.verify or xxhash.xxh3_64_intdigest(data) == header.payload_checksum

    def _check_extents(
        self, extents: Iterable[pb.Extent], *, disk: bool = False
    ) -> list[tuple[int, int]]:
        """A lease's extents, checked to lie in the arena (``disk``: in L2's file)."""
        return self._in_view([(e.offset, e.length) for e in extents], disk=disk)

    def _in_view(self, out: list[tuple[int, int]], *, disk: bool) -> list[tuple[int, int]]:
        view = self._disk if disk else self._arena
        if view is None:
            raise ServerError(
                f"the server lent from {'a file' if disk else 'an arena'} not mapped here"
            )
        if any(o + n > view.size for o, n in out):
            raise ServerError(
                f"the server handed out extents beyond its {'data file' if disk else 'arena'} "
                "(did it restart?)"
            )
        return out

    def _check_put(self, header: RecordHeader, payload: Any) -> np.ndarray:
        src = as_u8(payload)
        info = self._info  # the server's limit, once known: refused before anything is sent
        check_put(header, max_chunk_bytes=info.max_chunk_bytes if info is not None else None)
        if src.size != header.stored_size:
            raise InvalidArgument(
                f"payload is {src.size} bytes, its header says {header.stored_size}"
            )
        return src

    def _put_frames(self, header: RecordHeader, src: np.ndarray) -> Iterator[bytes]:
        """Put messages as raw frames (kvstore.protocol.frame): one copy of each piece."""
        yield frame(1, header.pack())
        piece = self._info.piece_bytes if self._info else 1 << 20
        mv = src.data
        for off in range(0, len(mv), piece):
            yield frame(2, mv[off : off + piece])

    def _lookup_request(
        self,
        ns: NamespaceLike,
        token_bytes: memoryview,
        min_tokens: int,
        granularity: int,
        explain: bool,
        repeat: bool = False,
        prefetch: bool = False,
        reads_disk: bool = False,
        by_keys: bool = True,
    ) -> pb.LookupRequest:
        """The prompt (u32le ``token_bytes``) by its chunk keys where the server takes
        them (its Info says so), ``lookup_by_keys`` and ``by_keys`` are on, with every
        chunk's sub-hashes up to ``inline_sub_hashes`` chunks; else by its token ids
        (explain needs those: other namespaces key the same tokens otherwise)."""
        fp, named = namespace_fingerprint(ns)
        req = pb.LookupRequest(
            fingerprint=fp,
            min_tokens=min_tokens,
            granularity=granularity,
            explain=explain,
            repeat=repeat,
            prefetch=prefetch,
            client_reads_disk=prefetch and reads_disk,
            namespace=namespace_to_pb(named) if named is not None else None,
        )
        info = self._info
        keyed = by_keys and self.lookup_by_keys and not explain
        if keyed and info is not None and info.lookup_by_keys:
            step = info.chunk_tokens * 4
            req.chunk_keys = b"".join(accel.chain_keys(chunk_prefix(fp), ROOT, token_bytes, step))
            req.n_tokens = len(token_bytes) // 4
            if -(-len(token_bytes) // step) <= self.inline_sub_hashes:
                req.sub_hashes = b"".join(
                    sub_hashes(token_bytes[s : s + step], info.granularity)
                    for s in range(0, len(token_bytes), step)
                )
        else:
            req.token_ids = token_bytes.tobytes()
        return req

    def _sub_hashes_of(self, token_bytes: memoryview, chunk: int) -> bytes:
        """The sub-hashes of one chunk of the prompt, at the server's granularity."""
        assert self._info is not None
        step = self._info.chunk_tokens * 4
        return sub_hashes(token_bytes[chunk * step : (chunk + 1) * step], self._info.granularity)

    @staticmethod
    def _clear_request(namespace: NamespaceLike | None, all: bool) -> pb.ClearRequest:
        if (namespace is None) == (not all):
            raise InvalidArgument("clear needs a namespace or all=True (not both)")
        fp = namespace_fingerprint(namespace)[0] if namespace is not None else b""
        return pb.ClearRequest(fingerprint=fp, all=all)

    @staticmethod
    def _list_request(
        namespace: NamespaceLike | None, tier: int, pinned_only: bool, page_size: int, token: str
    ) -> pb.ListRequest:
        fp = namespace_fingerprint(namespace)[0] if namespace is not None else b""
        return pb.ListRequest(
            fingerprint=fp,
            tier=tier,
            pinned_only=pinned_only,
            page_size=page_size,
            page_token=token,
        )

    @staticmethod
    def _namespaces(msg: pb.NamespacesResponse) -> list[NamespaceInfo]:
        out = []
        for n in msg.namespaces:
            named = None
            if n.HasField("namespace"):
                try:
                    named = namespace_from_pb(n.namespace)
                except InvalidArgument:
                    named = None
            out.append(NamespaceInfo(Fingerprint(n.fingerprint), n.chunks, n.bytes, named))
        return out

    def _ping_interval(self) -> float:
        lease_ms = self._info.lease_ms if self._info else 30_000
        return max(0.05, min(lease_ms / 3000.0, 5.0))
