"""examples/pd_proxy.py, run as a real process between two stub OpenAI-compatible engines.

The stubs record every request they get and answer as ``vllm serve`` would (a
completion JSON, or an SSE stream when ``stream`` is true). The real P/D data
path through kvstore, with two vLLM engines, is tested in test_vllm_connector.py
(test_pd_consumer_loads_from_disk_after_restart, drop_after_load included).
"""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

PROXY = Path(__file__).resolve().parents[2] / "examples" / "pd_proxy.py"
_order = itertools.count()  # global arrival order across both stubs


@dataclass
class Seen:
    order: int
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Stub:
    """A fake engine. mode: ok, error (HTTP 500) or hang (until released)."""

    name: str
    mode: str = "ok"
    seen: list[Seen] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)  # holds a stream after event 1
    release: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def events(self) -> list[bytes]:
        return [
            b'data: {"id":"chat-1","choices":[{"delta":{"content":"%s-%d"}}]}\n\n'
            % (self.name.encode(), i)
            for i in range(3)
        ] + [b"data: [DONE]\n\n"]

    def completion(self) -> bytes:
        return json.dumps(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "m",
                "choices": [
                    {"index": 0, "text": f"answer from {self.name}", "finish_reason": "length"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3},
            }
        ).encode()


def _handler(stub: Stub) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            stub.seen.append(Seen(next(_order), "GET", self.path, dict(self.headers), b""))
            if self.path == "/health":
                self._send(200, b"")
            else:
                models = {"object": "list", "data": [{"id": stub.name}]}
                self._send(200, json.dumps(models).encode())

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            stub.seen.append(Seen(next(_order), "POST", self.path, dict(self.headers), body))
            if stub.mode == "hang":
                stub.release.wait(10)
            if stub.mode == "error":
                self._send(500, b'{"error": {"message": "engine exploded"}}')
                return
            try:
                req = json.loads(body)
            except ValueError:
                self._send(400, b'{"error": {"message": "bad JSON", "code": 400}}')
                return
            if not req.get("stream"):
                self._send(200, stub.completion())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, ev in enumerate(stub.events()):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                # The client must see event 0 before the rest exists; if it never does,
                # the stream it finally gets is marked and cannot match.
                if i == 0 and not stub.gate.wait(3):
                    self.wfile.write(b"14\r\ndata: gate timed out\r\n")
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, format: str, *args: Any) -> None:
            return

    return H


@pytest.fixture
def stubs() -> Iterator[Callable[..., Stub]]:
    made: list[Stub] = []

    def make(name: str, mode: str = "ok") -> Stub:
        stub = Stub(name, mode)
        stub.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(stub))
        stub.server.daemon_threads = True
        threading.Thread(
            target=stub.server.serve_forever,
            args=(0.05,),  # fast shutdown
            daemon=True,
        ).start()
        made.append(stub)
        return stub

    yield make
    for stub in made:
        stub.gate.set()
        stub.release.set()
        assert stub.server is not None
        stub.server.shutdown()
        stub.server.server_close()


@dataclass
class Proxy:
    host: str
    port: int
    log: Path

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=10)

    def post(
        self, path: str, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
    ) -> tuple[int, str, bytes]:
        c = self.conn()
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c.request(
            "POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})}
        )
        r = c.getresponse()
        out = (r.status, r.getheader("Content-Type") or "", r.read())
        c.close()
        return out


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Callable[..., Proxy]]:
    procs: list[subprocess.Popen[str]] = []

    def start(prefill: str, decode: str, *extra: str) -> Proxy:
        log = tmp_path / f"proxy-{len(procs)}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(PROXY),
                    "--port",
                    "0",
                    "--prefill",
                    prefill,
                    "--decode",
                    decode,
                    *extra,
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on http://" in line, f"proxy did not start: {line!r}\n{log.read_text()}"
        host, port = line.split("http://")[1].split()[0].rsplit(":", 1)
        return Proxy(host, int(port), log)

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A port that is bound but never listens: connecting is refused, and nobody can take it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


