"""Benchmarks: KV transfer A/B (more to come: serving load, colocated comparison)."""
