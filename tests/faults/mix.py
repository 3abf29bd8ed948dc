"""Moved to ``kvstore.testing.mix`` (issue 17); this shim goes once no test imports it."""

from kvstore.testing.mix import (  # moved
    DOWN,
    Ledger,
    Mix,
    MixConfig,
    Tally,
    payload_for,
    reconcile,
    wait_for,
)

__all__ = ["DOWN", "Ledger", "Mix", "MixConfig", "Tally", "payload_for", "reconcile", "wait_for"]