COMPLETION = {
    "model": "m",
    "prompt": "the same long document ...",
    "max_tokens": 20,
    "temperature": 0,
    "min_tokens": 5,
    "n": 2,
    "cache_salt": "tenant-a",
}


def test_completion_prefills_then_relays_decode(
    stubs: Callable[..., Stub], proxy: Callable[..., Proxy]
) -> None:
    pre, dec = stubs("prefill"), stubs("decode")
    p = proxy(pre.url, dec.url)
    raw = json.dumps(COMPLETION).encode()
    status, ctype, body = p.post("/v1/completions", raw, {"Authorization": "Bearer k"})
    assert status == 200, body
    assert ctype == "application/json"
    assert body == dec.completion(), f"the client must get decode's answer, got {body!r}"
    assert len(pre.seen) == 1 and len(dec.seen) == 1, (pre.seen, dec.seen)
    sent = pre.seen[0].json()
    want = {**COMPLETION, "max_tokens": 1, "stream": False, "n": 1}
    del want["min_tokens"]  # vLLM rejects min_tokens > max_tokens
    assert sent == want, f"prefill must get a one-token, non-streamed copy: {sent}"
    assert pre.seen[0].path == "/v1/completions"
    assert dec.seen[0].body == raw, "decode must get the original body, byte for byte"
    assert pre.seen[0].order < dec.seen[0].order, "prefill must finish before decode starts"
    for s in (pre, dec):
        assert s.seen[0].headers.get("Authorization") == "Bearer k", f"{s.name}: no auth header"


def test_chat_stream_is_relayed_as_it_arrives(
    stubs: Callable[..., Stub], proxy: Callable[..., Proxy]
) -> None:
    pre, dec = stubs("prefill"), stubs("decode")
    p = proxy(pre.url, dec.url)
    req = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
    }
    c = p.conn()
    c.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(req),
        headers={"Content-Type": "application/json"},
    )
    r = c.getresponse()
    assert r.status == 200
    assert r.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    events = dec.events()
    first = r.readline() + r.readline()
    # The stub holds the rest of its stream until now: reading event 0 proves relaying is live.
    assert first == events[0], f"first event not relayed before the stream ended: {first!r}"
    dec.gate.set()
    rest = r.read()
    c.close()
    assert first + rest == b"".join(events), (
        "the SSE stream must arrive intact (a 'gate timed out' mark: the proxy buffered it)"
    )
    sent = pre.seen[0].json()
    assert sent["max_tokens"] == 1 and sent["max_completion_tokens"] == 1, sent
    assert sent["stream"] is False and "stream_options" not in sent, sent
    assert sent["messages"] == req["messages"], sent
    assert dec.seen[0].json() == req, "decode must get the original (streaming) request"


@pytest.mark.parametrize("failure", ["error", "down", "timeout"])
def test_prefill_failure_still_answers_from_decode(
    failure: str, stubs: Callable[..., Stub], proxy: Callable[..., Proxy], dead_url: str
) -> None:
    pre = stubs("prefill", {"error": "error", "down": "ok", "timeout": "hang"}[failure])
    dec = stubs("decode")
    p = proxy(dead_url if failure == "down" else pre.url, dec.url, "--timeout", "0.5")
    status, _, body = p.post("/v1/completions", COMPLETION)
    assert status == 200 and body == dec.completion(), (status, body)
    assert dec.seen[0].json() == COMPLETION
    log = p.log.read_text()
    assert "WARNING" in log and "prefill" in log, f"a failed prefill must be logged:\n{log}"
    want = {"error": "answered 500", "down": "ConnectionRefusedError", "timeout": "timed out"}
    assert want[failure] in log, f"the warning must say why ({want[failure]}):\n{log}"


