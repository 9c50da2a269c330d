"""Decode worker: receives KV, continues generation, streams tokens to the router."""
