"""Typed, frozen configuration, parsed once at the edge.

Sources, later ones winning: defaults, a TOML file, ``KVSTORE_*`` environment
variables, explicit overrides (command-line flags). Every value is checked when
the dataclass is built; a bad one raises ``ConfigError`` saying what was given
and what is allowed. ``docs/configuration.md`` lists every field.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import stat
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from kvstore.errors import ConfigError
from kvstore.presence import check_bits_bytes

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": 1000,
    "kib": KiB,
    "m": MiB,
    "mb": 1000**2,
    "mib": MiB,
    "g": GiB,
    "gb": 1000**3,
    "gib": GiB,
    "t": TiB,
    "tb": 1000**4,
    "tib": TiB,
}

# String options are Literal types: check_choices (the one check of them) reads their
# allowed values from the type, and mypy holds code to them.
WritePolicy = Literal["write-through", "write-back"]
Durability = Literal["process", "fsync"]
CodecName = Literal["raw", "zstd", "zstd_shuffle"]
WRITE_POLICIES: tuple[str, ...] = typing.get_args(WritePolicy)
DURABILITY: tuple[str, ...] = typing.get_args(Durability)
CODECS: tuple[str, ...] = typing.get_args(CodecName)
AUTH_KEY_MIN_BYTES, AUTH_KEY_MAX_BYTES = 16, 4096  # remote.auth_key_file, once stripped


def parse_size(value: object, what: str = "size") -> int:
    """Bytes from an int or a string like "64M", "64MiB", "1.5 GB", "4096".

    The one size rule of kvstore: config files, environment, server flags, the
    connector's settings, ``kvstore bench --size`` and the benchmarks all read sizes
    here. K/M/G/T alone are binary, like KiB/MiB/GiB/TiB ("64M" is 67,108,864 bytes);
    KB/MB/GB/TB are decimal ("64MB" is 64,000,000). ``what`` names the setting in
    the error; "" leaves it out (argparse names the flag itself).
    """
    where = f"{what}: " if what else ""
    if isinstance(value, bool):
        raise ConfigError(f"{where}expected a byte size, got {value!r}")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{where}{value!r} is not a size; use bytes or a number with a unit: "
            "K/KiB, M/MiB, G/GiB, T/TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return os.path.join(base, "kvstore")


@dataclass(frozen=True)
class MemoryConfig:
    """L1: the shared-memory arena."""

    capacity_bytes: int = 1 * GiB  # bytes of L1's pages in the arena file; fixed for its lifetime
    page_bytes: int = 64 * KiB  # allocation unit; a power of two >= 4 KiB
    path: str = ""  # the arena file; "" = a fresh file under /dev/shm named after the process
    lease_ms: int = 30_000  # a reservation or read lease not released by then is reclaimed
    verify_reads: bool = (
        True  # checksum every read (catches arena corruption); off: commits are hashed instead
    )
    # Bits of the presence filter (kvstore.presence) after the pages, in the same file: how
    # same-host clients answer a lookup of a prompt nothing was stored for without a call.
    # A power of two >= 4096; 0: no filter. Off by itself with a remote tier.
    presence_bytes: int = 8 * MiB

    def __post_init__(self) -> None:
        _require(
            self.page_bytes >= 4 * KiB and self.page_bytes & (self.page_bytes - 1) == 0,
            f"memory.page_bytes={self.page_bytes}: must be a power of two >= 4096",
        )
        _require(
            self.capacity_bytes >= self.page_bytes,
            f"memory.capacity_bytes={self.capacity_bytes}: must hold at least one page "
            f"({self.page_bytes} bytes)",
        )
        _require(self.lease_ms > 0, f"memory.lease_ms={self.lease_ms}: must be > 0")
        why = check_bits_bytes(self.presence_bytes)
        _require(why is None, f"memory.presence_bytes={self.presence_bytes}: {why}")


@dataclass(frozen=True)
class DiskConfig:
    """L2: LMDB on local disk."""

    enabled: bool = True  # false: no L2 (chunks evicted from L1 go to L3 or are dropped)
    path: str = ""  # LMDB directory; "" = <data dir>/lmdb
    capacity_bytes: int = 16 * GiB  # stored record bytes; LMDB's map is sized above this
    codec: CodecName = "raw"  # payload codec on disk: raw, zstd, zstd_shuffle
    level: int = 1  # zstd level when a zstd codec is chosen (1-19)
    durability: Durability = "process"  # process: survives kill -9; fsync: also power loss

    def __post_init__(self) -> None:
        _require(
            self.capacity_bytes >= 1 * MiB,
            f"disk.capacity_bytes={self.capacity_bytes}: must be at least 1 MiB",
        )
        check_choices(self, "disk")
        _require(1 <= self.level <= 19, f"disk.level={self.level}: allowed 1-19")

    def resolved_path(self, data_dir: str) -> str:
        return self.path or os.path.join(data_dir, "lmdb")


@dataclass(frozen=True)
class RemoteConfig:
    """L3: Redis or Valkey, standalone or cluster."""

    # redis://, rediss://, valkey://, valkeys://; "?cluster=1" for cluster mode;
    # redis+sentinel://host:port[,host:port...]/service (or valkey+sentinel://); "" = off
    url: str = ""
    capacity_bytes: int = (
        0  # 0: no kvstore-side limit (set maxmemory-policy allkeys-lru on the server)
    )
    codec: CodecName = "zstd_shuffle"  # payload codec on the wire and in the remote store
    level: int = 1  # zstd level
    prefix: str = "kvs"  # key prefix, so several deployments can share one Redis
    timeout_ms: int = 500  # deadline of every remote call
    connect_timeout_ms: int = 500  # deadline of connecting
    retries: int = 1  # retries of a failed call (with backoff) before it counts as a failure
    backoff_ms: int = 20  # first retry delay; doubles each retry
    failure_threshold: int = 3  # consecutive failures that open the circuit breaker
    cooldown_ms: int = 5_000  # how long an open breaker skips the remote before one trial call
    # file holding the key shared by the servers: records in L3 carry an HMAC made with it,
    # and a record without a valid one is not served; "" = records are not authenticated
    auth_key_file: str = ""

    def __post_init__(self) -> None:
        self.auth_key()  # a key file that is missing, unsafe or too short stops the start
        if self.url:
            _require(
                re.match(
                    r"^(redis|rediss|valkey|valkeys|redis\+sentinel|valkey\+sentinel)://", self.url
                )
                is not None,
                f"remote.url={self.url!r}: must start with redis://, rediss://, valkey://, "
                "valkeys://, redis+sentinel:// or valkey+sentinel://",
            )
            if "+sentinel://" in self.url:
                # host:port[,host:port...] of the sentinels, then /<service name>[/<db>]
                _require(
                    re.fullmatch(
                        r"[a-z+]+://([^@/]*@)?[^,/:@]+:\d{1,5}(,[^,/:@]+:\d{1,5})*/[^/?#]+(/\d+)?",
                        self.url.split("?", 1)[0],
                    )
                    is not None,
                    f"remote.url: a sentinel URL is redis+sentinel://[user:password@]"
                    f"host:port[,host:port...]/<service name>[/<db>], got "
                    f"{re.sub(r'://[^@/]*@', '://***@', self.url)!r}",
                )
        _require(self.capacity_bytes >= 0, "remote.capacity_bytes must be >= 0")
        check_choices(self, "remote")
        _require(1 <= self.level <= 19, f"remote.level={self.level}: allowed 1-19")
        _require(
            bool(re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", self.prefix)),
            f"remote.prefix={self.prefix!r}: 1-64 of [A-Za-z0-9_.:-]",
        )
        for name in ("timeout_ms", "connect_timeout_ms", "cooldown_ms"):
            _require(getattr(self, name) > 0, f"remote.{name} must be > 0")
        _require(
            self.retries >= 0 and self.backoff_ms >= 0, "remote.retries and backoff_ms must be >= 0"
        )
        _require(self.failure_threshold >= 1, "remote.failure_threshold must be >= 1")

    def auth_key(self) -> bytes | None:
        """The record authentication key (``auth_key_file``'s bytes, surrounding whitespace
        stripped), or None without one. Messages name the file, never its contents."""
        if not self.auth_key_file:
            return None
        where = f"remote.auth_key_file={self.auth_key_file!r}"
        path = os.path.expanduser(self.auth_key_file)
        try:
            mode = os.stat(path).st_mode  # before open: opening a FIFO would block
            _require(stat.S_ISREG(mode), f"{where}: not a regular file")
            _require(
                not mode & 0o022,
                f"{where}: writable by group or others (mode {stat.S_IMODE(mode):04o}); "
                "whoever can change the key can forge records: chmod 600 it",
            )
            with open(path, "rb") as f:
                key = f.read(AUTH_KEY_MAX_BYTES + 1).strip()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read it: {e.strerror or e}") from e
        _require(
            AUTH_KEY_MIN_BYTES <= len(key) <= AUTH_KEY_MAX_BYTES,
            f"{where}: the key must be {AUTH_KEY_MIN_BYTES}-{AUTH_KEY_MAX_BYTES} bytes "
            f"(surrounding whitespace aside), the file holds "
            f"{len(key) if len(key) <= AUTH_KEY_MAX_BYTES else 'more'}; "
            "make one with `openssl rand -hex 32 > FILE`",
        )
        return key


@dataclass(frozen=True)
class StoreConfig:
    """The tiered store: chunking, lookup granularity, write policy and the tiers."""

    data_dir: str = field(default_factory=default_data_dir)  # where L2 and the lock file live
    chunk_tokens: int = 256  # tokens per chunk (the last chunk of a prompt may be shorter)
    # partial-match unit in tokens; divides chunk_tokens (the engine's block size or a divisor)
    granularity: int = 16
    # write-through: every put goes down asynchronously; write-back: only on eviction
    write_policy: WritePolicy = "write-through"
    write_queue_bytes: int = 256 * MiB  # bytes waiting to be written down; puts wait beyond this
    max_chunk_bytes: int = 256 * MiB  # largest record accepted
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)

    def __post_init__(self) -> None:
        _require(self.chunk_tokens > 0, f"chunk_tokens={self.chunk_tokens}: must be > 0")
        _require(
            self.granularity > 0 and self.chunk_tokens % self.granularity == 0,
            f"granularity={self.granularity}: must be > 0 and divide "
            f"chunk_tokens={self.chunk_tokens}",
        )
        check_choices(self)
        _require(self.write_queue_bytes >= 0, "write_queue_bytes must be >= 0")
        _require(self.max_chunk_bytes > 0, "max_chunk_bytes must be > 0")


T = TypeVar("T")


@functools.cache
def _choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The Literal-typed fields of a config class and the values each allows."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: typing.get_args(hints[f.name])
        for f in dataclasses.fields(cls)
        if typing.get_origin(hints[f.name]) is Literal
    }


def check_choices(cfg: Any, where: str = "") -> None:
    """Every string option of a config (a Literal-typed field) holds an allowed value;
    ConfigError naming the setting, what it got and what is allowed. The one check of
    them, called by each config's ``__post_init__``."""
    cls: type = type(cfg)
    for name, allowed in _choices(cls).items():
        value = getattr(cfg, name)
        if value not in allowed:
            setting = f"{where}.{name}" if where else name
            raise ConfigError(f"{setting}={value!r}: allowed {', '.join(str(a) for a in allowed)}")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table of settings, got {value!r}")
        return build(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if where.rsplit(".", 1)[-1].endswith("_bytes"):
            return parse_size(value, where)
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        try:
            return int(str(value).replace("_", "")) if not isinstance(value, int) else value
        except ValueError:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if tp is str or typing.get_origin(tp) is Literal:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        (inner, *_rest) = typing.get_args(tp)
        return tuple(_coerce(v, inner, where) for v in value)
    return value


def build(cls: type[T], values: Mapping[str, Any], where: str = "") -> T:
    """Build a config dataclass from plain values, rejecting unknown keys."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown setting(s) {', '.join(prefix + u for u in unknown)}; "
            f"allowed: {', '.join(sorted(names))}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def env_values(cls: type, env: Mapping[str, str], prefix: str = "KVSTORE_") -> dict[str, Any]:
    """Settings from variables like KVSTORE_CHUNK_TOKENS or KVSTORE_DISK_CAPACITY_BYTES."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            nested = env_values(tp, env, f"{prefix}{f.name.upper()}_")  # type: ignore[arg-type]
            if nested:
                out[f.name] = nested
        elif f"{prefix}{f.name.upper()}" in env:
            out[f.name] = env[f"{prefix}{f.name.upper()}"]
    return out


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from e


def load(
    cls: type[T],
    *,
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    section: str | None = None,
    env_prefix: str = "KVSTORE_",
) -> T:
    """Defaults < file < environment < overrides, validated once."""
    values: dict[str, Any] = {}
    if file is not None:
        data = read_toml(Path(file).expanduser())
        values = dict(data.get(section, {})) if section else data
    values = merge(values, env_values(cls, os.environ if env is None else env, env_prefix))
    values = merge(values, {k: v for k, v in (overrides or {}).items() if v is not None})
    return build(cls, values)


def load_store_config(
    file: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> StoreConfig:
    return load(StoreConfig, file=file, env=env, overrides=overrides)