def test_decode_down_gives_502_with_a_message(
    stubs: Callable[..., Stub], proxy: Callable[..., Proxy], dead_url: str
) -> None:
    pre = stubs("prefill")
    p = proxy(pre.url, dead_url)
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        c = p.conn()
        c.request(method, path, body=json.dumps(COMPLETION) if method == "POST" else None)
        r = c.getresponse()
        body = r.read()
        c.close()
        assert r.status == 502, f"{path}: {r.status} {body!r}"
        assert r.getheader("Content-Type") == "application/json"
        msg = json.loads(body)["error"]["message"]
        assert dead_url in msg and "unreachable" in msg, msg
    assert len(pre.seen) == 1, "the prefill still ran for the completion"


def test_passthrough_errors_and_keep_alive(
    stubs: Callable[..., Stub], proxy: Callable[..., Proxy]
) -> None:
    pre, dec = stubs("prefill"), stubs("decode")
    p = proxy(pre.url, dec.url)
    c = p.conn()  # one connection for every request: HTTP/1.1 framing must stay right
    answers = []
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("POST", "/v1/completions", b"{not json"),
        ("POST", "/v1/completions", json.dumps(COMPLETION).encode()),
        ("GET", "/metrics", None),
        ("POST", "/v1/embeddings", b"{}"),
    ]:
        c.request(method, path, body=body)
        r = c.getresponse()
        answers.append((r.status, r.read()))
    c.close()
    assert answers[0] == (200, b'{"object": "list", "data": [{"id": "decode"}]}'), answers[0]
    assert answers[1] == (200, b""), answers[1]
    assert answers[2][0] == 400 and b"bad JSON" in answers[2][1], "decode's error is relayed"
    assert answers[3] == (200, dec.completion()), answers[3]
    assert [a[0] for a in answers[4:]] == [404, 404], answers[4:]
    assert json.loads(answers[5][1])["error"]["message"].startswith("no route"), answers[5]
    assert [s.path for s in pre.seen] == ["/v1/completions"], "only valid completions prefill"
    assert [s.path for s in dec.seen] == [
        "/v1/models",
        "/health",
        "/v1/completions",
        "/v1/completions",
    ], [s.path for s in dec.seen]


def test_drop_after_load_asks_the_decode_engine_to_drop_what_it_loaded(
    stubs: Callable[..., Stub], proxy: Callable[..., Proxy]
) -> None:
    """With --drop-after-load the decode request carries kv_transfer_params
    {"kvstore": {"drop_after_load": true}} (what the connector reads; other keys there
    kept, the client's own kvstore settings too), the prefill's does not; without the
    flag decode gets the body byte for byte."""
    pre, dec = stubs("prefill"), stubs("decode")
    p = proxy(pre.url, dec.url, "--drop-after-load")
    req = {**COMPLETION, "kv_transfer_params": {"other": 1}}
    status, _, body = p.post("/v1/completions", req)
    assert status == 200 and body == dec.completion(), (status, body)
    want = {**req, "kv_transfer_params": {"other": 1, "kvstore": {"drop_after_load": True}}}
    assert dec.seen[0].json() == want, f"decode must be asked to drop: {dec.seen[0].json()}"
    assert pre.seen[0].json()["kv_transfer_params"] == {"other": 1}, "the prefill keeps its KV"
    mine = {**COMPLETION, "kv_transfer_params": {"kvstore": {"save": False}}}
    status, _, _ = p.post("/v1/completions", mine)
    assert status == 200, status
    got = dec.seen[1].json()["kv_transfer_params"]
    assert got == {"kvstore": {"save": False, "drop_after_load": True}}, (
        f"the client's own kvstore settings must reach the decode engine with the drop: {got}"
    )
    status, _, body = p.post("/v1/completions", b"{not json")
    assert status == 400 and dec.seen[2].body == b"{not json", "a bad body goes as it came"
