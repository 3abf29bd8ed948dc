"""The blocking transport of ``kvstore.Client``: how each step of a plan of the client
core (``kvstore.sdk.client_core``) travels, as one blocking call.

A unary call goes over the server's express plane (``kvstore.express``) when this client
dialed the server's Unix socket and the server offers one, else over gRPC; a pipe's calls
(``client_core.Pipe``) go on one express connection, or one by one over gRPC
(``_GrpcPipe``). Also here: the shared-memory plane's setup on first use, the Session
stream that keeps this client's leases alive, and ``close``. ``kvstore.sdk.client`` has
the API on top; ``kvstore.sdk.aio`` is the asyncio transport of the same plans.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, TypeVar

import grpc

from kvstore import express
from kvstore.arena import ArenaView
from kvstore.errors import KVStoreError
from kvstore.sdk import client_core as core
from kvstore.sdk.base import ClientBase
from kvstore.sdk.express import FALLBACK, ExpressLink
from kvstore.sdk.wire import info_from_pb
from kvstore.v1 import kvstore_pb2 as pb

T = TypeVar("T")


class BlockingTransport(ClientBase):
    """The calls of a blocking client (``kvstore.Client``); thread-safe."""

    def _open(self) -> None:
        self._open_channel(grpc, core.UNARY_METHODS, core.PUT)
        self._lock = threading.Lock()
        self._pending: set[grpc.Future] = set()  # Releases sent without waiting
        self._stop = threading.Event()
        # Set once the server answered the Session's first ping: from then on it drops this
        # client's holds when the stream ends (before, a killed client's holds only expire).
        self.session_up = threading.Event()
        # Unary calls go by the server's express plane (kvstore.express) when this client
        # dials its Unix socket and the server offers one; False: gRPC always. Looked at
        # once, at the first call.
        self.use_express = True
        self._express: ExpressLink | None = None
        self._express_checked = False
        self._express_asking = False  # a background Info is on its way
        self._express_lock = threading.Lock()

    # -- the transport: each step of a plan as a blocking call ----------------------------
    def _run(self, plan: core.Plan[T]) -> T:
        return core.run_blocking(plan, self._step)

    def _step(self, step: core.Step) -> Any:
        if self._closed:
            raise KVStoreError("the client is closed")
        if type(step) is core.Call:
            timeout = self._deadline(step.timeout)
            link = self.express
            if link is not None:
                deadline = time.monotonic() + timeout
                out = link.call(step.method, step.request, deadline)
                if out is not FALLBACK:
                    return out
                timeout = max(0.0, deadline - time.monotonic())  # what is left of it
            try:
                return self._methods[step.method](
                    step.request, timeout=timeout, metadata=self._metadata
                )
            except grpc.RpcError as e:
                raise self._error(e, step.method) from e
        if step is core.NEED_ARENA:
            return self._shm()
        if type(step) is core.Send:
            self._send(step.pipe, step.call)
            return None
        if type(step) is core.Receive:
            return step.pipe.state.receive()
        if type(step) is core.GetStream:
            try:
                for raw in self._get_raw(
                    step.request, timeout=self._deadline(step.timeout), metadata=self._metadata
                ):
                    step.sink.add(raw)
            except grpc.RpcError as e:
                raise self._error(e, "Get") from e
            return None
        if type(step) is core.ReleaseLater or type(step) is core.Tell:
            link = self.express
            if link is not None and link.send(step.method, step.request()):
                return None
            try:
                fut = getattr(self._stub, step.method).future(
                    step.request(),
                    timeout=self.timeout,
                    metadata=self._metadata,
                )
            except grpc.RpcError:
                return None  # the lease expires, or goes with the Session, on its own
            self._pending.add(fut)
            fut.add_done_callback(self._pending.discard)
            return None
        if type(step) is core.HealthCheck:
            from grpc_health.v1 import health_pb2_grpc

            try:
                return health_pb2_grpc.HealthStub(self._channel).Check(
                    step.request, timeout=self._deadline(step.timeout)
                )
            except grpc.RpcError:
                return None
        raise TypeError(f"not a step of the client core: {step!r}")

    def _pipelines(self) -> bool:
        return self.express is not None

    def _send(self, pipe: core.Pipe, call: core.Call) -> None:
        """A pipe's call on its way: on one connection of the express plane (chosen at
        the pipe's first call), else over gRPC (``_GrpcPipe``)."""
        timeout = self._deadline(call.timeout)
        if pipe.state is None:
            link = self.express
            if link is not None and call.method in express.METHODS:
                conn = link.pipe(time.monotonic() + timeout)
                if conn is not None and conn.send(call.method, call.request, timeout):
                    pipe.state = conn
                    return
            pipe.state = _GrpcPipe(self)
        pipe.state.send(call.method, call.request, timeout)

    def _express_link(self) -> ExpressLink | None:
        """The express link, decided once the server's Info is known (it says where the
        express socket is). Until then calls go by gRPC and an Info is asked in the
        background, so no call waits for it (a scheduler's lookup has its own deadline),
        and one that failed (no server yet) is asked again at a later call."""
        with self._express_lock:
            if self._express_checked:
                return self._express
            info = self._info
            if not (self.use_express and self.endpoint.target.startswith("unix:")):
                self._express_checked = True
            elif info is not None:
                self._express_checked = True
                # The socket beside the one this client dialed, not the path Info names:
                # in another mount namespace (a container) that may be another server's.
                dialed = os.path.abspath(self.endpoint.target[len("unix:") :])
                path = express.socket_path(dialed)
                if info.express_socket and path:
                    self._express = ExpressLink(path, self._metadata, self.url, clock=self._clock)
            if self._express_checked:
                return self._express
            ask, self._express_asking = not self._express_asking, True
        if ask:  # outside the lock: a future done already runs its callback right here
            fut = self._stub.Info.future(
                pb.InfoRequest(), timeout=self.timeout, metadata=self._metadata
            )
            fut.add_done_callback(self._express_info)
        return None

    def _express_info(self, fut: grpc.Future) -> None:
        """The background Info's answer (on a gRPC thread: nothing here waits)."""
        try:
            info = info_from_pb(fut.result())
        except Exception:  # the server is not up: a later call asks again
            info = None
        with self._express_lock:
            self._express_asking = False
            if info is not None and self._info is None:
                self._info = info

    @property
    def express(self) -> ExpressLink | None:
        """The express link this client's unary calls take, if it has one (decided here
        if the server's Info is known; None until then)."""
        return self._express if self._express_checked else self._express_link()

    def _shm(self) -> ArenaView | None:
        """The mapped arena if the shared-memory plane is in use (set up on first use)."""
        if self._plane_ready():
            return self._arena
        with self._lock:
            arena = self._run(core.setup_plane(self))
            if arena is not None and self._session is None and not self._session_refused:
                self._session = self._start_session()
            return arena

    def _session_alive(self) -> bool:
        return self._session is not None and bool(self._session.is_alive())

    def _start_session(self) -> threading.Thread:
        interval = self._ping_interval()

        def pings() -> Iterator[pb.SessionPing]:
            yield pb.SessionPing(owner=self.session_id)
            while not self._stop.wait(interval):
                yield pb.SessionPing(owner=self.session_id)

        def run() -> None:
            try:
                for _ in self._stub.Session(pings(), metadata=self._metadata):
                    self.session_up.set()
            except grpc.RpcError as e:
                self._session_ended(e)

        thread = threading.Thread(target=run, name="kvstore-session", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """End the Session (the server drops this client's leases) and the channel."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._prefault_stop.set()
        deadline = time.monotonic() + 1.0  # let Releases in flight land, briefly
        for fut in builtins.list(self._pending):
            with contextlib.suppress(Exception):
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
        if self._session is not None:
            self._session.join(timeout=2.0)
        if self._express is not None:
            self._express.close()
        self._channel.close()
        for view in (self._arena, self._disk):
            if view is not None:
                view.close()
        self._arena = self._disk = None


class _GrpcPipe:
    """A pipe's calls over gRPC (no express plane), each made when it is sent: a gRPC
    future's threads cost more than the overlap would save (``_pipelines``). Its reply,
    or its error, waits for ``receive``."""

    def __init__(self, client: BlockingTransport) -> None:
        self._client = client
        self._done: deque[tuple[Any, BaseException | None]] = deque()

    def send(self, method: str, request: Any, timeout: float) -> bool:
        c = self._client
        try:
            reply = c._methods[method](request, timeout=timeout, metadata=c._metadata)
        except grpc.RpcError as e:
            self._done.append((None, c._error(e, method)))
        else:
            self._done.append((reply, None))
        return True

    def receive(self) -> Any:
        reply, error = self._done.popleft()
        if error is not None:
            raise error
        return reply

    def end(self) -> None:
        self._done.clear()
