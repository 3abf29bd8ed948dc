"""Every kvstore error carries its gRPC code, and both ends of the wire agree on it.

The server answers with ``status_of(exc)`` (plus ``error_trailers(exc)``); the
client raises ``error_from_rpc``'s class. For each class: the code it is sent
with is the one it declares, and the class a client raises for that status has
the same code (the same class, for the classes a client sees). Then the same
against a real server with tenants: a wrong token is ``Unauthenticated``, a
tenant's forbidden call ``PermissionDenied``, and a put into a namespace the
tenant has not proved yet ``NamespaceNotRegistered``, which ``put_chunk`` proves
and retries by itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import get_args

import grpc
import pytest

import kvstore
from kvstore import errors
from kvstore.keys import ROOT, Namespace
from kvstore.protocol import ERROR_REASON_HEADER, error_trailers, status_of
from kvstore.sdk.client import chunk_header
from kvstore.sdk.wire import error_from_status
from kvstore.testing.server import KVServer
from kvstore.types import PutStatus
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.server.helpers import payload, tokens


def _all_error_classes() -> list[type[errors.KVStoreError]]:
    # Import every module that defines one, so __subclasses__ sees them all.
    # (Whatever the order tests are collected in: a class is in or out alike.)
    for module in (
        "kvstore.cli.format",
        "kvstore.server.main",
        "kvstore.server.tenants",
        "kvstore.engine.tiers.remote_guard",
    ):
        importlib.import_module(module)
    out: list[type[errors.KVStoreError]] = []
    todo: list[type[errors.KVStoreError]] = [errors.KVStoreError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(set(out), key=lambda c: f"{c.__module__}.{c.__qualname__}")


ALL = _all_error_classes()
CORE = [c for c in ALL if c.__module__ == "kvstore.errors"]


def _name(cls: type) -> str:
    return cls.__qualname__


# The statuses each class was answered with before the codes moved onto the classes
# (status_of's isinstance chain, and server/service.py's special case for Denied),
# plus the two new classes: moving the codes changed none of them.
SENT_AS = {
    "KVStoreError": "INTERNAL",
    "ConfigError": "INTERNAL",
    "InvalidArgument": "INVALID_ARGUMENT",
    "CorruptRecord": "DATA_LOSS",
    "TierError": "INTERNAL",
    "TierUnavailable": "UNAVAILABLE",
    "StoreClosed": "UNAVAILABLE",
    "DeadlineExceeded": "DEADLINE_EXCEEDED",
    "ServerUnavailable": "UNAVAILABLE",
    "Unauthenticated": "UNAUTHENTICATED",
    "PermissionDenied": "PERMISSION_DENIED",
    "NamespaceNotRegistered": "PERMISSION_DENIED",
    "NotFound": "NOT_FOUND",
    "ResourceExhausted": "RESOURCE_EXHAUSTED",
    "ChunkTooLarge": "RESOURCE_EXHAUSTED",
    "WrongRole": "INTERNAL",  # the connector: a method of the other half (a bug)
    "ServerError": "INTERNAL",
    "LeaseError": "NOT_FOUND",
    "Denied": "PERMISSION_DENIED",
    "CLIError": "INTERNAL",
    "StartError": "INTERNAL",
    "Refused": "INTERNAL",  # L3 refused a command: a TierError of the remote tier
    "ForgedRecord": "DATA_LOSS",  # L3's record without a valid MAC: a CorruptRecord
}


def test_the_code_names_are_grpcs() -> None:
    names = {c.name for c in grpc.StatusCode} - {"OK"}
    assert set(get_args(errors.Code)) == names, "errors.Code must list grpc.StatusCode, OK aside"


@pytest.mark.parametrize("cls", CORE, ids=_name)
def test_every_core_error_declares_its_own_code(cls: type[errors.KVStoreError]) -> None:
    assert "code" in vars(cls), f"{cls.__name__} must say which status it is sent with"


@pytest.mark.parametrize("cls", ALL, ids=_name)
def test_status_of_sends_each_error_with_its_code(cls: type[errors.KVStoreError]) -> None:
    assert _name(cls) in SENT_AS, f"{cls.__name__} is new: add the status it must be sent with"
    code, message = status_of(cls("it broke"))
    assert code.name == cls.code == SENT_AS[_name(cls)], (
        f"{cls.__name__} is sent as {code.name}, declares {cls.code}, "
        f"was sent as {SENT_AS[_name(cls)]}"
    )
    assert message == "it broke"


def test_an_unexpected_exception_is_internal_and_says_where_to_look() -> None:
    code, message = status_of(RuntimeError("bug"))
    assert code is grpc.StatusCode.INTERNAL
    assert "RuntimeError: bug" in message and "server log" in message


@pytest.mark.parametrize("cls", ALL, ids=_name)
def test_the_client_raises_an_error_of_the_same_code(cls: type[errors.KVStoreError]) -> None:
    exc = cls("it broke")
    code, message = status_of(exc)
    trailers = dict(error_trailers(exc))
    got = error_from_status(
        code, f"Put: {message}", "Put", "unix:///x", reason=trailers.get(ERROR_REASON_HEADER, "")
    )
    assert type(got).code == cls.code, f"{cls.__name__} came back as {type(got).__name__}"
    if cls in errors._CLIENT_CLASSES or cls.reason:
        assert type(got) is cls, f"{cls.__name__} came back as {type(got).__name__}"
    assert "it broke" in str(got), str(got)


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c.name != "OK"], ids=str)
def test_each_code_maps_to_a_class_that_is_sent_with_it_or_a_server_error(
    code: grpc.StatusCode,
) -> None:
    cls = type(error_from_status(code, "x", "Put", "unix:///x"))
    aliases = {"OUT_OF_RANGE", "CANCELLED"}  # codes no kvstore error is sent with
    assert cls.code == code.name or cls is errors.ServerError or code.name in aliases, (
        f"{code.name} is raised as {cls.__name__} ({cls.code})"
    )


def test_permission_denied_is_not_unauthenticated() -> None:
    denied = error_from_status(grpc.StatusCode.PERMISSION_DENIED, "no", "List", "t")
    unauth = error_from_status(grpc.StatusCode.UNAUTHENTICATED, "no", "List", "t")
    assert type(denied) is errors.PermissionDenied, type(denied)
    assert type(unauth) is errors.Unauthenticated, type(unauth)
    # two refusals apart: a better token would not help with PERMISSION_DENIED
    assert not isinstance(denied, errors.Unauthenticated)


def test_a_reason_names_its_class_only_with_its_code() -> None:
    reason = errors.NamespaceNotRegistered.reason
    assert (
        type(error_from_status(grpc.StatusCode.PERMISSION_DENIED, "x", "Put", "t", reason=reason))
        is errors.NamespaceNotRegistered
    )
    assert (
        type(error_from_status(grpc.StatusCode.INTERNAL, "x", "Put", "t", reason=reason))
        is errors.ServerError
    ), "a reason must not override the code it came with"
    assert error_trailers(errors.PermissionDenied("x")) == ()
    assert error_trailers(RuntimeError("x")) == ()


def test_deadline_exceeded_is_not_a_tier_error() -> None:
    # Tier failures are caught as TierError by the store; a client's deadline is not one.
    assert not issubclass(errors.DeadlineExceeded, errors.TierError)
    assert issubclass(errors.DeadlineExceeded, errors.KVStoreError)


# -- against a real server with tenants ----------------------------------------------------

ADMIN, ALPHA, BETA = "admin-s3cret", "alpha-s3cret", "beta-s3cret"


@pytest.fixture
def tenants_server(tmp_path: Path) -> Iterator[KVServer]:
    (tmp_path / "tenants").write_text(f"alpha:{ALPHA}\nbeta:{BETA}\n")
    srv = KVServer(
        tmp_path, "tenants", args=["--token", ADMIN, "--tenant-tokens", str(tmp_path / "tenants")]
    )
    try:
        yield srv.start()
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            assert srv.stop() == 0, srv.log()


def _ns(salt: str, tag: str = "errors") -> Namespace:
    return Namespace(model=tag, dtype="bfloat16", layout="t", salt=salt)


def _raises(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except errors.KVStoreError as e:
        return e
    raise AssertionError("the call was allowed")


def test_tenant_server_tells_permission_denied_from_unauthenticated(
    tenants_server: KVServer,
) -> None:
    url = tenants_server.unix_url
    data = payload(16 * 64, 5)
    with (
        kvstore.Client(url, token="wrong-token") as stranger,
        kvstore.Client(url, token=ALPHA) as a,
        kvstore.Client(url, token=BETA) as b,
    ):
        e = _raises(lambda: stranger.lookup(_ns("alpha"), tokens(16, 1)))
        assert type(e) is errors.Unauthenticated, f"{type(e).__name__}: {e}"

        e = _raises(lambda: a.lookup(_ns(""), tokens(16, 1)))  # no tenant salt
        assert type(e) is errors.PermissionDenied, f"{type(e).__name__}: {e}"
        e = _raises(lambda: a.clear(all=True))
        assert type(e) is errors.PermissionDenied, f"{type(e).__name__}: {e}"

        # A put into a namespace alpha has not proved: the dedicated class, on the wire
        # as PERMISSION_DENIED with the reason in the trailing metadata.
        ns = _ns("alpha")
        header = chunk_header(ns, ROOT, tokens(16, 2), data, "bfloat16", (16, 32))
        e = _raises(lambda: a.put(header, data))
        assert type(e) is errors.NamespaceNotRegistered, f"{type(e).__name__}: {e}"
        # Given only the fingerprint, put_chunk cannot prove the namespace: no retry.
        e = _raises(
            lambda: a.put_chunk(ns.fingerprint, ROOT, tokens(16, 2), data, "bfloat16", (16, 32))
        )
        assert type(e) is errors.NamespaceNotRegistered, f"{type(e).__name__}: {e}"

        # Given the Namespace, put_chunk proves it with a Lookup and retries.
        key, status = a.put_chunk(ns, ROOT, tokens(16, 2), data, "bfloat16", (16, 32))
        assert status is PutStatus.STORED and key == header.key, status
        got = a.get(key)
        assert got is not None and got[1] == data.tobytes()

        # beta cannot prove alpha's namespace: the retry's Lookup is refused.
        e = _raises(lambda: b.put_chunk(ns, ROOT, tokens(16, 3), data, "bfloat16", (16, 32)))
        assert type(e) is errors.PermissionDenied, f"{type(e).__name__}: {e}"


def test_tenant_server_sends_the_reason_in_trailing_metadata(tenants_server: KVServer) -> None:
    ns = _ns("alpha", "errors-raw")
    data = payload(16 * 64, 6)
    header = chunk_header(ns, ROOT, tokens(16, 4), data, "bfloat16", (16, 32))
    with kvstore.Client(tenants_server.unix_url, token=ALPHA) as a:
        stub = pb_grpc.KVStoreStub(a._channel)
        with pytest.raises(grpc.RpcError) as raw:
            stub.List(pb.ListRequest(fingerprint=ns.fingerprint), metadata=a._metadata)
        assert raw.value.code() is grpc.StatusCode.PERMISSION_DENIED, raw.value
        trailers = dict(raw.value.trailing_metadata() or ())
        assert trailers.get(ERROR_REASON_HEADER) == "NAMESPACE_NOT_REGISTERED", trailers
        # A refusal that is not about an unproved namespace carries no reason.
        with pytest.raises(grpc.RpcError) as raw:
            stub.Clear(pb.ClearRequest(all=True), metadata=a._metadata)
        assert raw.value.code() is grpc.StatusCode.PERMISSION_DENIED, raw.value
        assert ERROR_REASON_HEADER not in dict(raw.value.trailing_metadata() or ()), raw.value
        # Once proved, the same List goes through.
        assert a.put_chunk(ns, ROOT, tokens(16, 4), data, "bfloat16", (16, 32))[1] is (
            PutStatus.STORED
        )
        assert header.key in {v.key for v in a.list(ns.fingerprint)}
