"""Tables clients fill: namespace descriptions and tenants' proved namespaces.

Both grow with what clients send. A description is bounded by bytes (a few dozen
lookups with a multi-MiB namespace field once grew the server by hundreds of MiB),
and proved namespaces by tenant (one tenant once filled the shared table, after which
every new namespace of every other tenant was silently not registered).
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from kvstore.server.tenants import MAX_NAMESPACES_PER_TENANT, Tenants

import kvstore
from kvstore.keys import ROOT, Namespace
from kvstore.testing.ports import free_port
from kvstore.testing.server import KVServer

ADMIN, ALPHA, BETA = "admin-s3cret", "alpha-s3cret", "beta-s3cret"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_namespace_descriptions_are_bounded_by_bytes(
    make_server: Callable[..., KVServer], record: Callable[..., Any]
) -> None:
    metrics_port = free_port()
    srv = make_server("names", args=["--no-disk", "--metrics-port", str(metrics_port)]).start()
    assert srv.proc is not None
    toks = np.arange(256, dtype=np.uint32)
    with kvstore.Client(srv.unix_url, shm=False, timeout=30) as c:
        c.lookup(Namespace(model="warm-up", dtype="bfloat16", layout="x"), toks)
        before = _rss_bytes(srv.proc.pid)
        for i in range(40):  # 3 MiB model names, each a namespace of its own
            ns = Namespace(model=f"{i}-" + "m" * (3 << 20), dtype="bfloat16", layout="x")
            assert c.lookup(ns, toks).matched_tokens == 0
        grown = _rss_bytes(srv.proc.pid) - before
        small = Namespace(model="small", dtype="bfloat16", layout="x")
        c.lookup(small, toks)
    record(
        "Bad input",
        "lookups with multi-MiB namespaces",
        "40 lookups, each with a namespace whose model name is 3 MiB (120 MiB described)",
        faults=40,
        requests=41,
        notes=f"server memory grew {grown / 2**20:.0f} MiB",
    )
    assert grown < 48 << 20, f"the server grew {grown / 2**20:.0f} MiB keeping descriptions"
    # Never silently: the operator sees the descriptions refused in the metrics.
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        scraped = r.read().decode()
    figures = dict(re.findall(r'^kvstore_server_table\{name="(\w+)"\} (\S+)$', scraped, re.M))
    assert float(figures.get("namespace_descriptions_too_large", -1)) == 40, figures
    assert 0 < float(figures["namespace_descriptions_bytes"]) < 16 << 20, figures
    assert srv.stop() == 0, srv.log()


def test_one_tenant_cannot_fill_another_tenants_namespaces(record: Callable[..., Any]) -> None:
    """The table itself, in process: alpha proves more namespaces than the whole table once
    held (100,000); beta's new namespace is still registered."""
    t = Tenants({ALPHA: "alpha", BETA: "beta"})
    for i in range(100_001):
        t.prove("alpha", Namespace(model=f"m{i}", dtype="bfloat16", layout="x", salt="alpha"))
    ns_b = Namespace(model="beta-model", dtype="bfloat16", layout="x", salt="beta")
    t.prove("beta", ns_b)
    kept = len(t.owned("alpha"))
    record(
        "Security",
        "one tenant floods the proved-namespace table",
        "tenant alpha proves 100,001 namespaces, then tenant beta proves one",
        faults=100_001,
        requests=100_002,
        notes=f"alpha keeps {kept} (its bound), forgot {t.forgotten}; beta registered: "
        f"{t.owns('beta', ns_b.fingerprint)}",
    )
    assert t.owns("beta", ns_b.fingerprint), "beta's namespace was silently not registered"
    assert kept == MAX_NAMESPACES_PER_TENANT, kept
    assert t.forgotten == 100_001 - MAX_NAMESPACES_PER_TENANT


def test_tenant_over_its_bound_reproves_and_sees_no_paths(
    make_server: Callable[..., KVServer], tmp_path: Path
) -> None:
    """End to end with a bound of 8: alpha's oldest namespace is forgotten, and its next put
    there proves it again by itself (NamespaceNotRegistered, then a lookup); beta is never
    affected; a tenant's Stats carries figures, not the server's paths."""
    tenants = tmp_path / "tenants"
    tenants.write_text(f"alpha:{ALPHA}\nbeta:{BETA}\n")
    srv = make_server(
        "bound",
        args=["--token", ADMIN, "--tenant-tokens", str(tenants), "--chunk-tokens", "16"],
        env={"KVSTORE_MAX_NAMESPACES_PER_TENANT": "8"},
    ).start()
    toks = list(range(16))
    data = np.arange(1024, dtype=np.uint8)

    def ns(i: int, salt: str) -> Namespace:
        return Namespace(model=f"bound-{i}", dtype="bfloat16", layout="t", salt=salt)

    with (
        kvstore.Client(srv.unix_url, token=ALPHA, shm=False) as a,
        kvstore.Client(srv.unix_url, token=BETA, shm=False) as b,
    ):
        b.lookup(ns(0, "beta"), toks)
        for i in range(12):
            a.lookup(ns(i, "alpha"), toks)
        _, first = a.put_chunk(ns(0, "alpha"), ROOT, toks, data, "bfloat16", (16, 32))
        _, theirs = b.put_chunk(ns(0, "beta"), ROOT, toks, data, "bfloat16", (16, 32))
        details = [t.detail for t in a.stats().tiers]
    assert first.ok, f"alpha's put into its forgotten namespace was not re-proved: {first}"
    assert theirs.ok, f"beta's put failed: {theirs}"
    leaked = [(k, v) for d in details for k, v in d.items() if isinstance(v, str)]
    assert not leaked, f"a tenant's Stats shows the operator's settings: {leaked}"
    assert srv.stop() == 0, srv.log()
