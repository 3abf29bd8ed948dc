"""Bad requests get the right gRPC status and a message saying what was wrong; the server lives."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

import kvstore
from kvstore.errors import InvalidArgument
from kvstore.keys import ROOT
from kvstore.records import make_header
from kvstore.testing.ports import free_port
from kvstore.testing.server import KVServer
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.server.helpers import chunk_header_for, namespace, payload, tokens

C = grpc.StatusCode
MiB = 1 << 20


@pytest.fixture(scope="module")
def stub(server: KVServer) -> Iterator[pb_grpc.KVStoreStub]:
    opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=opts) as channel:
        yield pb_grpc.KVStoreStub(channel)


def _status(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "SerializeToString"):
            list(result)  # streaming responses fail while iterating
    return e.value.code(), e.value.details() or ""


def _put(stub: pb_grpc.KVStoreStub, *messages: pb.PutRequest) -> Callable[[], Any]:
    return lambda: stub.Put(iter(messages), timeout=10)


NS = namespace("bad", 64)
HEADER = chunk_header_for(NS, tokens(16, 1), 64, seed=1)  # stored before the bad requests
DATA = payload(16 * 64, 1).tobytes()
# Never stored: the server reads the payload of a new chunk (it answers EXISTS at once).
FRESH = chunk_header_for(NS, tokens(16, 100), 64, seed=1).pack()


def _cases(stub: pb_grpc.KVStoreStub) -> list[tuple[str, Callable[[], Any], grpc.StatusCode, str]]:
    bad_fp = b"\x01" * 5
    huge = make_header(
        key=HEADER.key,
        parent=ROOT,
        fingerprint=NS.fingerprint,
        token_bytes=HEADER.token_bytes,
        dtype="bfloat16",
        shape=(16, 10 * MiB),
        stored_size=16 * 20 * MiB,
        payload_checksum=0,
    )
    wrong_shape = chunk_header_for(NS, tokens(16, 2), 128, seed=2)  # 128 B/token, ns holds 64
    corrupted = bytearray(HEADER.pack())
    corrupted[40] ^= 0xFF
    return [
        (
            "garbage header",
            _put(stub, pb.PutRequest(header=b"not a header at all")),
            C.INVALID_ARGUMENT,
            "malformed record header",
        ),
        (
            "flipped header byte",
            _put(stub, pb.PutRequest(header=bytes(corrupted))),
            C.INVALID_ARGUMENT,
            "header checksum",
        ),
        ("data first", _put(stub, pb.PutRequest(data=DATA)), C.INVALID_ARGUMENT, "first message"),
        ("empty put", _put(stub), C.INVALID_ARGUMENT, "first message"),
        (
            "payload too long",
            _put(
                stub,
                pb.PutRequest(header=FRESH),
                pb.PutRequest(data=DATA),
                pb.PutRequest(data=b"x"),
            ),
            C.INVALID_ARGUMENT,
            "runs past",
        ),
        (
            "payload too short",
            _put(stub, pb.PutRequest(header=FRESH), pb.PutRequest(data=DATA[:-1])),
            C.INVALID_ARGUMENT,
            "header declares",
        ),
        (
            "two headers",
            _put(stub, pb.PutRequest(header=FRESH), pb.PutRequest(header=FRESH)),
            C.INVALID_ARGUMENT,
            "only the first",
        ),
        (
            "checksum",
            _put(stub, pb.PutRequest(header=FRESH), pb.PutRequest(data=bytes(reversed(DATA)))),
            C.DATA_LOSS,
            "checksum mismatch",
        ),
        (
            "over max_chunk_bytes",
            _put(stub, pb.PutRequest(header=huge.pack())),
            C.RESOURCE_EXHAUSTED,
            "max_chunk_bytes",
        ),
        (
            "message over max_message_bytes",
            _put(stub, pb.PutRequest(header=FRESH), pb.PutRequest(data=b"\0" * 5 * MiB)),
            C.RESOURCE_EXHAUSTED,
            "",
        ),
        (
            "wrong layout",
            _put(
                stub,
                pb.PutRequest(header=wrong_shape.pack()),
                pb.PutRequest(data=payload(16 * 128, 2).tobytes()),
            ),
            C.INVALID_ARGUMENT,
            "bytes per token",
        ),
        (
            "reserve garbage",
            lambda: stub.Reserve(pb.ReserveRequest(header=b"\0" * 200)),
            C.INVALID_ARGUMENT,
            "malformed",
        ),
        (
            "reserve_many over the batch limit",
            lambda: stub.ReserveMany(
                pb.ReserveManyRequest(requests=[pb.ReserveRequest(header=FRESH)] * 1025)
            ),
            C.INVALID_ARGUMENT,
            "at most 1024",
        ),
        (
            "reserve_many with one garbage header",
            lambda: stub.ReserveMany(
                pb.ReserveManyRequest(
                    requests=[pb.ReserveRequest(header=FRESH), pb.ReserveRequest(header=b"\0" * 9)]
                )
            ),
            C.INVALID_ARGUMENT,
            "malformed",
        ),
        (
            "commit_many over the batch limit",
            lambda: stub.CommitMany(
                pb.CommitManyRequest(commits=[pb.CommitRequest(reservation_id=1)] * 1025)
            ),
            C.INVALID_ARGUMENT,
            "at most 1024",
        ),
        (
            "commit unknown",
            lambda: stub.Commit(pb.CommitRequest(reservation_id=424242)),
            C.NOT_FOUND,
            "unknown reservation",
        ),
        (
            "abort unknown",
            lambda: stub.Abort(pb.AbortRequest(reservation_id=424243)),
            C.NOT_FOUND,
            "unknown reservation",
        ),
        (
            "release unknown",
            lambda: stub.Release(pb.ReleaseRequest(lease_ids=[7, 8])),
            C.NOT_FOUND,
            "unknown lease",
        ),
        (
            "get short key",
            lambda: stub.Get(pb.GetRequest(key=b"abc")),
            C.INVALID_ARGUMENT,
            "chunk keys are 32",
        ),
        (
            "acquire short key",
            lambda: stub.Acquire(pb.AcquireRequest(key=b"")),
            C.INVALID_ARGUMENT,
            "chunk keys are 32",
        ),
        (
            "exists short key",
            lambda: stub.Exists(pb.ExistsRequest(keys=[b"\0" * 32, b"x"])),
            C.INVALID_ARGUMENT,
            "key #1",
        ),
        (
            "lookup garbage fingerprint",
            lambda: stub.Lookup(pb.LookupRequest(fingerprint=bad_fp, token_ids=b"\0" * 8)),
            C.INVALID_ARGUMENT,
            "fingerprint is 5 bytes",
        ),
        (
            "lookup odd token bytes",
            lambda: stub.Lookup(pb.LookupRequest(fingerprint=NS.fingerprint, token_ids=b"\0" * 7)),
            C.INVALID_ARGUMENT,
            "multiple of 4",
        ),
        (
            "lookup by keys and ids",
            lambda: stub.Lookup(
                pb.LookupRequest(
                    fingerprint=NS.fingerprint,
                    token_ids=b"\0" * 4,
                    chunk_keys=b"\0" * 32,
                    n_tokens=1,
                )
            ),
            C.INVALID_ARGUMENT,
            "token_ids or chunk_keys, not both",
        ),
        (
            "lookup by keys too few",
            lambda: stub.Lookup(
                pb.LookupRequest(fingerprint=NS.fingerprint, chunk_keys=b"\0" * 32, n_tokens=300)
            ),
            C.INVALID_ARGUMENT,
            "a 300-token prompt in chunks of 256 tokens has 2 keys",
        ),
        (
            "lookup by keys odd sub-hashes",
            lambda: stub.Lookup(
                pb.LookupRequest(
                    fingerprint=NS.fingerprint, chunk_keys=b"\0" * 32, n_tokens=20, sub_hashes=b"x"
                )
            ),
            C.INVALID_ARGUMENT,
            "sub_hashes is 1 bytes; a 20-token prompt has 8",
        ),
        (
            "lookup by keys with explain",
            lambda: stub.Lookup(
                pb.LookupRequest(
                    fingerprint=NS.fingerprint, chunk_keys=b"\0" * 32, n_tokens=16, explain=True
                )
            ),
            C.INVALID_ARGUMENT,
            "explain needs token_ids",
        ),
        (
            "lookup namespace mismatch",
            lambda: stub.Lookup(
                pb.LookupRequest(fingerprint=NS.fingerprint, namespace=pb.Namespace(model="other"))
            ),
            C.INVALID_ARGUMENT,
            "does not match fingerprint",
        ),
        (
            "lookup invalid namespace",
            lambda: stub.Lookup(
                pb.LookupRequest(fingerprint=NS.fingerprint, namespace=pb.Namespace(model=""))
            ),
            C.INVALID_ARGUMENT,
            "model",
        ),
        ("clear nothing", lambda: stub.Clear(pb.ClearRequest()), C.INVALID_ARGUMENT, "all=true"),
        (
            "clear garbage fingerprint",
            lambda: stub.Clear(pb.ClearRequest(fingerprint=bad_fp)),
            C.INVALID_ARGUMENT,
            "fingerprint",
        ),
        (
            "list page token",
            lambda: stub.List(pb.ListRequest(page_token="zz")),
            C.INVALID_ARGUMENT,
            "page_token",
        ),
        (
            "list page size",
            lambda: stub.List(pb.ListRequest(page_size=5000)),
            C.INVALID_ARGUMENT,
            "page_size",
        ),
        (
            "session without owner",
            lambda: stub.Session(iter([pb.SessionPing()])),
            C.INVALID_ARGUMENT,
            "owner",
        ),
    ]


def test_bad_requests_get_proper_statuses(server: KVServer, stub: pb_grpc.KVStoreStub) -> None:
    # Seed the namespace's layout (64 bytes per token) so a wrong shape is detectable.
    with kvstore.Client(server.tcp_url, shm=False) as c:
        assert c.put(HEADER, DATA).ok
        held = c.stats().tiers[0].detail["reservations"]
    failures = []
    for name, call, code, message in _cases(stub):
        got_code, details = _status(call)
        if got_code != code or message not in details:
            failures.append(
                f"{name}: got {got_code.name} {details!r}, want {code.name} containing {message!r}"
            )
    assert not failures, "\n".join(failures)

    with kvstore.Client(server.tcp_url, shm=False) as c:
        assert c.health(), "server died after bad requests"
        assert c.stats().tiers[0].detail["reservations"] == held, (
            "a refused ReserveMany must not keep the reservations made before the bad one"
        )
        got = c.get(HEADER.key)
        assert got is not None and got[1] == DATA, "server state damaged by bad requests"
        with pytest.raises(InvalidArgument, match="chunk keys are 32"):
            c.exists([b"short"])  # the SDK maps INVALID_ARGUMENT
        with pytest.raises(InvalidArgument, match="fingerprint"):
            c.lookup(b"\0" * 3, [1, 2, 3])  # caught before the call
        counts = c.stats()
        assert counts.chunks >= 1


def test_shm_disabled(make_server: Callable[..., KVServer]) -> None:
    metrics_port = free_port()
    srv = make_server(
        "noshm", args=["--no-shm", "--log-format", "json", "--metrics-port", str(metrics_port)]
    ).start()
    with kvstore.Client(srv.unix_url) as c:
        assert c.info().shm_path == "" and not c.shm_active
        stub = pb_grpc.KVStoreStub(c._channel)
        code, details = _status(lambda: stub.Reserve(pb.ReserveRequest(header=HEADER.pack())))
        assert code == C.FAILED_PRECONDITION and "disabled" in details, (code, details)
        with pytest.raises(kvstore.errors.KVStoreError, match="shm=True"):
            kvstore.Client(srv.unix_url, shm=True).put(HEADER, DATA)
        assert c.put(HEADER, DATA).ok, "streaming must still work"
        assert c.get(HEADER.key) is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for needle in (
        'kvstore_rpcs_total{code="OK",method="Put"} 1.0',
        'kvstore_rpc_latency_seconds_count{method="Get"} 1.0',
        'kvstore_tier_hits_total{tier="memory"}',
        'kvstore_tier_used_bytes{tier="disk"}',
        'kvstore_payload_bytes_total{direction="in",plane="grpc"} 1024.0',
    ):
        assert needle in text, f"metrics lack {needle!r}:\n{text[:3000]}"
    assert srv.stop() == 0
    import json

    lines = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    assert any(rec.get("msg", "").startswith("stopped") for rec in lines), srv.log()
    final = [rec for rec in lines if "requests" in rec][-1]
    assert final["requests"].get("Put", 0) >= 1, final
    assert final["requests"].get("Reserve:FAILED_PRECONDITION", 0) == 1, final
