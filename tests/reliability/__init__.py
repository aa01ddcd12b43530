"""Fault injection, load and leak tests: real vLLM (CPU build), real services, real Redis, real disks."""
