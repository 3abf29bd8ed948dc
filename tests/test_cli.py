"""The ``kvstore`` CLI against a real kvstore-server process.

One server per module (free port, Unix socket and data dir in a tmp dir, 64 MiB
of L1). Chunks are put with the SDK. ``cli`` runs the CLI as a subprocess (the
installed console script when there is one), exactly as a user runs it, and its
stdout, stderr and exit status are checked; ``call`` runs the same ``main`` in
this process (no interpreter start and imports: about a second less per call on
this shared machine), for the many checks where the process boundary adds
nothing. Commands that change the store work on namespaces of their own, so the
tests do not depend on their order.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvstore.keys import ROOT, ChunkKey, Namespace
from kvstore.sdk.client import Client
from kvstore.testing.ports import free_port

pytestmark = pytest.mark.timeout(180)

CHUNK_TOKENS = 16
PAYLOAD = 4096  # bytes per chunk: "4.0 KiB" in listings
PROMPT = list(range(1000, 1064))  # four chunks
NS_A = Namespace("cli-model-a", dtype="float16", layout="test")
NS_B = Namespace("cli-model-b", dtype="float16", layout="test")
_SCRIPT = Path(sys.executable).with_name("kvstore")
CLI = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "kvstore.cli.main"]


@dataclass
class Server:
    url: str  # unix:// (same host: shared memory)
    tcp_url: str
    dead_url: str  # nothing listens there
    proc: subprocess.Popen[bytes]
    log: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("cli")
    port = free_port()
    sock = d / "kv.sock"
    log = d / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "kvstore.server.main",
        "--listen",
        f"127.0.0.1:{port}",
        "--unix-socket",
        str(sock),
        "--data-dir",
        str(d / "data"),
        "--memory-capacity",
        "64MiB",
        "--disk-capacity",
        "256MiB",
        "--chunk-tokens",
        str(CHUNK_TOKENS),
        "--granularity",
        "4",
        "--log-level",
        "warning",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    srv = Server(
        f"unix://{sock}", f"grpc://127.0.0.1:{port}", f"grpc://127.0.0.1:{free_port()}", proc, log
    )
    try:
        deadline = time.monotonic() + 30
        with Client(srv.url, timeout=2) as c:
            while not c.health():
                assert proc.poll() is None, f"kvstore-server exited: {log.read_text()}"
                assert time.monotonic() < deadline, f"server not serving: {log.read_text()}"
                time.sleep(0.1)
        yield srv
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def put_chain(client: Client, ns: Namespace, tokens: Sequence[int]) -> list[ChunkKey]:
    """Store every chunk of ``tokens``; a lookup with the Namespace lets the server name it."""
    keys, parent = [], ROOT
    for s in range(0, len(tokens), CHUNK_TOKENS):
        payload = np.full(PAYLOAD, s % 251, dtype=np.uint8)
        parent, status = client.put_chunk(
            ns, parent, tokens[s : s + CHUNK_TOKENS], payload, "float16", (2, PAYLOAD // 4)
        )
        assert status.name in ("STORED", "EXISTS"), f"put of chunk at {s}: {status}"
        keys.append(parent)
    client.lookup(ns, tokens)
    return keys


@pytest.fixture(scope="module")
def stored(server: Server) -> dict[str, list[ChunkKey]]:
    with Client(server.url) as c:
        return {"a": put_chain(c, NS_A, PROMPT), "b": put_chain(c, NS_B, PROMPT)}


def cli(
    server: Server | None, *args: str, url: str | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI; the server comes from KVSTORE_URL (as a user would set it) unless --url."""
    env = dict(os.environ)
    env.pop("KVSTORE_TOKEN", None)
    env["KVSTORE_URL"] = url or (server.url if server else "unix:///nonexistent/kv.sock")
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )


