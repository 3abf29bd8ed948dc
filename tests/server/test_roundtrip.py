"""Round trips through a real kvstore-server that are not the clients' contract.

What both clients promise (both data planes, put/get, lookup, management, leases,
reservations, tenants, errors, close) is tests/server/test_client_contract.py, run
against ``Client`` and ``AsyncClient`` alike.
"""

from __future__ import annotations

from kvstore.testing.server import KVServer


def test_reflection_and_health_are_on(server: KVServer) -> None:
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(f"unix:{server.socket}") as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= services, services
