"""The answer to a generation request: ``Reply`` (the owner), ``choice`` (state), ``shaper`` (OpenAI bodies)."""
from .reply import Reply, retry_header

__all__ = ["Reply", "retry_header"]
