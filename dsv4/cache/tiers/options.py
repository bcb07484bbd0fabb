"""The tiers' settings, from the engine's flags (docs/architecture.md, "Host and disk tiers")."""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class TierOptions:
    host_bytes: int                   # pinned host memory for pages and tails (> 0)
    disk_dir: str | None = None       # folder of the disk tier; None: no disk tier
    disk_bytes: int = 0               # most bytes of files in it
    background: bool | None = None    # disk work on a thread; None: on a CUDA cache only

    @staticmethod
    def from_config(config) -> "TierOptions | None":
        """None when the host tier is off (EngineConfig.host_cache_gb == 0)."""
        if not config.host_cache_gb:
            return None
        return TierOptions(int(config.host_cache_gb * GIB), config.disk_cache_dir,
                           int(config.disk_cache_gb * GIB))
