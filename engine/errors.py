"""The errors the engine raises to its callers: the contract's own (common/errors.py), under
the names the engine uses, and the one error only an engine can have. The services map them to
gRPC status codes there.

Each message names the offending parameter. Raising one of these (EngineGroupError aside) must
leave the engine exactly as it was.
"""

from common.errors import DeadlineUnmeetable, InvalidRequestError, QueueFullError, UnavailableError
from common.errors import FolioError as EngineError


class EngineGroupError(UnavailableError):
    """A tensor-parallel rank died, hung or fell out of step: the engine cannot go on and
    fails its live requests (UNAVAILABLE / 503: it is being restarted, retry later); the process
    exits so that it is restarted."""


__all__ = [
    "DeadlineUnmeetable",
    "EngineError",
    "EngineGroupError",
    "InvalidRequestError",
    "QueueFullError",
]
