"""A client that stores a chunk, holds a read lease on it and a reservation for
another, says "ready" and waits to be killed: what tests kill to check that a dead
client's leases and pages come back.

    python -m tests.server.holder URL CHUNK_TOKENS BYTES_PER_TOKEN TAG
"""

from __future__ import annotations

import sys
import time

import kvstore
from kvstore.keys import ROOT
from kvstore.v1 import kvstore_pb2 as pb
from tests.server.helpers import chunk_header_for, namespace, payload, shape_for, tokens


def command(url: str, chunk_tokens: int, bytes_per_token: int, tag: str) -> list[str]:
    """The command line that runs a holder against the server at ``url``."""
    return [
        sys.executable,
        "-m",
        "tests.server.holder",
        url,
        str(chunk_tokens),
        str(bytes_per_token),
        tag,
    ]


def main(url: str, chunk_tokens: int, bytes_per_token: int, tag: str) -> None:
    c = kvstore.Client(url, shm=True)
    ns = namespace(tag, bytes_per_token)
    key, status = c.put_chunk(
        ns,
        ROOT,
        tokens(chunk_tokens, 77),
        payload(chunk_tokens * bytes_per_token, 1),
        "bfloat16",
        shape_for(chunk_tokens, bytes_per_token),
    )
    assert status.ok, status
    assert c.acquire(key) is not None
    other = chunk_header_for(ns, tokens(chunk_tokens, 78), bytes_per_token, seed=2)
    r = c._stub.Reserve(pb.ReserveRequest(header=other.pack()), metadata=c._metadata)
    assert r.status == pb.STORED, r
    # Killed before the server saw the Session, its holds would only expire (lease_ms).
    assert c.session_up.wait(30), "the server never answered the Session stream"
    print("ready", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
