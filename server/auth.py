"""Bearer-token authentication for every RPC except health checks.

Clients send ``authorization: Bearer <token>`` metadata. The comparison is
constant-time (``hmac.compare_digest``) so response timing says nothing about
how much of a guessed token was right. Health checks stay open, so load
balancers and ``grpc_health_probe`` need no secret.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kvstore.protocol import AUTH_HEADER

log = logging.getLogger("kvstore.server.auth")

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails with UNAUTHENTICATED."""

    def abort(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def abort_stream(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this a generator, as the streaming shape requires

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(abort, **kw)


class TokenAuth(grpc.ServerInterceptor):
    """Refuses calls without a right bearer token (UNAUTHENTICATED, saying why).

    ``token`` is the admin token; ``tenant_tokens`` (token -> tenant) are accepted too
    (server.tenants scopes what each of them sees).
    """

    def __init__(
        self,
        token: str,
        on_refused: Callable[[str], None] | None = None,
        *,
        tenant_tokens: Iterable[str] = (),
    ) -> None:
        tokens = [t for t in (token, *tenant_tokens) if t]
        if not tokens:
            raise ValueError("TokenAuth needs a non-empty token")
        self._expected = [f"Bearer {t}".encode() for t in tokens]
        self._on_refused = on_refused

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call with this metadata is refused, or None if its token is right (also
        asked of the express plane's HELLO)."""
        given = None
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                given = value.encode() if isinstance(value, str) else value
                break
        # Every token is compared (constant time each), so timing does not say which matched.
        if given is not None and sum(hmac.compare_digest(given, e) for e in self._expected):
            return None
        return (
            "missing bearer token (authorization metadata)"
            if given is None
            else "wrong bearer token"
        )

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        why = self.refusal(handler_call_details.invocation_metadata)
        if why is None:
            return handler
        log.debug("refused %s: %s", method, why)
        if self._on_refused is not None:
            self._on_refused(method.rsplit("/", 1)[-1])
        return _refuse(handler, f"{why}; this server requires one")
