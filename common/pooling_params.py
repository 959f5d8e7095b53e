"""PoolingParams: what an embedding request asks of its pooled vector, as plain data.

An embedding request is a prompt the engine computes once (prefill only) and pools into one
vector, the model's own way (engine/pooler.py); it generates nothing. This module holds the
parameters and their shape checks only (the messages name the parameter): whether the served
model can honour them (Matryoshka `dimensions`) is the engine's to say. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import InvalidRequestError


@dataclass(frozen=True)
class PoolingParams:
    # Keep only the first `dimensions` values of the vector, normalised again (Matryoshka
    # embeddings); None keeps the whole vector.
    dimensions: int | None = None

    def validate(self) -> None:
        """InvalidRequestError (param "dimensions") unless the shape is right."""
        dimensions = self.dimensions
        if dimensions is not None and (
            not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1
        ):
            raise InvalidRequestError(
                f"dimensions must be a positive integer, got {dimensions!r}", "dimensions"
            )
