"""What a request must satisfy of the served model, whatever front end it came through: token
ids inside the vocabulary, a prompt (truncated first where asked) that leaves room in the
context (an embedding's input fits it), max_tokens that fits it, and sampling parameters the
library's own SamplingParams.validate accepts (so the gateway and the engine agree). Raises
InvalidParameter naming the field; never talks to a service.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from common.errors import InvalidParameter
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from gateway.pipeline.text import TextRequest

TRUNCATE_PARAM = "truncate_prompt_tokens"


@dataclass
class ModelInfo:
    name: str  # the served name: --served-model-name or the model directory's name
    names: tuple[str, ...]  # every name it is served under (--served-model-name), name first
    path: str
    max_model_len: int
    vocab_size: int
    created: int
    max_num_seqs: int  # the most samples one engine request may have


def check_token_ids(info: ModelInfo, token_ids: Sequence[int], param: str) -> None:
    """InvalidParameter naming `param` unless every id is in the model's vocabulary."""
    for token_id in token_ids:
        if not 0 <= token_id < info.vocab_size:
            raise InvalidParameter(
                f"{param} contains token id {token_id}, outside the "
                f"vocabulary [0, {info.vocab_size})",
                param,
            )


def truncated_prompt(info: ModelInfo, prompt_ids: Sequence[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context
    holds), the whole prompt when `keep` is None or the prompt is no longer. InvalidParameter
    for a `keep` of 0, below -1, or over the context."""
    prompt_ids = list(prompt_ids)
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = info.max_model_len
    if keep < 1:
        raise InvalidParameter(
            f"truncate_prompt_tokens must be -1 or at least 1, got {keep}", TRUNCATE_PARAM
        )
    if keep > info.max_model_len:
        raise InvalidParameter(
            f"truncate_prompt_tokens is {keep}, over this model's maximum context length "
            f"(max_model_len) of {info.max_model_len} tokens",
            TRUNCATE_PARAM,
        )
    return prompt_ids[-keep:]


def embedding_request(
    info: ModelInfo,
    prompt_ids: Sequence[int],
    pooling: PoolingParams,
    *,
    priority: int = 0,
    prompt_param: str = "input",
    truncate_prompt_tokens: int | None = None,
) -> TextRequest:
    """Validate one input to embed: non-empty, in the vocabulary, within the context (it
    generates nothing, so it may fill it) once truncated (truncated_prompt). Raises
    InvalidParameter naming `prompt_param` or the truncation."""
    prompt_ids = truncated_prompt(info, prompt_ids, truncate_prompt_tokens)
    if not prompt_ids:
        raise InvalidParameter(f"{prompt_param} must not be empty", prompt_param)
    check_token_ids(info, prompt_ids, prompt_param)
    if len(prompt_ids) > info.max_model_len:
        raise InvalidParameter(
            f"{prompt_param} has {len(prompt_ids)} tokens, over this model's maximum context "
            f"length (max_model_len) of {info.max_model_len} tokens",
            prompt_param,
        )
    # max_tokens 0: the token budget (rate limits) counts the prompt alone.
    return TextRequest(prompt_ids, SamplingParams(max_tokens=0), priority=priority, pooling=pooling)


def text_request(
    info: ModelInfo,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    skip_special_tokens: bool = True,
    priority: int = 0,
    prompt_param: str = "prompt",
    max_tokens_param: str = "max_tokens",
    max_tokens_cap: int | None = None,
    truncate_prompt_tokens: int | None = None,
) -> TextRequest:
    """Validate a sequence against the model, its prompt truncated first (truncated_prompt);
    unset max_tokens fills the context, up to `max_tokens_cap` (the model's max_new_tokens,
    --generation-config), which caps a set one too.

    Raises InvalidParameter naming the prompt, max_tokens, the truncation or the sampling
    parameter.
    """
    if any(not s for s in stop):
        raise InvalidParameter("stop strings must not be empty", "stop")
    prompt_ids = truncated_prompt(info, prompt_ids, truncate_prompt_tokens)
    if not prompt_ids:
        raise InvalidParameter(f"{prompt_param} must not be empty", prompt_param)
    check_token_ids(info, prompt_ids, prompt_param)
    room = info.max_model_len - len(prompt_ids)
    if room < 1:
        raise InvalidParameter(
            f"this model's maximum context length is {info.max_model_len} tokens, but "
            f"{prompt_param} has {len(prompt_ids)} tokens, which leaves no room to generate",
            prompt_param,
        )
    if max_tokens_cap is not None:
        asked = room if params.max_tokens is None else params.max_tokens
        capped = min(max_tokens_cap, asked)
        params = dataclasses.replace(params, max_tokens=capped)
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=room)
    elif isinstance(params.max_tokens, int) and params.max_tokens > room:
        raise InvalidParameter(
            f"{max_tokens_param} is {params.max_tokens}, but {prompt_param} has "
            f"{len(prompt_ids)} tokens and this model's maximum context length is "
            f"{info.max_model_len} tokens: {max_tokens_param} must be at most {room}",
            max_tokens_param,
        )
    try:
        params.validate(info.vocab_size)
    except ValueError as exc:
        # The library's messages start with the parameter's name.
        raise InvalidParameter(str(exc), str(exc).split(" ", 1)[0].split("[", 1)[0]) from None
    return TextRequest(
        prompt_ids,
        params,
        list(stop),
        include_stop_str_in_output,
        skip_special_tokens,
        priority,
    )
