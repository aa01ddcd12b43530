"""Test helpers shared across test packages (real redis-server processes, fixtures)."""
