"""The Redis/Valkey client behind L3: URL parsing and the client library's classes.

``redis://``, ``rediss://`` and ``unix://`` use the ``redis`` client, ``valkey://``
and ``valkeys://`` the ``valkey`` client; ``?cluster=1`` selects the cluster client.
``redis+sentinel://host:port[,host:port...]/service[/db]`` (and ``valkey+sentinel://``)
asks the sentinels at those addresses for the primary of ``service``
(``redis.sentinel.Sentinel`` / ``valkey.sentinel.Sentinel``), again whenever a
connection to it fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from kvstore.errors import ConfigError

OWN_PARAMS = ("cluster",)  # query parameters kvstore reads and the client must not see


def parse_url(url: str) -> tuple[str, bool, str]:
    """(client flavor "redis" or "valkey", cluster mode, URL for the client library)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in SENTINEL_SCHEMES:
        return scheme.split("+")[0], False, url
    if scheme not in ("redis", "rediss", "unix", "valkey", "valkeys"):
        raise ConfigError(f"remote.url={url!r}: unsupported scheme {scheme!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    cluster = False
    for name, value in query:
        if name == "cluster":
            if value.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
                raise ConfigError(f"remote.url: cluster={value!r}: expected 1/0 or true/false")
            cluster = value.lower() in ("1", "true", "yes", "on", "")
    if cluster and scheme == "unix":
        raise ConfigError("remote.url: cluster mode needs TCP addresses, not unix://")
    rest = urlencode([(k, v) for k, v in query if k not in OWN_PARAMS])
    flavor = "valkey" if scheme.startswith("valkey") else "redis"
    return flavor, cluster, urlunsplit(parts._replace(query=rest))


SENTINEL_SCHEMES = ("redis+sentinel", "valkey+sentinel")


@dataclass(frozen=True)
class SentinelSpec:
    """What a ``redis+sentinel://`` URL says: where the sentinels are, which service."""

    flavor: str
    sentinels: tuple[tuple[str, int], ...]
    service: str
    username: str | None = None
    password: str | None = None  # of the data nodes (the primary and its replicas)
    db: int = 0

    def client(self, kwargs: dict[str, Any]) -> Any:
        """The library's client of the current primary (it re-asks the sentinels on
        every new connection, so it follows a failover)."""
        if self.flavor == "valkey":
            from valkey.sentinel import Sentinel
        else:
            from redis.sentinel import Sentinel  # type: ignore[assignment]
        timeouts = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout")}
        sentinel = Sentinel(list(self.sentinels), sentinel_kwargs=timeouts, **timeouts)
        return sentinel.master_for(
            self.service,
            username=self.username,
            password=self.password,
            db=self.db,
            **kwargs,
        )


def parse_sentinel(url: str) -> SentinelSpec | None:
    """The sentinel part of a ``redis+sentinel://`` URL; None for any other URL.
    Raises ConfigError for a sentinel URL that does not say where and what."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SENTINEL_SCHEMES:
        return None
    where = f"remote.url={redact(url)!r}"
    netloc = parts.netloc.rsplit("@", 1)
    hosts: list[tuple[str, int]] = []
    for item in netloc[-1].split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"{where}: sentinel {item!r} is not host:port")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ConfigError(f"{where}: expected /<service name>[/<db>] after the sentinels")
    user = password = None
    if len(netloc) == 2:
        user, _, password = netloc[0].partition(":")
        user, password = unquote(user) or None, unquote(password) or None
    return SentinelSpec(
        scheme.split("+")[0],
        tuple(hosts),
        unquote(path[0]),
        user,
        password,
        int(path[1]) if len(path) == 2 else 0,
    )


def sentinel_primary(client: Any) -> tuple[str, int]:
    """The primary the sentinels name now, for a client made by ``SentinelSpec.client``."""
    host, port = client.connection_pool.get_master_address()
    return str(host), int(port)


def redact(url: str) -> str:
    """The URL without its password, for stats and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def client_classes(
    flavor: str, cluster: bool
) -> tuple[Any, Any, tuple[type[BaseException], ...], tuple[type[BaseException], ...], type]:
    """(client class, no-retry policy, "remote down" errors, all backend errors, OOM error)."""
    exc: Any
    plain: Any
    cluster_cls: Any
    if flavor == "redis":
        import redis
        import redis.exceptions
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry as LibRetry

        exc, plain, cluster_cls = redis.exceptions, redis.Redis, RedisCluster
        base, cluster_exc = exc.RedisError, exc.RedisClusterException
        no_retry: Any = LibRetry(NoBackoff(), 0)
    else:
        import valkey
        import valkey.backoff
        import valkey.exceptions
        import valkey.retry
        from valkey.cluster import ValkeyCluster

        exc, plain, cluster_cls = valkey.exceptions, valkey.Valkey, ValkeyCluster
        base, cluster_exc = exc.ValkeyError, exc.ValkeyClusterException
        no_retry = valkey.retry.Retry(valkey.backoff.NoBackoff(), 0)
    down: tuple[type[BaseException], ...] = (
        exc.ConnectionError,
        exc.TimeoutError,
        exc.ClusterError,
        exc.TryAgainError,
        cluster_exc,
        OSError,
    )
    return (
        cluster_cls if cluster else plain,
        no_retry,
        down,
        (base, cluster_exc, OSError),
        exc.OutOfMemoryError,
    )
