"""Stop conditions checked after each sampled token: EOS, stop tokens, max_tokens, context.

Pure function of the request's state; stop strings are text and belong to the tokenizer side.
"""

from __future__ import annotations

from collections.abc import Container

from common.finish_reason import FinishReason
from engine.core.request import Request


def check_stop(
    request: Request, eos_token_ids: Container[int], max_model_len: int
) -> FinishReason | None:
    """Why the request must stop after its latest token, or None to go on."""
    params = request.sampling_params
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        token = request.output_token_ids[-1]
        if (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids:
            return FinishReason.STOP
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return FinishReason.LENGTH
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
