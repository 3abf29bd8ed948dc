"""Text out for the ``kvstore`` CLI: one renderer per command, from the same document
``--json`` prints, a progress bar, and the explanation of where a lookup stopped.

The helpers they share (human sizes and ages, tables, namespaces) and the text in
(argument types, token ids) are ``kvstore.cli.format``'s. Nothing here talks to a server.
"""

from __future__ import annotations

import sys
from typing import Any

from kvstore.cli.format import (
    describe_namespace,
    human_age,
    human_bytes,
    human_count,
    key_values,
    percent,
    table,
)
from kvstore.keys import Namespace

# -- text out: one renderer per command, from the same document --json prints ----------------


class Progress:
    """A progress bar on stderr: tqdm when installed, else one rewritten line (TTY only)."""

    def __init__(self, desc: str, total: int, *, enabled: bool = True) -> None:
        self.desc, self.total, self.n = desc, total, 0
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: Any = None
        if self.enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=desc, unit="chunk", file=sys.stderr, leave=False)

    def update(self) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled:
            sys.stderr.write(f"\r{self.desc} {self.n}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            sys.stderr.write("\r" + " " * (len(self.desc) + 24) + "\r")
            sys.stderr.flush()


def explain_stop(
    stop: str,
    stop_chunk: int,
    span: list[int] | None,
    chunks: list[dict[str, Any]],
    min_tokens: int,
    granularity: int,
) -> str:
    """Why a lookup stopped where it did, in a sentence."""
    where = f"chunk {stop_chunk}" + (f" (tokens {span[0]}-{span[1] - 1})" if span else "")
    if stop == "complete":
        return "every token of the prompt is stored"
    if stop == "diverged" and chunks and chunks[-1]["partial"]:
        m = chunks[-1]
        if m["tokens"] == m["stored_tokens"]:
            return (
                f"{where}: the stored chunk ends after its first {m['tokens']} tokens (it "
                "was the short last chunk of an earlier prompt)"
            )
        return (
            f"{where}: a stored chunk under the same prefix shares only its first "
            f"{m['tokens']} of {m['stored_tokens']} tokens with this prompt (the prompt "
            f"diverges within tokens {m['end']}-{m['end'] + granularity - 1})"
        )
    return {
        "not_stored": f"{where} was never stored (or was evicted long ago)",
        "evicted": f"{where} was evicted from every tier",
        "corrupt": f"{where} failed verification and was deleted",
        "deleted": f"{where} was deleted (kvstore delete or clear)",
        "below_min_tokens": f"the stored prefix is shorter than --min-tokens {min_tokens}: "
        "an engine gets 0",
        "granularity": f"an engine gets whole units of {granularity} tokens only",
    }.get(stop, f"{where}: {stop}")


def _render_stats(d: dict[str, Any]) -> str:
    lines = key_values(
        [
            ("server", f"{d['url']} (up {human_age(d.get('uptime_s', 0))})"),
            ("chunks", f"{human_count(d['chunks'])} in {d['namespaces']} namespaces"),
            (
                "lookups",
                f"{human_count(d['lookups'])}: matched {human_count(d['matched_tokens'])} "
                f"of {human_count(d['lookup_tokens'])} tokens "
                f"({percent(d['matched_tokens'], d['lookup_tokens'])})",
            ),
            ("gets", f"{human_count(d['gets'])} ({human_count(d['hits'])} hits)"),
            ("puts", f"{human_count(d['puts'])} ({human_count(d['rejected_puts'])} rejected)"),
            (
                "write-downs",
                f"{d['pending_writes']} pending ({human_bytes(d['pending_bytes'])}), "
                f"{d['write_failures']} failed",
            ),
            ("leases", f"{d.get('active_leases', 0)} active"),
        ]
    )
    rows = [
        [
            t["name"],
            t["level"],
            human_bytes(t["used_bytes"]),
            human_bytes(t["capacity_bytes"]),
            percent(t["used_bytes"], t["capacity_bytes"]),
            human_count(t["chunks"]),
            human_count(t["hits"]),
            human_count(t["misses"]),
            human_count(t["puts"]),
            human_count(t["evictions"]),
            t["corrupt"],
            t["errors"],
            t["rejected"],
            "yes" if t["healthy"] else "NO",
        ]
        for t in d["tiers"]
    ]
    right = (
        "LEVEL",
        "USED",
        "CAPACITY",
        "USE",
        "CHUNKS",
        "HITS",
        "MISSES",
        "PUTS",
        "EVICTIONS",
        "CORRUPT",
        "ERRORS",
        "REJECTED",
    )
    return (
        lines
        + "\n\n"
        + table(
            (
                "TIER",
                "LEVEL",
                "USED",
                "CAPACITY",
                "USE",
                "CHUNKS",
                "HITS",
                "MISSES",
                "PUTS",
                "EVICTIONS",
                "CORRUPT",
                "ERRORS",
                "REJECTED",
                "HEALTHY",
            ),
            rows,
            right=right,
        )
    )


def _express(d: dict[str, Any]) -> str:
    if not d.get("express_socket"):
        return "not offered"
    if d.get("express_used"):
        return f"{d['express_socket']}, used by this client"
    return f"{d['express_socket']}, not used (gRPC: not dialed over the Unix socket)"


def _render_info(d: dict[str, Any]) -> str:
    shm = "not offered"
    if d["shm_path"]:
        usable = (
            "usable from here"
            if d["shm_usable"]
            else f"not usable here: {d['shm_unusable_reason']}"
        )
        shm = f"{d['shm_path']} ({human_bytes(d['shm_size'])}), {usable}"
    return key_values(
        [
            ("server", d["url"]),
            (
                "version",
                f"kvstore-server {d['server_version']} (this client {d['client_version']})",
            ),
            (
                "native loops",
                f"server {d['native'] or 'unknown'}, this client {d['client_native']}",
            ),
            ("record format", d["record_format"]),
            ("key scheme", d["key_scheme"]),
            ("chunk tokens", d["chunk_tokens"]),
            ("granularity", f"{d['granularity']} tokens"),
            ("tiers", ", ".join(d["tiers"])),
            ("max chunk", human_bytes(d["max_chunk_bytes"])),
            ("max message", human_bytes(d["max_message_bytes"])),
            ("stream piece", human_bytes(d["piece_bytes"])),
            ("shared memory", shm),
            ("express plane", _express(d)),
            ("lease", f"{d['lease_ms']} ms"),
            ("auth", "token required" if d["auth_required"] else "none"),
        ]
    )


def _render_health(d: dict[str, Any]) -> str:
    if d["serving"]:
        version = f" (kvstore-server {d['server_version']})" if d.get("server_version") else ""
        return f"serving: {d['url']}{version}"
    return f"{d['status'].replace('_', ' ')}: {d['url']}"


def _render_ls(d: dict[str, Any]) -> str:
    if "namespaces" in d:
        if not d["namespaces"]:
            return "no namespaces: the store is empty"
        rows = [
            [
                n["fingerprint"],
                human_count(n["chunks"]),
                human_bytes(n["bytes"]),
                describe_namespace(_namespace(n["namespace"]) if n["namespace"] else None),
            ]
            for n in d["namespaces"]
        ]
        return table(("FINGERPRINT", "CHUNKS", "SIZE", "NAMESPACE"), rows, right=("CHUNKS", "SIZE"))
    if not d["chunks"]:
        return "no chunks match"
    many = d["namespace"] is None
    rows = [
        [
            *([c["fingerprint"][:8]] if many else []),
            c["key"],
            ",".join(c["tiers"]) or "-",
            human_bytes(c["size_bytes"]),
            c["tokens"],
            human_age(c["age_s"]),
            human_age(c["idle_s"]),
            human_count(c["hits"]),
            "yes" if c["pinned"] else "no",
        ]
        for c in d["chunks"]
    ]
    headers = (
        *(("NS",) if many else ()),
        "KEY",
        "TIERS",
        "SIZE",
        "TOKENS",
        "AGE",
        "IDLE",
        "HITS",
        "PINNED",
    )
    out = table(headers, rows, right=("SIZE", "TOKENS", "AGE", "IDLE", "HITS"))
    if d["truncated"]:
        out += f"\n(first {d['limit']} chunks shown; --limit 0 shows all)"
    return out


def _render_lookup(d: dict[str, Any]) -> str:
    ns = d["namespace"]
    fields = ns["fields"]
    named = describe_namespace(_namespace(fields)) if fields else "(fields unknown)"
    tiers = ", ".join(f"{t} {n}" for t, n in d["by_tier"].items())
    lines = [
        key_values(
            [
                ("namespace", f"{ns['fingerprint']}  {named}"),
                (
                    "matched",
                    f"{d['matched_tokens']} of {d['total_tokens']} tokens "
                    f"({percent(d['matched_tokens'], d['total_tokens'])})"
                    + (f"; stored prefix {d['stored_prefix_tokens']}" if d["cut"] else "")
                    + (f"; by tier: {tiers}" if tiers else ""),
                ),
            ]
        )
    ]
    rows = [
        [
            c["index"],
            f"{c['start']}-{c['end'] - 1}",
            f"{c['tokens']}/{c['stored_tokens']}",
            c["tier"],
            "partial" if c["partial"] else "hit",
            c["key"],
        ]
        for c in d["chunks"]
    ]
    if d["stop_span"] and not (d["chunks"] and d["chunks"][-1]["partial"]):
        s, e = d["stop_span"]
        rows.append(
            [d["stop_chunk"], f"{s}-{e - 1}", f"0/{e - s}", "-", d["stop"].replace("_", " "), ""]
        )
    if rows:
        lines.append(
            table(
                ("CHUNK", "TOKENS", "MATCHED", "TIER", "STATUS", "KEY"),
                rows,
                right=("CHUNK", "MATCHED"),
            )
        )
    lines.append(f"stop: {d['stop']}: {d['explanation']}")
    if d["cut"]:
        lines.append(f"cut: {d['cut']['reason']}: {d['cut']['explanation']}")
    n_chunks = -(-d["total_tokens"] // d["chunk_tokens"]) if d["chunk_tokens"] else 0
    after = (d["stop_chunk"] + 1) if d["stop_span"] else n_chunks
    if d["stop"] != "complete" and after < n_chunks:
        which = f"chunk {after}" if after == n_chunks - 1 else f"chunks {after}-{n_chunks - 1}"
        lines.append(
            f"{which} not looked at: a prefix match ends at the first chunk that is not stored"
        )
    if d["other_namespaces"]:
        lines.append(
            "other namespaces hold more of these tokens (KV of another model, dtype, "
            "layout, rank or salt is never served here):"
        )
        rows = [
            [
                o["fingerprint"],
                o["matched_tokens"],
                describe_namespace(_namespace(o["namespace"])) if o["namespace"] else "(unnamed)",
                ",".join(o["differs_in"]) or "?",
            ]
            for o in d["other_namespaces"]
        ]
        lines.append(
            table(("FINGERPRINT", "MATCHED", "NAMESPACE", "DIFFERS IN"), rows, right=("MATCHED",))
        )
    return "\n".join(lines)


def _namespace(fields: dict[str, Any]) -> Namespace:
    return Namespace(**{**fields, "extra": tuple(sorted(fields["extra"].items()))})


def _render_keys(d: dict[str, Any]) -> str:
    if "deleted" in d:
        out = f"deleted {d['deleted']} of {d['requested']} chunks"
        return out + (f" ({len(d['not_found'])} not stored)" if d["not_found"] else "")
    verb = "pinned" if d["pinned"] else "unpinned"
    return f"{verb} {d['changed']} of {d['requested']} chunks" + (
        f" (the other {d['requested'] - d['changed']} already were)"
        if d["changed"] < d["requested"] - len(d["not_found"])
        else ""
    )


def _render_clear(d: dict[str, Any]) -> str:
    what = "every namespace" if d["all"] else f"namespace {d['namespace']}"
    return f"removed {d['removed']} chunks of {what}"


def _render_bench(d: dict[str, Any]) -> str:
    if "suite" in d:  # the suite printed its own table
        where = f"; records in {d['json']}" if d.get("json") else ""
        return f"{len(d['records'])} benchmark records{where}"
    rows = [
        [
            op,
            human_count(d["count"] if op == "put" else d["count"] - d["get"]["missing"]),
            human_bytes(d[op]["bytes"]),
            f"{d[op]['seconds']:.3f}",
            f"{d[op]['gb_per_s']:.2f}",
        ]
        for op in ("put", "get")
    ]
    head = f"{d['count']} chunks of {human_bytes(d['size_bytes'])} via {d['plane']} ({d['url']})"
    tail = f"verified {d['verified']} of {d['count']} chunks byte for byte"
    return "\n".join(
        [
            head,
            table(
                ("OP", "CHUNKS", "BYTES", "SECONDS", "GB/S"),
                rows,
                right=("CHUNKS", "BYTES", "SECONDS", "GB/S"),
            ),
            tail,
        ]
    )


def render(command: str, doc: dict[str, Any]) -> str:
    """The human output of ``command`` from its document."""
    return {
        "stats": _render_stats,
        "info": _render_info,
        "health": _render_health,
        "ls": _render_ls,
        "lookup": _render_lookup,
        "delete": _render_keys,
        "pin": _render_keys,
        "unpin": _render_keys,
        "clear": _render_clear,
        "bench": _render_bench,
    }[command](doc)
