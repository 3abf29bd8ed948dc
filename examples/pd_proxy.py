"""A disaggregated prefill/decode proxy for two ``vllm serve`` engines sharing one kvstore-server.

    python examples/pd_proxy.py --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

The prefill engine runs the KVStoreConnector with ``kv_role: kv_producer``, the
decode engine with ``kv_consumer``, both with the same ``url``. For every
completion or chat request the proxy first sends a copy to the prefill engine
with ``max_tokens: 1`` and ``stream: false``; the connector stores the prompt's
KV within that request's step, so once the answer is back the decode engine
finds it. Then the original request goes to the decode engine, which loads the
prompt's KV instead of computing it, and its answer (streamed or not) is relayed
as it arrives. A failed prefill is logged and costs only speed: the decode
engine then computes the prompt itself. Standard library only.

With ``--drop-after-load`` the decode request carries
``kv_transfer_params: {"kvstore": {"drop_after_load": true}}``: once the decode engine
has loaded the prompt's KV, the connector deletes those chunks from the server (a
one-shot transfer that does not occupy the cache; a chunk another request still holds
a lease on goes when that lease ends). The same can be set for every request on the
decode engine (``drop_after_load`` in its ``kv_connector_extra_config``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("pd_proxy")

GENERATE = ("/v1/completions", "/v1/chat/completions")
PASSTHROUGH = ("/v1/models", "/health")
# Hop-by-hop headers (RFC 9110 section 7.6.1) and the framing the proxy sets itself.
HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "expect",
}


class Upstream:
    """One engine's base URL; every call opens its own connection (handlers run in threads)."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SystemExit(f"pd_proxy: {url!r} is not an http://host:port URL")
        self.url = url.rstrip("/")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, self.prefix + path, body=body, headers=headers)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise


def decode_body(req: dict[str, Any]) -> bytes:
    """The request as the decode engine gets it with --drop-after-load: the original, with
    the connector's drop asked for in ``kv_transfer_params`` (other keys there kept, the
    client's own kvstore settings too)."""
    params = req.get("kv_transfer_params")
    params = dict(params) if isinstance(params, dict) else {}
    ours = params.get("kvstore")
    params["kvstore"] = {**(ours if isinstance(ours, dict) else {}), "drop_after_load": True}
    return json.dumps(dict(req, kv_transfer_params=params)).encode()


def prefill_body(path: str, req: dict[str, Any]) -> bytes:
    """The request as the prefill engine gets it: one token, no streaming, one choice."""
    out = dict(req, max_tokens=1, stream=False, n=1)
    if path.endswith("/chat/completions"):
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # vLLM rejects min_tokens > max_tokens
    return json.dumps(out).encode()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive to clients; streamed answers are re-chunked
    server_version = "kvstore-pd-proxy"
    prefill: Upstream
    decode: Upstream
    drop_after_load = False  # --drop-after-load

    def do_GET(self) -> None:
        if self.path.split("?")[0] in PASSTHROUGH:
            self._relay("GET", None)
        else:
            self._error(404, f"no route for GET {self.path}; proxied: {', '.join(PASSTHROUGH)}")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        if path not in GENERATE:
            self._error(404, f"no route for POST {self.path}; proxied: {', '.join(GENERATE)}")
            return
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        if isinstance(req, dict):  # anything else: the decode engine answers with its error
            self._prefill(path, req)
            if self.drop_after_load:
                body = decode_body(req)
        self._relay("POST", body)

    def _forward_headers(self) -> dict[str, str]:
        return {k: v for k, v in self.headers.items() if k.lower() not in HOP}

    def _prefill(self, path: str, req: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        conn = None
        try:
            conn, resp = self.prefill.request(
                "POST", self.path, prefill_body(path, req), self._forward_headers()
            )
            detail = resp.read()[:300].decode(errors="replace")
        except (OSError, http.client.HTTPException) as e:
            log.warning(
                "prefill at %s failed (%s: %s); the decode engine will compute the prompt",
                self.prefill.url,
                type(e).__name__,
                e,
            )
            return
        finally:
            if conn is not None:
                conn.close()
        if resp.status != 200:
            log.warning(
                "prefill at %s answered %d (%s); the decode engine will compute the prompt",
                self.prefill.url,
                resp.status,
                detail,
            )
            return
        log.info("prefill %s: %.3f s", path, time.perf_counter() - t0)

    def _relay(self, method: str, body: bytes | None) -> None:
        try:
            conn, resp = self.decode.request(method, self.path, body, self._forward_headers())
        except (OSError, http.client.HTTPException) as e:
            self._error(
                502, f"decode engine at {self.decode.url} unreachable: {type(e).__name__}: {e}"
            )
            return
        try:
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in HOP | {"server", "date"}:
                    self.send_header(k, v)
            length = resp.getheader("Content-Length")
            if length is not None:
                self.send_header("Content-Length", length)
                self.end_headers()
                self.wfile.write(resp.read())
                return
            # Streamed (SSE): pass every piece on as soon as it arrives, re-chunked.
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while piece := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as e:
            # The status line is out: all that is left is to cut the response short.
            log.error(
                "relaying the answer of %s stopped: %s: %s", self.decode.url, type(e).__name__, e
            )
            self.close_connection = True
        finally:
            conn.close()

    def _error(self, status: int, message: str) -> None:
        if status >= 500:
            log.error("%s", message)
        data = json.dumps(
            {"error": {"message": message, "type": "proxy_error", "code": status}}
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    ap.add_argument("--prefill", default="http://127.0.0.1:8100", help="the kv_producer engine")
    ap.add_argument("--decode", default="http://127.0.0.1:8200", help="the kv_consumer engine")
    ap.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait on an engine (connect, or between two reads)",
    )
    ap.add_argument(
        "--drop-after-load",
        action="store_true",
        help="ask the decode engine's connector to delete the prompt's KV from kvstore "
        "once loaded (kv_transfer_params kvstore.drop_after_load)",
    )
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s pd_proxy: %(message)s"
    )
    Handler.prefill = Upstream(args.prefill, args.timeout)
    Handler.decode = Upstream(args.decode, args.timeout)
    Handler.drop_after_load = args.drop_after_load
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    host, port = str(args.host), server.server_address[1]
    # The tests read this line to learn the port when --port 0.
    print(
        f"pd_proxy listening on http://{host}:{port} (prefill {args.prefill}, "
        f"decode {args.decode})",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
