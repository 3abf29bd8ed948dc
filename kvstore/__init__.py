"""kvstore: a tiered KV-cache store for LLM inference.

``kvstore.Client`` and ``kvstore.AsyncClient`` (the SDK of kvstore-server) are
imported on first use, so ``import kvstore`` stays cheap and does not load grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "__version__"]

if TYPE_CHECKING:
    from kvstore.sdk.aio import AsyncClient
    from kvstore.sdk.client import Client


def __getattr__(name: str) -> Any:
    if name in ("Client", "AsyncClient"):  # the SDK's face imports them on first use
        from kvstore import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
