"""Bearer tokens, TLS, and refusing to serve a non-loopback address without a token."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kvstore
from kvstore.errors import ServerUnavailable, Unauthenticated
from kvstore.keys import ROOT
from kvstore.testing.server import KVServer, clean_env
from kvstore.types import PutStatus
from tests.server.helpers import namespace, payload, tokens


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost / 127.0.0.1 and its key (PEM files)."""
    key_path, cert_path = directory / "server.key", directory / "server.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=DNS:localhost,IP:127.0.0.1",
                "-keyout",
                str(key_path),
                "-out",
                str(cert_path),
            ],
            check=True,
            capture_output=True,
        )
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _round_trip(c: kvstore.Client, tag: str) -> None:
    ns = namespace(tag, 64)
    data = payload(16 * 64, 21)
    key, status = c.put_chunk(ns, ROOT, tokens(16, 3), data, "bfloat16", (16, 32))
    assert status == PutStatus.STORED, status
    got = c.get(key)
    assert got is not None and got[1] == data.tobytes(), f"{tag}: round trip failed"


def test_token_auth(make_server: Callable[..., KVServer], tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    srv = make_server("auth", args=["--token-file", str(token_file)]).start()

    with kvstore.Client(srv.tcp_url) as anonymous:
        assert anonymous.health(), "health checks must stay open without a token"
        with pytest.raises(Unauthenticated, match="missing bearer token"):
            anonymous.info()
    with kvstore.Client(srv.unix_url, token="wrong") as wrong:
        with pytest.raises(Unauthenticated, match="wrong bearer token"):
            wrong.stats()
        with pytest.raises(Unauthenticated):
            _round_trip(wrong, "auth-wrong")
    for url, shm in ((srv.unix_url, True), (srv.tcp_url, False)):
        with kvstore.Client(url, token="s3cret-token", shm=shm) as good:
            assert good.info().auth_required is True
            _round_trip(good, f"auth-{shm}")
            assert good.shm_active is shm

    # The SDK reads KVSTORE_TOKEN like the server does.
    code = "import kvstore; c = kvstore.Client(); print(c.info().auth_required); c.close()"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env({"KVSTORE_TOKEN": "s3cret-token", "KVSTORE_URL": srv.tcp_url}),
    )
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert srv.stop() == 0, srv.log()


def test_tls(make_server: Callable[..., KVServer], tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    srv = make_server("tls", args=["--tls-cert", str(cert), "--tls-key", str(key)]).start()
    url = f"grpcs://127.0.0.1:{srv.port}"
    with kvstore.Client(url, tls_ca=str(cert), shm=False) as c:
        _round_trip(c, "tls")
    with kvstore.Client(f"grpcs://localhost:{srv.port}", tls_ca=cert.read_bytes()) as c:
        assert c.info().server_version
    with kvstore.Client(srv.tcp_url) as plain, pytest.raises(ServerUnavailable):
        plain.info(timeout=5)  # plaintext to a TLS port
    with kvstore.Client(url, shm=False) as untrusted, pytest.raises(ServerUnavailable):
        untrusted.info(timeout=5)  # the self-signed certificate is not trusted by default
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--listen", "0.0.0.0:0"], "not a loopback address and no token is set"),
        (["--tls-cert", "/nonexistent.pem"], "TLS needs both tls_cert and tls_key"),
        (["--token", "a", "--token-file", "b"], "not both"),
        (["--memory-capacity", "lots"], "is not a size"),
    ],
)
def test_refuses_unsafe_or_bad_config(tmp_path: Path, args: list[str], message: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvstore.server.main",
        "--unix-socket",
        "",
        "--data-dir",
        str(tmp_path / "d"),
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=clean_env())
    assert done.returncode == 2, f"expected exit 2, got {done.returncode}: {done.stderr}"
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "d").exists(), "a refused server must not touch its data dir"
