"""What every RPC method of the servicer runs under: ``rpc`` (the decorator) counts and
times the call, refuses new calls while the server shuts down (those finishing work
a client began excepted), and turns any exception into a gRPC status with a message
saying what was wrong (``KVStoreService._failed``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import grpc

from kvstore.errors import InvalidArgument

from .streams import Undecodable

F = TypeVar("F", bound=Callable[..., Any])


def decoded(request: Any) -> None:
    if isinstance(request, Undecodable):
        raise InvalidArgument(request.message)


class Status(Exception):
    """Fail the call with exactly this status (for codes status_of does not derive)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# Calls that finish work a client already began; still served while draining.
FINISHING = frozenset({"Commit", "CommitMany", "Abort", "Release"})


class Servicer(Protocol):
    """What ``rpc`` needs of the servicer it wraps the methods of."""

    def _enter(self, name: str) -> bool: ...

    def _leave(self, name: str, code: grpc.StatusCode, t0: float, entered: bool) -> None: ...

    def _failed(
        self, name: str, e: Exception, context: grpc.ServicerContext
    ) -> tuple[grpc.StatusCode, str]: ...


def rpc(fn: F) -> F:
    """Status mapping, shutdown gate, counts and timing for one RPC method."""
    name = fn.__name__
    streaming = name in ("Get", "Session")

    def begin(self: Servicer) -> float:
        if not self._enter(name):
            raise Status(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        return time.perf_counter()

    if streaming:

        @functools.wraps(fn)
        def gen_wrapper(
            self: Servicer, request: Any, context: grpc.ServicerContext
        ) -> Iterator[Any]:
            code, msg, t0, entered = grpc.StatusCode.OK, "", time.perf_counter(), False
            try:
                t0 = begin(self)
                entered = True
                decoded(request)
                yield from fn(self, request, context)
            except Exception as e:
                code, msg = self._failed(name, e, context)
            finally:
                self._leave(name, code, t0, entered)
            if code != grpc.StatusCode.OK:
                context.abort(code, msg)

        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(self: Servicer, request: Any, context: grpc.ServicerContext) -> Any:
        code, msg, t0, entered = grpc.StatusCode.OK, "", time.perf_counter(), False
        try:
            t0 = begin(self)
            entered = True
            decoded(request)
            return fn(self, request, context)
        except Exception as e:
            code, msg = self._failed(name, e, context)
        finally:
            self._leave(name, code, t0, entered)
        context.abort(code, msg)

    return wrapper  # type: ignore[return-value]
