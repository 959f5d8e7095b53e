"""The errors the engine raises to its callers: the contract's own (common/errors.py), under
the names the engine uses. The services map them to gRPC status codes there.

Each message names the offending parameter. Raising one of these must leave the engine
exactly as it was.
"""

from common.errors import FolioError as EngineError
from common.errors import InvalidRequestError, QueueFullError

__all__ = ["EngineError", "InvalidRequestError", "QueueFullError"]
