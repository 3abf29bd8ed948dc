"""``kvstore``: inspect and manage a running kvstore-server from a shell.

Every command asks the server through the SDK (``kvstore.Client``), builds one
JSON-able document, and prints it either as aligned tables for a person
(``kvstore/cli/format.py``) or, with ``--json``, as one JSON document for a
script. Building the document first keeps the two outputs in step.

Expected failures (server unreachable, wrong token, a refused ``clear``) print
one line on stderr and exit 1; bad arguments exit 2 (argparse). No tracebacks
for either: a traceback means a bug in kvstore.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore import __version__, accel
from kvstore.cli import bench as cli_bench
from kvstore.cli import format as fmt
from kvstore.cli import render as render
from kvstore.cli.format import CLIError, Doc
from kvstore.cli.parser import build_parser
from kvstore.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    ServerUnavailable,
    Unauthenticated,
)
from kvstore.keys import FINGERPRINT_BYTES, ChunkKey, Fingerprint, Namespace
from kvstore.types import tier_label

if TYPE_CHECKING:
    from kvstore.sdk.client import Client

EXIT_OK, EXIT_ERROR = 0, 1  # and 2: argparse, for bad arguments


# -- helpers shared by commands ---------------------------------------------------------------


def _client(args: argparse.Namespace, shm: bool | None = None) -> Client:
    from kvstore.sdk.client import Client

    return Client(args.url, token=args.token, timeout=args.timeout, shm=shm)


def _namespace_from_fields(args: argparse.Namespace) -> Namespace | None:
    if args.model is None:
        return None
    try:
        return Namespace(
            model=args.model,
            revision=args.revision,
            dtype=args.dtype,
            layout=args.layout,
            device=args.device,
            tp_rank=args.tp_rank,
            tp_size=args.tp_size,
            pp_rank=args.pp_rank,
            pp_size=args.pp_size,
            lora=args.lora,
            salt=args.salt,
            extra=tuple(sorted(args.extra)),
        )
    except InvalidArgument as e:
        args.parser.error(str(e))
        raise  # parser.error exits; this keeps type checkers content


def _given_namespace(args: argparse.Namespace) -> tuple[str | None, Namespace | None]:
    """The fingerprint prefix or the Namespace the user gave (at most one of them)."""
    pos = getattr(args, "namespace_pos", None)
    if pos and args.namespace_fp and pos != args.namespace_fp:
        args.parser.error("give the namespace once: NAMESPACE_FP or --namespace-fp")
    hexfp = pos or args.namespace_fp
    ns = _namespace_from_fields(args)
    if hexfp and ns is not None:
        args.parser.error("give either a namespace fingerprint or --model and its fields, not both")
    return hexfp, ns


def _resolve_fp(client: Client, hexfp: str) -> Fingerprint:
    """A full fingerprint from 32 hex digits, or from a prefix unique among stored namespaces."""
    if len(hexfp) == FINGERPRINT_BYTES * 2:
        return Fingerprint(bytes.fromhex(hexfp))
    found = [n.fingerprint for n in client.namespaces() if n.fingerprint.hex().startswith(hexfp)]
    if len(found) != 1:
        raise CLIError(
            f"namespace prefix {hexfp!r} matches {len(found)} stored namespaces; "
            "give more hex digits (see `kvstore ls`)"
        )
    return found[0]


# -- commands ------------------------------------------------------------------------------------


def cmd_stats(args: argparse.Namespace) -> Doc:
    with _client(args) as c:
        s = c.stats()
    doc: Doc = {"url": c.url, "chunks": s.chunks, "namespaces": s.namespaces}
    for name in (
        "pending_writes",
        "pending_bytes",
        "write_failures",
        "lookups",
        "lookup_tokens",
        "matched_tokens",
        "gets",
        "hits",
        "puts",
        "rejected_puts",
        "dropped",
        "drops_deferred",
    ):
        doc[name] = getattr(s, name)
    doc.update(s.extra)
    doc["tiers"] = [
        {
            **{
                f: getattr(t, f)
                for f in (
                    "name",
                    "level",
                    "capacity_bytes",
                    "used_bytes",
                    "chunks",
                    "hits",
                    "misses",
                    "puts",
                    "evictions",
                    "corrupt",
                    "errors",
                    "rejected",
                    "bytes_in",
                    "bytes_out",
                    "healthy",
                )
            },
            "detail": t.detail,
        }
        for t in s.tiers
    ]
    return doc


def cmd_info(args: argparse.Namespace) -> Doc:
    import dataclasses

    from kvstore.protocol import boot_id

    with _client(args) as c:
        info = c.info()
        express_used = c.express is not None
    why = ""
    if not info.shm_path:
        why = "the server does not offer it"
    elif info.boot_id != boot_id():
        why = "the server runs on another host"
    else:
        try:
            if os.stat(info.shm_path).st_ino != info.shm_inode:
                why = f"{info.shm_path} here is not the server's arena"
        except OSError as e:
            why = f"cannot open {info.shm_path}: {e.strerror}"
    return {
        "url": c.url,
        **dataclasses.asdict(info),
        "client_version": __version__,
        "client_native": accel.IMPL,
        "shm_usable": not why,
        "shm_unusable_reason": why,
        "express_used": express_used,
    }


def cmd_health(args: argparse.Namespace) -> Doc:
    with _client(args) as c:
        serving = c.health()
        doc: Doc = {"url": c.url, "serving": serving, "status": "serving", "error": ""}
        if serving:
            try:
                doc["server_version"] = c.info().server_version
            except KVStoreError:  # e.g. a token is needed for Info but not for health
                doc["server_version"] = ""
            return doc
        # health() folds every failure into False; Info tells unreachable from not serving.
        try:
            c.info()
            doc.update(
                status="not_serving",
                error="the server answers but is not serving (starting or shutting down)",
            )
        except ServerUnavailable as e:
            doc.update(status="unreachable", error=_unreachable(c.url, e))
        except KVStoreError as e:
            doc.update(status="not_serving", error=str(e))
    return doc


def cmd_ls(args: argparse.Namespace) -> Doc:
    hexfp, ns = _given_namespace(args)
    if args.limit < 0:
        args.parser.error("--limit must be >= 0")
    with _client(args) as c:
        chunks_wanted = hexfp or ns or args.tier or args.pinned or args.all_chunks
        if not chunks_wanted:
            return {
                "url": c.url,
                "namespaces": [
                    {
                        "fingerprint": n.fingerprint.hex(),
                        "chunks": n.chunks,
                        "bytes": n.bytes,
                        "namespace": fmt.namespace_fields(n.namespace),
                    }
                    for n in c.namespaces()
                ],
            }
        fp = ns.fingerprint if ns is not None else _resolve_fp(c, hexfp) if hexfp else None
        now_ms = time.time() * 1000
        rows: list[Doc] = []
        truncated = False
        for v in c.list(fp, tier=args.tier or 0, pinned_only=args.pinned):
            if args.limit and len(rows) == args.limit:
                truncated = True
                break
            rows.append(
                {
                    "key": v.key.hex(),
                    "fingerprint": v.fingerprint.hex(),
                    "parent": v.parent.hex(),
                    "tokens": v.n_tokens,
                    "size_bytes": v.raw_size,
                    "dtype": v.dtype,
                    "tiers": [tier_label(t) for t in v.tiers],
                    "pinned": v.pinned,
                    "hits": v.hits,
                    "created_ms": v.created_ms,
                    "last_access_ms": v.last_access_ms,
                    "age_s": round(max(0.0, now_ms - v.created_ms) / 1000, 3),
                    "idle_s": round(max(0.0, now_ms - v.last_access_ms) / 1000, 3),
                }
            )
    return {
        "url": c.url,
        "namespace": fp.hex() if fp else None,
        "chunks": rows,
        "truncated": truncated,
        "limit": args.limit,
    }


_CUTS = ("granularity", "below_min_tokens")  # stops that cut a stored prefix short


def cmd_lookup(args: argparse.Namespace) -> Doc:
    hexfp, ns = _given_namespace(args)
    if not hexfp and ns is None:
        args.parser.error("give the namespace: --namespace-fp HEX, or --model and its fields")
    tokens = fmt.lookup_tokens(args)
    if not tokens:
        raise CLIError("no token ids to look up (the input was empty)")
    with _client(args) as c:
        info = c.info()
        fp = ns.fingerprint if ns is not None else _resolve_fp(c, hexfp or "")
        target = ns if ns is not None else fp  # a Namespace lets the server name it in `ls`
        r = c.lookup(
            target, tokens, min_tokens=args.min_tokens, granularity=args.granularity, explain=True
        )
        # A cut (min_tokens, a coarser granularity) hides where the stored prefix ends and
        # why: ask once more without one (granularity 1 rounds nothing).
        cut = bool(args.min_tokens or args.granularity) or r.stop in _CUTS
        d = c.lookup(target, tokens, granularity=1, explain=True) if cut else r
        named = {n.fingerprint: n.namespace for n in c.namespaces()} if ns is None else {}
    mine = ns if ns is not None else named.get(fp)
    ct, g = info.chunk_tokens, args.granularity or info.granularity
    chunks = [
        {
            "index": m.start // ct,
            "key": m.key.hex(),
            "start": m.start,
            "end": m.start + m.tokens,
            "tokens": m.tokens,
            "stored_tokens": m.stored_tokens,
            "tier": tier_label(m.tier),
            "partial": m.partial,
        }
        for m in d.chunks
    ]
    stop_span = None
    if d.stop not in ("complete", *_CUTS) and 0 <= d.stop_chunk * ct < d.total_tokens:
        start = d.stop_chunk * ct
        stop_span = [start, min(start + ct, d.total_tokens)]
    cut_doc = None
    if r.matched_tokens < d.matched_tokens:
        why = "below_min_tokens" if r.stop == "below_min_tokens" else "granularity"
        cut_doc = {
            "reason": why,
            "explanation": render.explain_stop(why, -1, None, chunks, args.min_tokens, g),
        }
    others = []
    for o in d.other_namespaces:
        diff = fmt.namespace_diff(mine, o.namespace) if mine and o.namespace else []
        others.append(
            {
                "fingerprint": o.fingerprint.hex(),
                "matched_tokens": o.matched_tokens,
                "namespace": fmt.namespace_fields(o.namespace),
                "differs_in": diff,
            }
        )
    return {
        "url": c.url,
        "namespace": {"fingerprint": fp.hex(), "fields": fmt.namespace_fields(mine)},
        "total_tokens": r.total_tokens,
        "matched_tokens": r.matched_tokens,
        "stored_prefix_tokens": d.matched_tokens,
        "cut": cut_doc,
        "chunk_tokens": ct,
        "granularity": g,
        "min_tokens": args.min_tokens,
        "by_tier": {tier_label(t): n for t, n in sorted(d.by_tier.items())},
        "chunks": chunks,
        "stop": d.stop,
        "stop_chunk": d.stop_chunk,
        "stop_span": stop_span,
        "explanation": render.explain_stop(
            d.stop, d.stop_chunk, stop_span, chunks, args.min_tokens, g
        ),
        "other_namespaces": others,
    }


def _keys_command(args: argparse.Namespace) -> Doc:
    keys: list[ChunkKey] = list(dict.fromkeys(args.keys))  # each key once, in order
    with _client(args) as c:
        stored = c.exists(keys)
        missing = [k.hex() for k, tiers in zip(keys, stored, strict=True) if not tiers]
        if args.command == "delete":
            n = c.delete(keys)
            return {"url": c.url, "requested": len(keys), "deleted": n, "not_found": missing}
        pinned = args.command == "pin"
        n = c.pin(keys, pinned)
    doc = {
        "url": c.url,
        "pinned": pinned,
        "requested": len(keys),
        "changed": n,
        "not_found": missing,
    }
    if missing:
        doc["error"] = (
            f"{len(missing)} of {len(keys)} keys are not stored: "
            f"{', '.join(k[:16] + '...' for k in missing)}"
        )
    return doc


def cmd_clear(args: argparse.Namespace) -> Doc:
    hexfp, ns = _given_namespace(args)
    if args.all == bool(hexfp or ns):
        args.parser.error("give either a namespace (NAMESPACE_FP or --model ...) or --all")
    with _client(args) as c:
        fp = None if args.all else ns.fingerprint if ns else _resolve_fp(c, hexfp or "")
        held = [n for n in c.namespaces() if fp is None or n.fingerprint == fp]
        what = (
            "every namespace"
            if fp is None
            else f"namespace {fp.hex()}"
            + (
                f" ({fmt.describe_namespace(held[0].namespace)})"
                if held and held[0].namespace
                else ""
            )
        )
        n_chunks = sum(n.chunks for n in held)
        if not args.yes:
            if not sys.stdin.isatty():
                raise CLIError(
                    f"refusing to clear {what} without confirmation: standard input "
                    "is not a terminal; pass --yes to clear anyway"
                )
            sys.stderr.write(
                f"Remove {n_chunks} chunks "
                f"({fmt.human_bytes(sum(n.bytes for n in held))}) of {what}? "
                "[y/N] "
            )
            sys.stderr.flush()
            answer = sys.stdin.readline().strip().lower()
            if answer not in ("y", "yes"):
                raise CLIError("not cleared (answer y to confirm)")
        removed = c.clear(fp, all=fp is None)
    return {
        "url": c.url,
        "all": fp is None,
        "namespace": fp.hex() if fp else None,
        "removed": removed,
    }


COMMANDS: dict[str, Callable[[argparse.Namespace], Doc]] = {
    "stats": cmd_stats,
    "info": cmd_info,
    "health": cmd_health,
    "ls": cmd_ls,
    "lookup": cmd_lookup,
    "delete": _keys_command,
    "pin": _keys_command,
    "unpin": _keys_command,
    "clear": cmd_clear,
    "bench": cli_bench.cmd_bench,
}


# -- entry point -----------------------------------------------------------------------------------


def _unreachable(url: str, e: KVStoreError) -> str:
    detail = str(e).split(" is unavailable: ", 1)[-1].replace("\n", " ")
    return (
        f"cannot reach a kvstore server at {url} ({detail}); is it running? Start one with "
        "`kvstore-server`, or point --url / KVSTORE_URL at a running server"
    )


def _message(e: KVStoreError, args: argparse.Namespace) -> str:
    url = args.url or os.environ.get("KVSTORE_URL") or "the default URL"
    if isinstance(e, ServerUnavailable):
        return _unreachable(url, e)
    if isinstance(e, Unauthenticated):
        return f"{e}; pass the server's token with --token or KVSTORE_TOKEN"
    if isinstance(e, PermissionDenied):
        return f"{e}; the token is valid, but its tenant may not do this"
    if isinstance(e, DeadlineExceeded):
        return f"{e}; no answer within --timeout {args.timeout:g} s"
    return str(e)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name, default in (("url", None), ("token", None), ("timeout", 10.0), ("json", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    try:
        doc = COMMANDS[args.command](args)
        if args.json:
            fmt.emit_json(doc)
        else:
            text = render.render(args.command, doc)
            if text:
                print(text)
        failed = doc.get("error")
        if failed:
            print(f"kvstore {args.command}: {failed}", file=sys.stderr)
        return EXIT_ERROR if failed else EXIT_OK
    except KVStoreError as e:
        print(f"kvstore {args.command}: {_message(e, args)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"kvstore {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvstore ls | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
