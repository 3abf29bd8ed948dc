"""Moved to ``kvstore.testing.redis`` (issue 17); this shim goes once no test imports it."""

from kvstore.testing.redis import FLAVORS, RedisServer, ServerCluster, available, free_port  # moved

__all__ = ["FLAVORS", "RedisServer", "ServerCluster", "available", "free_port"]