def call(
    server: Server, *args: str, stdin: str | None = None, url: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``kvstore.cli.main`` in this process against ``server`` (or ``url``)."""
    from kvstore.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    argv = [*args, "--url", url or server.url]
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        if stdin is not None:
            stack.enter_context(_patched_stdin(stdin))
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: --help (0) and bad arguments (2)
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["kvstore", *argv], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _patched_stdin(text: str) -> Iterator[None]:
    saved = sys.stdin
    sys.stdin = io.StringIO(text)
    try:
        yield
    finally:
        sys.stdin = saved


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"{r.args} exited {r.returncode}: {r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    return r.stdout


def as_json(r: subprocess.CompletedProcess[str]) -> dict:
    out = ok(r)
    try:
        return json.loads(out)
    except ValueError as e:
        raise AssertionError(f"{r.args}: --json printed no single JSON document: {out!r}") from e


def failed(r: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one-line message of an expected failure."""
    assert r.returncode == code, (
        f"{r.args}: expected exit {code}, got {r.returncode}: {r.stdout}{r.stderr}"
    )
    assert "Traceback" not in r.stderr, f"traceback for an expected error: {r.stderr}"
    return r.stderr


# -- help ----------------------------------------------------------------


def test_help_documents_every_option() -> None:
    from kvstore.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert isinstance(sub.choices, dict)
    assert set(sub.choices) == {
        "stats",
        "ls",
        "lookup",
        "delete",
        "pin",
        "unpin",
        "clear",
        "health",
        "info",
        "bench",
    }
    for name, sp in {"": parser, **sub.choices}.items():
        text = sp.format_help()
        for action in sp._actions:
            for opt in action.option_strings:
                assert opt in text, f"`kvstore {name} --help` does not mention {opt}"
            if action.option_strings and action.help is None:
                raise AssertionError(
                    f"`kvstore {name}`: option {action.option_strings} has no help text"
                )
    r = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "lookup" in r.stdout and "--json" in r.stdout, r.stdout


# -- read-only commands ----------------------------------------------------------------------------


def test_stats_human_and_json(server: Server, stored: dict) -> None:
    human, doc = ok(cli(server, "stats")), as_json(call(server, "stats", "--json"))
    assert "chunks:" in human and "TIER" in human, human
    assert any(line.startswith("memory") and "64.0 MiB" in line for line in human.splitlines()), (
        f"no memory tier row with its 64 MiB capacity:\n{human}"
    )
    assert doc["chunks"] >= 8 and doc["namespaces"] >= 2, doc
    assert [t["name"] for t in doc["tiers"]] == ["memory", "disk"], doc["tiers"]
    assert doc["tiers"][0]["capacity_bytes"] == 64 << 20


def test_ls_namespaces(server: Server, stored: dict) -> None:
    human, doc = ok(cli(server, "ls")), as_json(call(server, "ls", "--json"))
    for ns in (NS_A, NS_B):
        row = next((ln for ln in human.splitlines() if ns.fingerprint.hex() in ln), "")
        assert f"model={ns.model}" in row and "dtype=float16" in row and "16.0 KiB" in row, (
            f"no row naming {ns.model} with 16.0 KiB:\n{human}"
        )
    by_fp = {n["fingerprint"]: n for n in doc["namespaces"]}
    a = by_fp[NS_A.fingerprint.hex()]
    assert (a["chunks"], a["bytes"], a["namespace"]["model"]) == (4, 4 * PAYLOAD, NS_A.model), a


def test_ls_chunks_with_filters(server: Server, stored: dict) -> None:
    fp = NS_A.fingerprint.hex()
    human = ok(call(server, "ls", fp[:8]))  # a unique prefix will do
    for key in stored["a"]:
        row = next((ln for ln in human.splitlines() if key.hex() in ln), "")
        assert "memory" in row and "4.0 KiB" in row and row.rstrip().endswith("no"), (
            f"chunk {key.hex()[:16]} not listed with tier, size and pin state:\n{human}"
        )
    doc = as_json(call(server, "ls", "--namespace", fp, "--json"))
    assert {c["key"] for c in doc["chunks"]} == {k.hex() for k in stored["a"]}, doc
    c0 = doc["chunks"][0]
    assert c0["size_bytes"] == PAYLOAD and c0["tokens"] == CHUNK_TOKENS and "memory" in c0["tiers"]
    assert c0["age_s"] >= 0 and c0["pinned"] is False, c0
    limited = as_json(call(server, "ls", fp, "--limit", "2", "--json"))
    assert len(limited["chunks"]) == 2 and limited["truncated"], limited
    assert as_json(call(server, "ls", fp, "--tier", "remote", "--json"))["chunks"] == []
    assert "no chunks match" in ok(
        call(
            server,
            "ls",
            "--model",
            NS_A.model,
            "--dtype",
            "float16",
            "--layout",
            "test",
            "--pinned",
        )
    )
    assert "unique prefix" in failed(call(server, "ls", "zz"), 2)


def test_lookup_hit_across_chunks(server: Server, stored: dict) -> None:
    args = [
        "lookup",
        "--model",
        NS_A.model,
        "--dtype",
        "float16",
        "--layout",
        "test",
        *map(str, PROMPT),
    ]
    human, doc = ok(cli(server, *args)), as_json(call(server, *args, "--json"))
    assert "64 of 64 tokens (100.0%)" in human and "stop: complete" in human, human
    for i, key in enumerate(stored["a"]):
        row = next((ln for ln in human.splitlines() if key.hex() in ln), "")
        assert row.split()[:4] == [str(i), f"{i * 16}-{i * 16 + 15}", "16/16", "memory"], (
            f"chunk {i} row: {row!r}\n{human}"
        )
    assert (doc["matched_tokens"], doc["stop"]) == (64, "complete"), doc
    assert [c["key"] for c in doc["chunks"]] == [k.hex() for k in stored["a"]]
    assert (
        doc["by_tier"] == {"memory": 64}
        and doc["namespace"]["fingerprint"] == NS_A.fingerprint.hex()
    )
    assert doc["cut"] is None and doc["stored_prefix_tokens"] == 64, doc
    coarse = as_json(call(server, *args, "--granularity", "24", "--json"))
    assert (
        coarse["matched_tokens"],
        coarse["stored_prefix_tokens"],
        coarse["stop"],
        coarse["cut"]["reason"],
    ) == (48, 64, "complete", "granularity"), coarse


def test_lookup_diverged_prompt(server: Server, stored: dict) -> None:
    prompt = PROMPT[:40] + [7] * 24  # diverges in chunk 2, after 8 of its 16 tokens
    args = ["lookup", "--namespace-fp", NS_A.fingerprint.hex(), *map(str, prompt)]
    human, doc = ok(call(server, *args)), as_json(call(server, *args, "--json"))
    assert "40 of 64 tokens" in human and "stop: diverged" in human, human
    row = next(ln for ln in human.splitlines() if stored["a"][2].hex() in ln)
    assert "8/16" in row and "partial" in row, row
    assert (doc["matched_tokens"], doc["stop"], doc["stop_chunk"]) == (40, "diverged", 2), doc
    assert doc["chunks"][-1]["partial"] and doc["chunks"][-1]["tokens"] == 8, doc["chunks"]


def test_lookup_other_namespace(server: Server, stored: dict) -> None:
    # Same model and tokens, another KV dtype: nothing is served, and the CLI says why.
    args = [
        "lookup",
        "--model",
        NS_A.model,
        "--dtype",
        "bfloat16",
        "--layout",
        "test",
        *map(str, PROMPT),
    ]
    human, doc = ok(call(server, *args)), as_json(call(server, *args, "--json"))
    assert "0 of 64 tokens" in human and "other namespaces hold more" in human, human
    row = next(ln for ln in human.splitlines() if ln.startswith(NS_A.fingerprint.hex()))
    assert row.split()[1] == "64" and row.split()[-1] == "dtype", row
    assert doc["matched_tokens"] == 0 and doc["stop"] == "not_stored", doc
    other = {o["fingerprint"]: o for o in doc["other_namespaces"]}
    assert other[NS_A.fingerprint.hex()]["differs_in"] == ["dtype"], other
    assert other[NS_B.fingerprint.hex()]["differs_in"] == ["model", "dtype"], other


def test_lookup_token_sources_and_min_tokens(server: Server, stored: dict, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(2000)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "ids.json").write_text(json.dumps(PROMPT[:20]))
    ns = ["lookup", "--namespace-fp", NS_B.fingerprint.hex()[:10], "--json"]
    runs = [
        cli(server, *ns, stdin=" ".join(map(str, PROMPT[:20]))),  # a real pipe
        call(server, *ns, "-", stdin=",".join(map(str, PROMPT[:20]))),
        call(server, *ns, "--tokens-file", str(tmp_path / "ids.json")),
        call(
            server,
            *ns,
            "--text",
            " ".join(f"w{t}" for t in PROMPT[:20]),
            "--tokenizer",
            str(tmp_path / "tok"),
        ),
    ]
    for r in runs:
        doc = as_json(r)
        # 16 tokens of chunk 0, then the first 4 of the stored chunk 1 (the prompt is shorter).
        assert (doc["total_tokens"], doc["matched_tokens"]) == (20, 20), (r.args, doc)
    below = call(server, *ns[:-1], "--min-tokens", "32", *map(str, PROMPT[:20]))
    assert "cut: below_min_tokens" in ok(below) and "stored prefix 20" in below.stdout, below.stdout
    doc = as_json(call(server, *ns, "--min-tokens", "32", *map(str, PROMPT[:20])))
    # An engine gets 0; the chunk rows still say where the 20 stored tokens are, and why the
    # stored prefix ends (the stored chunk 1 goes on where the prompt ends).
    assert (doc["matched_tokens"], doc["stored_prefix_tokens"], doc["stop"]) == (
        0,
        20,
        "diverged",
    ), doc
    assert doc["cut"]["reason"] == "below_min_tokens" and "32" in doc["cut"]["explanation"]
    assert "empty" in failed(call(server, *ns, "-", stdin=""))


def test_lookup_bad_arguments(server: Server, stored: dict) -> None:
    assert "namespace" in failed(call(server, "lookup", "1", "2"), 2)
    assert "x2" in failed(call(server, "lookup", "--model", "m", "1", "x2"), 2)
    assert "not both" in failed(
        call(server, "lookup", "--model", "m", "--namespace-fp", NS_A.fingerprint.hex(), "1"), 2
    )
    assert "tp_rank" in failed(call(server, "lookup", "--model", "m", "--tp-rank", "2", "1"), 2)
    assert "token ids must be" in failed(call(server, "lookup", "--model", "m", "1", "-5"))


def test_info_and_health(server: Server, stored: dict) -> None:
    info = ok(call(server, "info"))
    fields = dict(ln.split(":", 1) for ln in info.splitlines())
    assert (fields["chunk tokens"].strip(), fields["tiers"].strip()) == ("16", "memory, disk"), info
    doc = as_json(call(server, "info", "--json"))
    assert (doc["chunk_tokens"], doc["tiers"], doc["shm_usable"]) == (
        16,
        ["memory", "disk"],
        True,
    ), doc
    assert doc["express_used"] and doc["express_socket"].endswith(".express"), doc
    assert "used by this client" in fields["express plane"], info
    assert ok(cli(server, "health")).startswith(f"serving: {server.url}")
    assert as_json(call(server, "--json", "health")) | {"server_version": ""} == {
        "url": server.url,
        "serving": True,
        "status": "serving",
        "error": "",
        "server_version": "",
    }


def test_url_flag_wins_over_environment(server: Server, stored: dict) -> None:
    r = cli(server, "--url", server.tcp_url, "stats", "--json", url=server.dead_url)
    assert as_json(r)["url"] == server.tcp_url


# -- unreachable server ----------------------------------------------------------------


def test_unreachable_server_is_one_clear_line(server: Server) -> None:
    runs = [
        cli(None, "health", url=server.dead_url),
        cli(None, "ls", url=server.dead_url),
        call(server, "stats", url=server.dead_url),
        call(server, "lookup", "--model", "m", "1", "2", url=server.dead_url),
        call(server, "pin", "ab" * 32, url=server.dead_url),
        call(server, "health", "--json", url=server.dead_url),
    ]
    for r in runs:
        err = failed(r)
        lines = err.strip().splitlines()
        assert len(lines) == 1, f"{r.args}: expected one line on stderr, got:\n{err}"
        assert server.dead_url in err and "kvstore-server" in err, f"{r.args}: {err}"
    health_doc = json.loads(runs[-1].stdout)
    assert (health_doc["serving"], health_doc["status"]) == (False, "unreachable"), health_doc


# -- commands that change the store ----------------------------------------------------------------


def test_delete(server: Server) -> None:
    ns = Namespace("cli-delete", dtype="float16")
    with Client(server.url) as c:
        keys = put_chain(c, ns, PROMPT)
    assert ok(cli(server, "delete", keys[2].hex())).strip() == "deleted 1 of 1 chunks"
    doc = as_json(
        call(
            server, "lookup", "--model", ns.model, "--dtype", "float16", "--json", *map(str, PROMPT)
        )
    )
    assert (doc["matched_tokens"], doc["stop"], doc["stop_chunk"]) == (32, "deleted", 2), doc
    doc = as_json(call(server, "delete", keys[2].hex(), keys[3].hex(), "--json"))
    assert (doc["requested"], doc["deleted"], doc["not_found"]) == (2, 1, [keys[2].hex()]), doc
    assert "64 hex" in failed(call(server, "delete", "xyz"), 2)


def test_pin_and_unpin(server: Server) -> None:
    ns = Namespace("cli-pin", dtype="float16")
    with Client(server.url) as c:
        keys = put_chain(c, ns, PROMPT[:32])
    fp = ns.fingerprint.hex()
    assert ok(call(server, "pin", keys[0].hex())).strip() == "pinned 1 of 1 chunks"
    pinned = as_json(call(server, "ls", fp, "--pinned", "--json"))["chunks"]
    assert [c["key"] for c in pinned] == [keys[0].hex()], pinned
    assert as_json(call(server, "pin", keys[0].hex(), "--json"))["not_found"] == []
    doc = as_json(call(server, "unpin", keys[0].hex(), "--json"))
    assert (doc["pinned"], doc["changed"]) == (False, 1), doc
    assert as_json(call(server, "ls", fp, "--pinned", "--json"))["chunks"] == []
    unknown = "00" * 32
    err = failed(cli(server, "pin", keys[1].hex(), unknown))
    assert "not stored" in err and unknown[:16] in err, err


def test_clear_refuses_without_yes_then_clears(server: Server) -> None:
    ns = Namespace("cli-clear", dtype="float16")
    with Client(server.url) as c:
        put_chain(c, ns, PROMPT[:48])
    fp = ns.fingerprint.hex()
    err = failed(cli(server, "clear", fp))  # stdin is not a terminal
    assert "--yes" in err and "refusing" in err, err
    assert as_json(call(server, "ls", fp, "--json"))["chunks"], "refused clear removed chunks"
    assert "--all" in failed(call(server, "clear"), 2)
    assert "--all" in failed(call(server, "clear", fp, "--all"), 2)
    doc = as_json(call(server, "clear", fp, "--yes", "--json"))
    assert (doc["removed"], doc["namespace"], doc["all"]) == (3, fp, False), doc
    assert as_json(call(server, "ls", fp, "--json"))["chunks"] == []


@pytest.mark.parametrize("answer,removed", [("n", False), ("y", True)])
def test_clear_asks_on_a_terminal(server: Server, answer: str, removed: bool) -> None:
    ns = Namespace(f"cli-clear-tty-{answer}", dtype="float16")
    with Client(server.url) as c:
        put_chain(c, ns, PROMPT[:16])
    fp = ns.fingerprint.hex()
    master, slave = pty.openpty()
    env = {**os.environ, "KVSTORE_URL": server.url}
    try:
        p = subprocess.Popen(
            [*CLI, "clear", "--model", ns.model, "--dtype", "float16"],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        os.write(master, f"{answer}\n".encode())
        out, err = p.communicate(timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert "Remove 1 chunks (4.0 KiB)" in err and "[y/N]" in err, err
    assert p.returncode == (0 if removed else 1), f"exit {p.returncode}: {out}{err}"
    left = as_json(call(server, "ls", fp, "--json"))["chunks"]
    assert (not left) == removed, f"answer {answer!r}: chunks left {left}"


def test_bench(server: Server, stored: dict) -> None:
    before = as_json(call(server, "stats", "--json"))["chunks"]
    human = ok(cli(server, "bench", "--count", "3", "--size", "256KiB"))
    assert "via shm" in human and "verified 3 of 3 chunks" in human, human
    assert next(ln for ln in human.splitlines() if ln.startswith("put")).split()[1] == "3"
    doc = as_json(
        call(
            server,
            "bench",
            "--count",
            "2",
            "--size",
            "1MiB",
            "--no-shm",
            "--json",
            url=server.tcp_url,
        )
    )
    assert (doc["plane"], doc["verified"], doc["count"]) == ("stream", 2, 2), doc
    assert doc["put"]["gb_per_s"] > 0 and doc["get"]["gb_per_s"] > 0, doc
    assert doc["put"]["statuses"] == {"stored": 2}, doc
    assert as_json(call(server, "stats", "--json"))["chunks"] == before, "bench left chunks"
    assert "size" in failed(call(server, "bench", "--size", "lots"), 2)


def test_a_lookup_result_as_json_lists_its_chunks() -> None:
    """``--json`` output of a LookupResult: its chunks (columns, ``ChunkMatches``) as rows."""
    from kvstore.cli.format import emit_json
    from kvstore.types import ChunkMatch, ChunkMatches, LookupResult

    row = ChunkMatch(ChunkKey(b"k" * 32), 0, 8, 8, 1, False)
    out = io.StringIO()
    emit_json(LookupResult(8, 8, ChunkMatches.of((row,)), "complete"), out)
    doc = json.loads(out.getvalue())
    assert doc["chunks"] == [[(b"k" * 32).hex(), 0, 8, 8, 1, False]], doc
