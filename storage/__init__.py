"""kvtier storage: keys, blob codec, shared-memory arena, tiers and the tiered store."""
