"""Security under attack: every RPC without or with a wrong token, TLS, and tenants that pry.

Builds on tests/server/test_security.py (token, TLS with a self-made certificate,
plaintext to a TLS port, unsafe configs refused) by sending every RPC of the
service without a token and with a wrong one, and adds tenants (server/tenants.py):
tenant "beta", knowing tenant "alpha"'s chunk keys and namespace fingerprint,
tries every way to read, list, look up, overwrite, pin, delete or clear them.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import kvstore
from kvstore.errors import KVStoreError, PermissionDenied, ServerUnavailable
from kvstore.keys import ROOT, ChunkKey, Namespace, chunk_key, tokens_to_bytes
from kvstore.protocol import SERVICE_NAME
from kvstore.sdk.client import chunk_header
from kvstore.testing.mix import payload_for
from kvstore.testing.server import KVServer
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.server.test_security import _self_signed

ADMIN, ALPHA, BETA = "admin-s3cret", "alpha-s3cret", "beta-s3cret"
METHODS = [
    (m.name, m.client_streaming, m.server_streaming)
    for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods
]


@pytest.fixture
def secured(make_server: Callable[..., KVServer], tmp_path: Path) -> tuple[KVServer, Path]:
    cert, key = _self_signed(tmp_path)
    tenants = tmp_path / "tenants"
    tenants.write_text(f"# tenant:token\nalpha:{ALPHA}\n\nbeta:{BETA}\n")
    srv = make_server(
        "secure",
        args=[
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--token",
            ADMIN,
            "--tenant-tokens",
            str(tenants),
            "--chunk-tokens",
            "16",
            "--granularity",
            "4",
        ],
    ).start()
    return srv, cert


def _raw_call(
    channel: grpc.Channel, name: str, cs: bool, ss: bool, metadata: tuple[tuple[str, str], ...]
) -> grpc.StatusCode:
    path = f"/{SERVICE_NAME}/{name}"
    kw: dict[str, Any] = {"request_serializer": None, "response_deserializer": None}
    make = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(cs, ss)]
    fn = make(path, **kw)
    req: Any = iter([b""]) if cs else b""
    try:
        out = fn(req, timeout=10, metadata=metadata)
        if ss:
            list(out)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_every_rpc_refuses_missing_and_wrong_tokens_over_tls(
    secured: tuple[KVServer, Path], record: Callable[..., Any]
) -> None:
    srv, cert = secured
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    refused, accepted, leaks = 0, 0, []
    with (
        grpc.secure_channel(f"localhost:{srv.port}", creds) as tls,
        grpc.insecure_channel(f"unix:{srv.socket}") as unix,
    ):
        for channel in (tls, unix):
            for name, cs, ss in METHODS:
                for meta in (
                    (),
                    (("authorization", "Bearer nope"),),
                    (("authorization", f"Bearer {ADMIN}x"),),
                    (("authorization", ADMIN),),
                ):
                    code = _raw_call(channel, name, cs, ss, meta)
                    if code == grpc.StatusCode.UNAUTHENTICATED:
                        refused += 1
                    else:
                        leaks.append(f"{name} with {meta}: {code.name}")
            accepted += (
                _raw_call(channel, "Info", False, False, (("authorization", f"Bearer {ADMIN}"),))
                == grpc.StatusCode.OK
            )
    with kvstore.Client(f"grpcs://127.0.0.1:{srv.port}", tls_ca=str(cert), token=ADMIN) as c:
        ns = Namespace(model="faults-sec", dtype="bfloat16", layout="tls")
        key, status = c.put_chunk(
            ns, ROOT, list(range(16)), np.arange(1024, dtype=np.uint8), "bfloat16", (16, 32)
        )
        got = c.get(key)
        tls_ok = status.ok and got is not None and got[1] == bytes(range(256)) * 4
    with kvstore.Client(srv.tcp_url, token=ADMIN) as plain, pytest.raises(ServerUnavailable):
        plain.info(timeout=5)  # plaintext to the TLS port
    with (
        kvstore.Client(f"grpcs://127.0.0.1:{srv.port}", token=ADMIN) as untrusted,
        pytest.raises(ServerUnavailable),
    ):
        untrusted.info(timeout=5)  # the self-made certificate is not trusted by default
    record(
        "Security",
        "missing, wrong or malformed tokens; TLS",
        f"all {len(METHODS)} RPCs without a token, with two wrong tokens and without the "
        "Bearer prefix, over TLS (self-made certificate) and the Unix socket; a round trip "
        "over TLS; plaintext to the TLS port; TLS without trusting the certificate",
        faults=refused + len(leaks) + 2,
        requests=refused + len(leaks) + accepted + 4,
        wrong=len(leaks) + (0 if tls_ok else 1),
        notes=f"{refused} calls refused with UNAUTHENTICATED; plaintext and untrusted TLS refused",
    )
    assert not leaks, leaks
    assert accepted == 2 and tls_ok
    assert srv.stop() == 0, srv.log()


def _chunks(c: kvstore.Client, ns: Namespace, n: int, start: int) -> list[ChunkKey]:
    keys, parent = [], ROOT
    for i in range(n):
        toks = list(range(start + 16 * i, start + 16 * i + 16))
        key = chunk_key(parent, ns.fingerprint, tokens_to_bytes(toks))
        got, status = c.put_chunk(ns, parent, toks, payload_for(key, 1024), "bfloat16", (16, 32))
        assert status.ok and got == key, status
        keys.append(key)
        parent = key
    return keys


def test_tenants_cannot_reach_each_other(
    secured: tuple[KVServer, Path], record: Callable[..., Any]
) -> None:
    srv, cert = secured
    url = f"grpcs://localhost:{srv.port}"
    ns_a = Namespace(model="faults-sec", dtype="bfloat16", layout="t", salt="alpha")
    ns_a2 = Namespace(model="faults-sec", dtype="bfloat16", layout="t", salt="alpha|user-7")
    ns_b = Namespace(model="faults-sec", dtype="bfloat16", layout="t", salt="beta")
    prompt = list(range(1000, 1048))
    attempts, leaked = 0, []

    def expect(what: str, ok: bool) -> None:
        nonlocal attempts
        attempts += 1
        if not ok:
            leaked.append(what)

    def denied(what: str, fn: Callable[[], Any], exc: type[Exception] = PermissionDenied) -> None:
        try:
            fn()
        except exc:
            expect(what, True)
            return
        except KVStoreError as e:
            expect(f"{what}: {type(e).__name__}: {e}", False)
            return
        expect(f"{what}: allowed", False)

    with (
        kvstore.Client(url, tls_ca=str(cert), token=ALPHA) as a,
        kvstore.Client(url, tls_ca=str(cert), token=BETA) as b,
        kvstore.Client(srv.unix_url, token=ADMIN) as admin,
    ):
        assert not a.shm_active and a.info().shm_path == "", "tenants get no shared memory"
        # L2's file holds every tenant's records: a loan of it would read them all.
        assert a.info().disk_path == "", "tenants are not lent L2's file"
        keys_a = _chunks(a, ns_a, 3, 1000)  # put_chunk proves the namespace by itself
        keys_a2 = _chunks(a, ns_a2, 1, 5000)
        keys_b = _chunks(b, ns_b, 3, 1000)  # the same tokens: other keys, other namespace
        assert not set(keys_a) & set(keys_b)
        fp_a = ns_a.fingerprint
        stub = pb_grpc.KVStoreStub(b._channel)
        meta = b._metadata

        # beta knows alpha's keys and fingerprint; nothing of alpha's may come back.
        for k in keys_a + keys_a2:
            expect("get", b.get(k) is None)
            expect("get_into", b.get_into(k, bytearray(2048)) is None)
        expect("exists", b.exists(keys_a) == [()] * 3)
        expect("pin", b.pin(keys_a) == 0)
        expect("delete", b.delete(keys_a) == 0)
        expect("list all", not {v.key for v in b.list()} & set(keys_a + keys_a2))
        expect("namespaces", fp_a not in {n.fingerprint for n in b.namespaces()})
        expect("stats", b.stats().chunks == 3)
        denied("list alpha", lambda: list(b.list(fp_a)))
        denied("lookup alpha by fingerprint", lambda: b.lookup(fp_a, prompt))
        denied("lookup alpha's namespace", lambda: b.lookup(ns_a, prompt))
        denied(
            "lookup without the beta salt",
            lambda: b.lookup(Namespace(model="faults-sec", dtype="bfloat16", layout="t"), prompt),
        )
        denied(
            "lookup with salt alphabet",
            lambda: b.lookup(
                Namespace(model="faults-sec", dtype="bfloat16", layout="t", salt="alphabet"), prompt
            ),
        )
        expect(
            "explain",
            all(
                m.fingerprint != fp_a for m in b.lookup(ns_b, prompt, explain=True).other_namespaces
            ),
        )
        denied("clear alpha", lambda: b.clear(fp_a))
        denied("clear all", lambda: b.clear(all=True))
        toks = list(range(9000, 9016))
        forged = chunk_header(ns_a, ROOT, toks, payload_for(b"x" * 32, 1024), "bfloat16", (16, 32))
        denied("put into alpha's namespace", lambda: b.put(forged, payload_for(b"x" * 32, 1024)))
        denied(
            "put_chunk into alpha's namespace",
            lambda: b.put_chunk(
                ns_a, keys_a[-1], toks, payload_for(b"y" * 32, 1024), "bfloat16", (16, 32)
            ),
        )
        for name, req in (
            (
                "reserve",
                lambda: stub.Reserve(pb.ReserveRequest(header=forged.pack()), metadata=meta),
            ),
            ("acquire", lambda: stub.Acquire(pb.AcquireRequest(key=keys_a[0]), metadata=meta)),
        ):
            try:
                req()
                expect(f"{name}: allowed", False)
            except grpc.RpcError as e:
                expect(f"{name}: {e.code().name}", e.code() == grpc.StatusCode.FAILED_PRECONDITION)

        # alpha still has everything, byte for byte; the admin sees both tenants.
        for k in keys_a + keys_a2:
            got = a.get(k)
            expect(
                "alpha reads its own", got is not None and got[1] == payload_for(k, 1024).tobytes()
            )
        expect("alpha looks up", a.lookup(ns_a, prompt).matched_tokens == 48)
        expect("admin sees all", {*keys_a, *keys_b} <= {v.key for v in admin.list()})

    # After a restart nothing is known as alpha's until alpha proves it again.
    srv.stop(signal.SIGTERM)
    srv.start()
    with (
        kvstore.Client(url, tls_ca=str(cert), token=ALPHA) as a,
        kvstore.Client(url, tls_ca=str(cert), token=BETA) as b,
    ):
        expect("beta after restart", b.get(keys_a[0]) is None)
        denied("beta lookup after restart", lambda: b.lookup(ns_a, prompt))
        expect("alpha before proving", a.get(keys_a[0]) is None)
        expect("alpha proves", a.lookup(ns_a, prompt).matched_tokens == 48)
        got = a.get(keys_a[0])
        expect(
            "alpha after proving",
            got is not None and got[1] == payload_for(keys_a[0], 1024).tobytes(),
        )
        expect("beta still nothing", b.get(keys_a[0]) is None and b.exists(keys_a) == [()] * 3)
        lost = sum(a.get(k) is None for k in keys_a)
    record(
        "Security",
        "tenants",
        "tenant beta, knowing tenant alpha's chunk keys and fingerprint, tries get, get_into, "
        "exists, pin, delete, list, namespaces, stats, lookup (by fingerprint, with alpha's "
        "namespace, with other salts, explain), clear, put and put_chunk into alpha's "
        "namespace, reserve, acquire; then a restart",
        faults=attempts,
        requests=attempts,
        lost=lost,
        wrong=len(leaked),
        notes="every attempt refused or answered as a miss; alpha reads its own byte for "
        "byte; after a restart a namespace is reachable once its tenant proves it",
    )
    assert not leaked, leaked
    assert lost == 0
    assert srv.stop() == 0, srv.log()


def test_tenant_tokens_file_is_validated(tmp_path: Path) -> None:
    import subprocess
    import sys

    from kvstore.testing.server import clean_env

    for text, message in (
        ("alpha\n", "expected tenant:token"),
        ("al pha:t\n", "must be 1-64"),
        ("a:t\nb:t\n", "tokens must be unique"),
        ("# nothing\n", "names no tenant"),
    ):
        f = tmp_path / "tenants"
        f.write_text(text)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvstore.server.main",
                "--unix-socket",
                "",
                "--listen",
                "127.0.0.1:0",
                "--data-dir",
                str(tmp_path / "d"),
                "--tenant-tokens",
                str(f),
            ],
            capture_output=True,
            text=True,
            timeout=30,
            env=clean_env(),
        )
        assert done.returncode == 2, (text, done.returncode, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
