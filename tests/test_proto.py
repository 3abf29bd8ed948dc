"""The checked-in gRPC stubs match proto/ and import with the installed runtime."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_proto.py"


def _run(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_stubs_match_proto() -> None:
    done = _run(SCRIPT)
    assert done.returncode == 0, f"generated stubs are stale:\n{done.stdout}\n{done.stderr}"


def test_check_fails_on_stale_stubs(tmp_path: Path) -> None:
    """--check must catch a contract change that was not regenerated."""
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "gen_proto.py")
    shutil.copytree(
        ROOT / "kvstore" / "v1",
        tmp_path / "kvstore" / "v1",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    proto = tmp_path / "proto" / "kvstore" / "v1" / "kvstore.proto"
    proto.write_text(
        proto.read_text().replace(
            "message InfoRequest {}", "message InfoRequest { bool verbose = 1; }"
        )
    )
    done = _run(tmp_path / "scripts" / "gen_proto.py")
    assert done.returncode == 1, f"check passed on a stale stub: {done.stdout}{done.stderr}"
    assert "do not match proto/" in done.stderr, done.stderr


def test_stubs_import() -> None:
    from kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc

    req = kvstore_pb2.PutRequest(header=b"h")
    assert kvstore_pb2.PutRequest.FromString(req.SerializeToString()).header == b"h"
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub"), "service stub missing"
    names = [m.name for m in kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods]
    assert "Session" in names and "Lookup" in names, names
