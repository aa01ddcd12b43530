"""Tests of the blob codec, circuit breaker, and the disk and Redis tiers."""
