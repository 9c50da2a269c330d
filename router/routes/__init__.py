"""The router's HTTP routes, as ``APIRouter`` modules sharing one ``RouterState`` through dependencies:
``state`` (the state and its dependencies: the API key check), ``errors`` (exception handlers: every error an
OpenAI-shaped body), ``generation`` (``/v1/completions``, ``/v1/chat/completions``: streamed or whole) and
``status`` (``/v1/models``, ``/health``, ``/metrics``)."""
