"""HTTP front end: OpenAI-compatible API, worker selection, streaming, metrics. Never imports torch."""
