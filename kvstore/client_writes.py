"""``Client`` methods that write chunks in place in the server's arena (same host only):
``reserve`` a batch in one round trip, write each payload into its pages, ``commit``
them one by one (``Reservation.commit``) or together (``Client.commit``).

A mixin of ``kvstore.client.Client``, kept apart so each module reads in one sitting;
it uses only the client's plumbing declared below.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvstore.arena import ArenaView
from kvstore.errors import InvalidArgument, KVStoreError, ServerError
from kvstore.protocol import MAX_RESERVE_BATCH, status_from_pb
from kvstore.records import RecordHeader
from kvstore.sdk import LEASE_MARGIN
from kvstore.shm import Reservation
from kvstore.types import PutStatus
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.wire import error_from_code

T = TypeVar("T")


class InPlaceWrites:
    if TYPE_CHECKING:  # provided by Client
        _stub: Any
        _arena: ArenaView | None
        url: str
        timeout: float

        def _shm(self) -> ArenaView | None: ...

        def _call(
            self, what: str, method: Callable[..., T], request: Any, timeout: float | None
        ) -> T: ...

        def _check_extents(self, extents: Iterable[pb.Extent]) -> list[tuple[int, int]]: ...

    def reserve(
        self,
        headers: Sequence[RecordHeader],
        *,
        checksum_at_commit: bool = True,
        timeout: float | None = None,
    ) -> builtins.list[Reservation | PutStatus]:
        """Arena space for chunks whose payloads the caller writes in place: one round trip.

        For each header, a ``Reservation`` (write its ``views()``, then ``commit()``), or
        the status a put would get without one: EXISTS (already stored: nothing to
        write), FULL or TOO_LARGE (L1 cannot take it now; ``put`` sends it below). With
        ``checksum_at_commit`` the headers' checksums are placeholders (``chunk_header``
        with ``payload=None``) and the checksum of what was written goes with the commit
        (``Reservation.commit``), where the server checks the pages against it.
        Only on the server's host; raises KVStoreError when shared memory is not in use.
        """
        arena = self._shm()
        if arena is None:
            raise KVStoreError("reserve needs the shared-memory data plane (same host)")
        out: builtins.list[Reservation | PutStatus] = []
        try:
            self._reserve_batches(arena, headers, checksum_at_commit, timeout, out)
        except BaseException:
            for res in out:  # a later batch failed: give back what earlier ones got
                if isinstance(res, Reservation):
                    res.abort()
            raise
        return out

    def _reserve_batches(
        self,
        arena: ArenaView,
        headers: Sequence[RecordHeader],
        checksum_at_commit: bool,
        timeout: float | None,
        out: builtins.list[Reservation | PutStatus],
    ) -> None:
        for i in range(0, len(headers), MAX_RESERVE_BATCH):
            batch = headers[i : i + MAX_RESERVE_BATCH]
            t0 = time.monotonic()
            r = self._call(
                "ReserveMany",
                self._stub.ReserveMany,
                pb.ReserveManyRequest(
                    requests=[
                        pb.ReserveRequest(header=h.pack(), checksum_at_commit=checksum_at_commit)
                        for h in batch
                    ]
                ),
                timeout,
            )
            if len(r.responses) != len(batch):
                raise ServerError(f"ReserveMany answered {len(r.responses)} of {len(batch)}")
            for h, one in zip(batch, r.responses, strict=True):
                status = status_from_pb(one.status)
                if status != PutStatus.STORED:
                    out.append(status)
                    continue
                out.append(
                    Reservation(
                        h,
                        one.reservation_id,
                        self._check_extents(one.extents),
                        one.payload_offset,
                        arena,
                        functools.partial(self._finish, timeout=timeout),
                        t0 + one.expires_ms / 1000 * LEASE_MARGIN,
                        checksum_at_commit,
                    )
                )

    def commit(
        self,
        reservations: Sequence[Reservation],
        checksums: Sequence[int | None] | None = None,
        *,
        timeout: float | None = None,
    ) -> builtins.list[PutStatus | KVStoreError]:
        """Commit several reservations of this client in one round trip.

        ``checksums[i]`` as for ``reservations[i].commit``. For each, its status, or the
        error its own ``commit`` would have raised (that chunk is not stored; the others
        are not affected). Raises ``InvalidArgument`` before using any reservation if one
        cannot be committed (another client's, used already, twice in the list), and the
        call's error if a round trip fails: then every reservation passed in is used up
        (those of batches not sent are aborted; those sent may be stored).
        """
        sums = list(checksums) if checksums is not None else [None] * len(reservations)
        if len(sums) != len(reservations):
            raise InvalidArgument(f"{len(sums)} checksums for {len(reservations)} reservations")
        if len({id(res) for res in reservations}) != len(reservations):
            raise InvalidArgument("the same reservation twice in one commit")
        for res, c in zip(reservations, sums, strict=True):  # refused before any is used
            if res.arena is not self._arena:
                raise InvalidArgument("a reservation of another client (or an earlier connection)")
            if res.done:
                raise InvalidArgument(f"reservation {res.id} was already committed or aborted")
            if c is not None and not 0 <= c < 1 << 64:
                raise InvalidArgument(f"checksum {c} of reservation {res.id} is not a u64")
        reqs = [
            pb.CommitRequest(reservation_id=res.id, payload_checksum=res.closing(c))
            for res, c in zip(reservations, sums, strict=True)
        ]
        base = timeout if timeout is not None else self.timeout
        out: builtins.list[PutStatus | KVStoreError] = []
        for i in range(0, len(reqs), MAX_RESERVE_BATCH):
            batch = reqs[i : i + MAX_RESERVE_BATCH]
            # The server hashes every payload of the batch: allow for it (1 GB/s at worst).
            nbytes = sum(r.header.stored_size for r in reservations[i : i + MAX_RESERVE_BATCH])
            try:
                r = self._call(
                    "CommitMany",
                    self._stub.CommitMany,
                    pb.CommitManyRequest(commits=batch),
                    base + nbytes / 1e9,
                )
            except BaseException:
                for rid in [q.reservation_id for q in reqs[i + len(batch) :]]:
                    self._finish(rid, False, None, timeout=timeout)  # never sent: give back
                raise
            if len(r.responses) != len(batch):
                raise ServerError(f"CommitMany answered {len(r.responses)} of {len(batch)}")
            out += [
                error_from_code(one.error_code, one.error, "Commit", self.url)
                if one.error_code
                else status_from_pb(one.status)
                for one in r.responses
            ]
        return out

    def _finish(
        self, reservation_id: int, commit: bool, checksum: int | None, *, timeout: float | None
    ) -> PutStatus:
        if commit:
            c = self._call(
                "Commit",
                self._stub.Commit,
                pb.CommitRequest(reservation_id=reservation_id, payload_checksum=checksum),
                timeout,
            )
            return status_from_pb(c.status)
        with contextlib.suppress(KVStoreError):  # else it expires on its own
            self._call(
                "Abort", self._stub.Abort, pb.AbortRequest(reservation_id=reservation_id), timeout
            )
        return PutStatus.EXISTS  # not stored by this reservation
