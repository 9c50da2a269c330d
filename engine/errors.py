class RequestError(ValueError):
    """A request the engine refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
