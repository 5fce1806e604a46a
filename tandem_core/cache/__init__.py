"""Caches for agent sessions: resident prefix and anchors, snapshot store, disk tier, session spill, memory gate.

Every tier reads a sequence only through ``tandem_core.state.ModelState`` (sections and
views), so any model's state goes through them unchanged. ``docs/caches.md`` explains
them; ``CacheStack`` puts them together for one engine.
"""

from tandem_core.cache.base import (
    GEN_END, GRID, PROMPT_END, RESTORED, Anchor, CacheContext, CostModel, Hit, PrefillStart, Releasable, Snapshot,
    SnapshotTier, TierStats,
)
from tandem_core.cache.disk import DiskTier
from tandem_core.cache.gate import MemoryGate, MemoryGateError
from tandem_core.cache.resident import ResidentPrefix, ResumePlan
from tandem_core.cache.spill import SessionSpill
from tandem_core.cache.stack import CacheStack, Prefilled
from tandem_core.cache.store import SnapshotStore

__all__ = [
    "GEN_END", "GRID", "PROMPT_END", "RESTORED", "Anchor", "CacheContext", "CostModel", "Hit", "PrefillStart",
    "Releasable", "Snapshot", "SnapshotTier", "TierStats", "DiskTier", "MemoryGate", "MemoryGateError",
    "ResidentPrefix", "ResumePlan", "SessionSpill", "CacheStack", "Prefilled", "SnapshotStore",
]
