"""Text in and out for the ``kvstore`` CLI: argument values and token ids in; human
sizes, ages, aligned tables and JSON documents out.

Kept apart from ``kvstore/cli/main.py`` so the commands read as "ask the server,
build a document, render it", and so the formatting rules (what a person sees
versus what a script parses) live in one place. Nothing here talks to a server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

from kvstore.config import parse_size
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import FINGERPRINT_BYTES, ChunkKey, Namespace, parse_key
from kvstore.types import ChunkMatches, TierLevel, tier_label

Doc = dict[str, Any]  # what a command returns: rendered for people, or printed as JSON


class CLIError(KVStoreError):
    """An expected failure: printed as one line on stderr, exit status 1."""


def human_bytes(n: float) -> str:
    """12.0 MiB, 512 B: binary units, one decimal."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    """3m12s, 45s, 2h05m, 3d04h: the two largest units, like `ps` and `kubectl`."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def human_count(n: int) -> str:
    return f"{n:,}"


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def tier_names(levels: Iterable[int]) -> str:
    return ",".join(tier_label(t) for t in levels) or "-"


def namespace_fields(ns: Namespace | None) -> dict[str, Any] | None:
    """A Namespace as a JSON object (``extra`` as a mapping), None when unknown."""
    if ns is None:
        return None
    data = dataclasses.asdict(ns)
    data["extra"] = dict(ns.extra)
    return data


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Namespace)}


def describe_namespace(ns: Namespace | None) -> str:
    """The fields that differ from their defaults: "model=m dtype=bfloat16 tp=1/2"."""
    if ns is None:
        return "(unnamed: no client described it yet)"
    parts = []
    for name, value in dataclasses.asdict(ns).items():
        if name in ("tp_rank", "tp_size", "pp_rank", "pp_size", "extra"):
            continue
        if value != _DEFAULTS.get(name):
            parts.append(f"{name}={value}")
    for kind in ("tp", "pp"):
        rank, size = getattr(ns, f"{kind}_rank"), getattr(ns, f"{kind}_size")
        if size != 1:
            parts.append(f"{kind}={rank}/{size}")
    parts.extend(f"{k}={v}" for k, v in ns.extra)
    return " ".join(parts)


def namespace_diff(mine: Namespace, other: Namespace) -> list[str]:
    """Names of the fields in which two namespaces differ (why they do not share KV)."""
    a, b = dataclasses.asdict(mine), dataclasses.asdict(other)
    return [name for name in a if a[name] != b[name]]


def table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Sequence[str] = ()
) -> str:
    """An aligned plain-text table; columns named in ``right`` are right-aligned (numbers)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(row: Sequence[str]) -> str:
        out = []
        for i, c in enumerate(row):
            out.append(c.rjust(widths[i]) if headers[i] in right else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


def key_values(pairs: Sequence[tuple[str, Any]]) -> str:
    """ "name:  value" lines with the values aligned."""
    width = max((len(k) for k, _ in pairs), default=0) + 1
    return "\n".join(f"{(k + ':').ljust(width)}  {v}" for k, v in pairs)


def emit_json(doc: Any, out: IO[str] | None = None) -> None:
    """One JSON document on stdout (bytes as hex, dataclasses as objects)."""
    out = out or sys.stdout
    json.dump(doc, out, indent=2, default=_json_default)
    out.write("\n")


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset, tuple, ChunkMatches)):
        return list(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


# -- text in: argument types (a bad value is an argparse error, exit 2) and token ids ----------


def arg_key(text: str) -> ChunkKey:
    try:
        return parse_key(text)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def arg_fingerprint(text: str) -> str:
    """A namespace fingerprint in hex, or a prefix of one (resolved against the server)."""
    t = text.lower().strip()
    if not t or len(t) > FINGERPRINT_BYTES * 2 or any(c not in "0123456789abcdef" for c in t):
        raise argparse.ArgumentTypeError(
            f"a namespace fingerprint is {FINGERPRINT_BYTES * 2} hex characters (a unique "
            f"prefix will do), got {text!r}"
        )
    return t


def arg_size(text: str) -> int:
    """A positive byte size, by the config's rule (``kvstore.config.parse_size``)."""
    try:
        n = parse_size(text, "")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if n <= 0:
        raise argparse.ArgumentTypeError("the size must be positive")
    return n


