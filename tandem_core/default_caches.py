"""The core's cache tiers and their switches, registered through the same hooks as any plugin's.

Registering imports nothing heavy: the tiers are named by import path. A registered
tier class has ``build(ctx: tandem_core.cache.CacheContext)``.
"""

from __future__ import annotations

from typing import Callable

from tandem_core.plugins import hookimpl, settings_hook
from tandem_core.settings import Setting

GiB = 1 << 30


@hookimpl
def tandem_cache_tiers(register: Callable[[str, str], None]) -> None:
    register("resident", "tandem_core.cache.resident:ResidentPrefix")
    register("store", "tandem_core.cache.store:SnapshotStore")
    register("disk", "tandem_core.cache.disk:DiskTier")
    register("spill", "tandem_core.cache.spill:SessionSpill")


tandem_settings = settings_hook(
    Setting("CACHE_ANCHOR_EVERY", 1024, "tandem_core.cache.resident",
            "tokens between the resident prefix's recurrent-state anchors", int),
    Setting("CACHE_ANCHOR_BYTES", 4 * GiB, "tandem_core.cache.resident",
            "bytes the resident prefix's anchors may hold (0: no limit); over it the least valuable go", int),
    Setting("CACHE_STORE_BYTES", 8 * GiB, "tandem_core.cache.store",
            "bytes of other sessions' snapshots the in-memory snapshot store keeps (0: off)", int),
    Setting("CACHE_DISK_BYTES", 64 * GiB, "tandem_core.cache.disk",
            "bytes of snapshot files the disk tier keeps (0: off)", int),
    Setting("MEM_PEAK", 0, "tandem_core.cache.gate",
            "bytes the process may use at its peak (--mem-peak); 0: measure what the device has free", int),
)
