"""The ``kvstore`` CLI's arguments: every command, its options and their checks.

``kvstore.cli.main`` runs the commands; the values are checked here, as argparse reads
them, by the ``arg_*`` types of ``kvstore.cli.format`` (sizes by the one
``kvstore.config.parse_size``), so a bad value exits 2 with a message before any
call is made.
"""

from __future__ import annotations

import argparse

from kvstore import __version__
from kvstore.cli import format as fmt

# -- the parser --------------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    """Options every command takes, before or after its name (SUPPRESS: no clobbering)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection and output")
    g.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="server: grpc://HOST:PORT, grpcs://HOST:PORT or unix:///PATH (default: "
        "$KVSTORE_URL, else the server's default Unix socket)",
    )
    g.add_argument(
        "--token",
        default=argparse.SUPPRESS,
        help="bearer token, when the server requires one (default: $KVSTORE_TOKEN)",
    )
    g.add_argument(
        "--timeout",
        type=fmt.arg_positive(float),
        default=argparse.SUPPRESS,
        metavar="SECONDS",
        help="deadline of each call to the server (default: 10)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one machine-readable JSON document instead of tables",
    )
    return p


def _namespace_options(p: argparse.ArgumentParser, what: str) -> None:
    g = p.add_argument_group(
        "namespace",
        f"{what}: give its fingerprint, or the fields that make it up "
        "(the same ones the engine uses; the fingerprint is computed from them)",
    )
    g.add_argument(
        "--namespace-fp",
        "--namespace",
        dest="namespace_fp",
        type=fmt.arg_fingerprint,
        metavar="HEX",
        help="namespace fingerprint (32 hex digits, or a unique prefix)",
    )
    g.add_argument("--model", help="model id, e.g. meta-llama/Llama-3.1-8B")
    g.add_argument("--revision", default="", help="model revision or weights hash")
    g.add_argument("--dtype", default="", help="KV cache dtype, e.g. bfloat16")
    g.add_argument("--layout", default="", help="KV layout string, as the engine describes it")
    g.add_argument("--device", default="", help="device kind the KV was laid out for (cuda, cpu)")
    g.add_argument("--tp-rank", type=int, default=0, metavar="N", help="tensor-parallel rank")
    g.add_argument("--tp-size", type=int, default=1, metavar="N", help="tensor-parallel size")
    g.add_argument("--pp-rank", type=int, default=0, metavar="N", help="pipeline-parallel rank")
    g.add_argument("--pp-size", type=int, default=1, metavar="N", help="pipeline-parallel size")
    g.add_argument("--lora", default="", help="LoRA adapter name or hash")
    g.add_argument("--salt", default="", help="cache salt / tenant")
    g.add_argument(
        "--extra",
        type=fmt.arg_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other namespace field (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    p = argparse.ArgumentParser(
        prog="kvstore",
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect and manage a running kvstore-server (the tiered KV-cache store).",
        epilog="Every command takes --url, --token, --timeout and --json, before or after its "
        "name.\nExit status: 0 ok, 1 an error the message explains (e.g. the server is "
        "unreachable),\n2 bad arguments. `kvstore COMMAND --help` documents each command.",
    )
    p.add_argument("--version", action="version", version=f"kvstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help: str, description: str = "") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help, description=description or help)
        sp.set_defaults(parser=sp)
        return sp

    command("stats", "counters of the store and of each tier")
    command("info", "what the server is and offers: version, chunking, tiers, shared memory")
    command(
        "health",
        "exit 0 when the server is serving, 1 otherwise",
        "Ask the server's gRPC health check. Exit 0 when it is serving, 1 when it is "
        "unreachable or not serving (no token needed).",
    )

    sp = command(
        "ls",
        "list namespaces, or the chunks of one namespace",
        "Without a namespace: the namespaces the server holds chunks of. With one "
        "(or with --tier/--pinned/--all-chunks): its chunks, with their tiers, size, "
        "age, idle time, hits and pin state.",
    )
    sp.add_argument(
        "namespace_pos",
        nargs="?",
        type=fmt.arg_fingerprint,
        metavar="NAMESPACE_FP",
        help="namespace fingerprint (or a unique prefix) whose chunks to list",
    )
    sp.add_argument(
        "--tier", type=fmt.arg_tier, help="only chunks held by this tier: memory, disk, remote"
    )
    sp.add_argument("--pinned", action="store_true", help="only pinned chunks")
    sp.add_argument(
        "--all-chunks",
        action="store_true",
        help="list the chunks of every namespace instead of the namespaces",
    )
    sp.add_argument(
        "--limit",
        type=int,
        default=100,
        metavar="N",
        help="show at most N chunks; 0 for all (default: 100)",
    )
    _namespace_options(sp, "the namespace whose chunks to list")

    sp = command(
        "lookup",
        "how much of a prompt is stored, chunk by chunk, and why it stops",
        "Look a prompt up as an engine would: the longest stored prefix, which tier "
        "serves each chunk, and why matching stops (never stored, evicted, corrupt, "
        "deleted, diverged mid-chunk, below --min-tokens). Another namespace (model, "
        "dtype, layout, ...) holding more of the prompt is reported too. Token ids come "
        "from the arguments, --tokens-file, standard input, or --text with a local "
        "--tokenizer.",
    )
    sp.add_argument(
        "tokens",
        nargs="*",
        metavar="TOKEN_ID",
        help="token ids (spaces or commas between them); '-' reads standard input",
    )
    sp.add_argument(
        "--tokens-file",
        metavar="FILE",
        help="read token ids from FILE: whitespace or comma separated, or a JSON array",
    )
    sp.add_argument("--text", help="tokenize this text with --tokenizer instead")
    sp.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="local tokenizer: a model directory (transformers.AutoTokenizer) or a "
        "tokenizer.json file (tokenizers); nothing is downloaded",
    )
    sp.add_argument(
        "--no-special-tokens",
        dest="special_tokens",
        action="store_false",
        help="do not add the tokenizer's special tokens (e.g. BOS) to --text",
    )
    sp.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        metavar="N",
        help="report 0 when fewer than N tokens match (as an engine would)",
    )
    sp.add_argument(
        "--granularity",
        type=int,
        default=0,
        metavar="N",
        help="round the match down to N tokens (the engine's block size; default: the server's)",
    )
    _namespace_options(sp, "the namespace to look the prompt up in")

    for name, verb in (("delete", "delete"), ("pin", "pin"), ("unpin", "unpin")):
        what = {
            "delete": "delete chunks from every tier",
            "pin": "pin chunks: never evicted until unpinned",
            "unpin": "unpin chunks: evictable again",
        }[name]
        sp = command(
            name,
            what,
            what[0].upper() + what[1:] + ". Keys are the 64-hex-digit "
            "chunk keys `kvstore ls` and `kvstore lookup` print."
            + ("" if name == "delete" else " Exit 1 when a key is not stored."),
        )
        sp.add_argument(
            "keys", nargs="+", type=fmt.arg_key, metavar="KEY", help=f"chunk key to {verb}"
        )

    sp = command(
        "clear",
        "remove every chunk of one namespace, or of all namespaces",
        "Remove every chunk of one namespace (NAMESPACE_FP or the namespace fields), or "
        "of every namespace with --all. Asks for confirmation on a terminal; --yes "
        "skips it. Without a terminal and without --yes it refuses (exit 1).",
    )
    sp.add_argument(
        "namespace_pos",
        nargs="?",
        type=fmt.arg_fingerprint,
        metavar="NAMESPACE_FP",
        help="namespace fingerprint (or a unique prefix) to clear",
    )
    sp.add_argument("--all", action="store_true", help="clear every namespace")
    sp.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    _namespace_options(sp, "the namespace to clear")

    sp = command(
        "bench",
        "put/get throughput against the server, with verification",
        "Put COUNT chunks of SIZE bytes (random bytes, a throwaway namespace), read "
        "them back, verify every byte, report GB/s for each, then delete them.",
    )
    sp.add_argument(
        "--size",
        type=fmt.arg_size,
        default=8 << 20,
        metavar="SIZE",
        help="payload bytes per chunk, e.g. 512KiB, 8MiB (default: 8MiB)",
    )
    sp.add_argument(
        "--count",
        type=fmt.arg_positive(int),
        default=32,
        metavar="N",
        help="chunks to put and get (default: 32)",
    )
    sp.add_argument(
        "--shm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="insist on (--shm) or avoid (--no-shm) the shared-memory data plane "
        "(default: use it when on the server's host)",
    )
    sp.add_argument("--keep", action="store_true", help="keep the chunks instead of deleting")
    sp.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar on stderr"
    )
    sp.add_argument(
        "--suite",
        nargs="?",
        const="all",
        metavar="NAME[,NAME]",
        help="run the benchmark suite instead (`python -m kvstore.benchmarks`, installed "
        "with kvstore): all suites, or some of store, remote, server, concurrency, "
        "connector, replay, serving, serving_cores. It starts its own servers; --url is not "
        "used",
    )
    sp.add_argument("--quick", action="store_true", help="with --suite: the quick subset")
    sp.add_argument("--out", metavar="FILE", help="with --suite: write the records as JSON")
    sp.add_argument(
        "--no-save",
        action="store_true",
        help="with --suite: leave RESULTS.md and the plots alone (benchmarks/ in a "
        "checkout, else ./kvstore-bench/)",
    )
    return p
