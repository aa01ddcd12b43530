"""Tiers below and beside the arena: CPU index, disk, Redis."""
