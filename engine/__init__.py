"""Model runner shared by prefill and decode workers; knows no transport."""
from .config import EngineConfig
from .errors import RequestError
from .sampling import SamplingParams

__all__ = ["EngineConfig", "RequestError", "SamplingParams"]
