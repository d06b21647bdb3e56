"""Typed engine errors.

The API layer maps these onto HTTP statuses; the engine raises them before a
request touches the batch, so a bad request never disturbs the others.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request is malformed: bad sampling parameters, empty or too-long prompt.

    ``param`` names the offending field (OpenAI's ``error.param``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(EngineError):
    """A checkpoint could not be loaded: unknown architecture, missing tensor, shape mismatch."""


class EngineDeadError(EngineError):
    """The engine's background loop died; no request can be served until restart."""


class RequestAbortedError(EngineError):
    """Raised inside a request's output stream when the request was aborted."""
