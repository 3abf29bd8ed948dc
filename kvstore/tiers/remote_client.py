"""The Redis/Valkey client behind L3: URL parsing and the client library's classes.

``redis://``, ``rediss://`` and ``unix://`` use the ``redis`` client, ``valkey://``
and ``valkeys://`` the ``valkey`` client; ``?cluster=1`` selects the cluster client.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvstore.errors import ConfigError

OWN_PARAMS = ("cluster",)  # query parameters kvstore reads and the client must not see


def parse_url(url: str) -> tuple[str, bool, str]:
    """(client flavor "redis" or "valkey", cluster mode, URL for the client library)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
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
