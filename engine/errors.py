"""Errors the engine raises to its callers; the services map them to gRPC status codes.

Each message names the offending parameter. Raising one of these must leave the engine
exactly as it was.
"""


class EngineError(Exception):
    """Base class of the errors a caller can act on."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (INVALID_ARGUMENT / HTTP 400)."""


class QueueFullError(EngineError):
    """The bounded waiting queue is full (RESOURCE_EXHAUSTED / HTTP 429)."""


class EngineGroupError(RuntimeError):
    """A tensor-parallel rank died, hung or fell out of step: the engine cannot go on and
    fails its live requests (INTERNAL); the process should exit so that it is restarted."""
