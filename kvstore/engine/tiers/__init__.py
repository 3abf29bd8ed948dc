"""Storage tiers behind one interface (see base.py for the contract)."""

from kvstore.engine.tiers.base import ChunkInfo, Tier
from kvstore.types import PutStatus, TierStats

__all__ = ["ChunkInfo", "PutStatus", "Tier", "TierStats"]
