"""Errors the engine raises for input it cannot serve; the API maps them to OpenAI-shaped 400s."""


class EngineInputError(ValueError):
    """A request the engine cannot run as given (empty prompt, too long, bad sampling values).

    `param` names the offending request field so the API can report it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CacheCapacityError(EngineInputError):
    """The KV cache cannot hold even one sequence of the requested size."""
