"""Benchmarks that print figures and ratios; never part of pass/fail."""
