"""Host-RAM and disk tiers of the prefix cache (docs/architecture.md, "Host and disk tiers")."""
from .options import TierOptions
from .tiers import KVTiers

__all__ = ["KVTiers", "TierOptions"]
