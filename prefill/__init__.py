"""Prefill worker: runs the prompt, answers the first token at once, pushes KV to decode."""