def arg_positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from e
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return check


def arg_tier(text: str) -> int:
    t = text.lower()
    for level in TierLevel:
        if t in (level.label, str(int(level))):
            return int(level)
    names = ", ".join(level.label for level in TierLevel)
    numbers = ", ".join(str(int(level)) for level in TierLevel)
    raise argparse.ArgumentTypeError(f"{text!r}: a tier is {names} (or {numbers})")


def arg_pair(text: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return k, v


def read_token_ids(text: str, source: str) -> list[int]:
    """Token ids separated by whitespace or commas, or a JSON array of integers."""
    text = text.strip()
    try:
        if text.startswith("["):
            values = json.loads(text)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ValueError("the JSON array must hold integers")
            return list(values)
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise CLIError(f"{source}: expected token ids (integers): {e}") from e


def load_tokenizer(path: str, special: bool) -> Callable[[str], list[int]]:
    """Encode with a local tokenizer; network access is switched off before loading.

    A model directory with a tokenizer config goes through transformers.AutoTokenizer
    (what vLLM uses, so the ids match the engine's); a bare tokenizer.json (or a
    directory holding only that) through the lighter ``tokenizers`` library.
    """
    p = os.path.expanduser(path)
    tj = os.path.join(p, "tokenizer.json") if os.path.isdir(p) else p
    has_config = os.path.isdir(p) and any(
        os.path.exists(os.path.join(p, f)) for f in ("tokenizer_config.json", "config.json")
    )
    if has_config:
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        try:
            from transformers import AutoTokenizer
        except ImportError:
            pass
        else:
            try:
                tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
            except Exception as e:  # transformers raises many kinds; all mean "cannot load"
                raise CLIError(f"--tokenizer {path}: cannot load it: {e}") from e
            return lambda s: list(tok.encode(s, add_special_tokens=special))
    if os.path.isfile(tj):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise CLIError("--tokenizer needs the `tokenizers` or `transformers` package") from e
        try:
            t = Tokenizer.from_file(tj)
        except Exception as e:  # the Rust binding raises a bare Exception
            raise CLIError(f"--tokenizer {tj}: cannot load it: {e}") from e
        return lambda s: list(t.encode(s, add_special_tokens=special).ids)
    raise CLIError(f"--tokenizer {path}: no tokenizer.json or tokenizer_config.json there")


def lookup_tokens(args: argparse.Namespace) -> list[int]:
    """The token ids of `kvstore lookup`: arguments, --tokens-file, --text or stdin."""
    sources = sum(bool(x) for x in (args.tokens, args.tokens_file, args.text))
    if sources > 1:
        args.parser.error("give token ids one way: arguments, --tokens-file or --text")
    if args.tokenizer and args.text is None:
        args.parser.error('--tokenizer goes with --text "..." (the text to tokenize)')
    if args.text is not None:
        if not args.tokenizer:
            args.parser.error("--text needs --tokenizer DIR (a local tokenizer)")
        return load_tokenizer(args.tokenizer, args.special_tokens)(args.text)
    if args.tokens_file:
        try:
            with open(args.tokens_file) as f:
                return read_token_ids(f.read(), args.tokens_file)
        except OSError as e:
            raise CLIError(f"--tokens-file: {e}") from e
    if args.tokens and args.tokens != ["-"]:
        try:
            return read_token_ids(" ".join(args.tokens), "TOKEN_ID")
        except CLIError as e:
            args.parser.error(str(e))
    if sys.stdin.isatty() and args.tokens != ["-"]:
        args.parser.error("give token ids as arguments, --tokens-file, --text or on stdin")
    return read_token_ids(sys.stdin.read(), "standard input")
