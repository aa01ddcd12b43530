"""Tiers below and beside the arena: CPU index, disk, Redis, object storage (S3 API)."""
