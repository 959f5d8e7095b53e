"""Prompt logprobs: which rows of a step's hidden states they need, and recording them.

The logits at position p predict token p + 1, so a prompt of P tokens has logprobs for tokens
1..P-1, from positions 0..P-2 (position P-1 predicts the first generated token and is the
sampler's row). A request asking for them is computed from its first token on (the KV cache
manager gives it no cached prefix) and may be prefilled in chunks, so each step covers the
positions of its chunk that are still owed; a request recomputed after preemption skips the
ones it already has. Only requests that ask get extra rows: the common path adds nothing.
The scheduler plans each step's spans (plain data in the step plan); the runner turns them into
rows; the engine records the logprobs they yield on the requests.

This module never runs the model and never chooses tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.core.request import Request
from engine.core.step_plan import PromptLogprobSpan

if TYPE_CHECKING:
    import torch


def plan_span(request: Request, batch_index: int, start: int, end: int) -> PromptLogprobSpan | None:
    """The prompt tokens whose logprobs the positions start..end-1 of this step (batch entry
    `batch_index`) predict and the request is still owed; None if there are none."""
    first = max(start + 1, len(request.prompt_logprobs) + 1)
    last = min(end, request.num_prompt_tokens - 1)
    if last < first:
        return None
    return PromptLogprobSpan(batch_index, first, last - first + 1)


def record_prompt_logprobs(
    logits: torch.Tensor, spans: Sequence[PromptLogprobSpan], scheduled: Sequence[Request]
) -> None:
    """Append each span's logprob records to its request (scheduled[span.batch_index]); logits
    has one row per span token, spans in order, columns cut to the vocabulary."""
    # The sampler (torch) is imported where logprobs are computed, not at the top: the
    # scheduler imports this module for plan_span and stays torch-free.
    from engine.sampler import token_logprobs

    targets: list[int] = []
    num_top: list[int] = []
    for span in spans:
        request = scheduled[span.batch_index]
        top = request.sampling_params.prompt_logprobs
        if top is None:
            raise ValueError(f"request {request.request_id!r} did not ask for prompt logprobs")
        targets += request.prompt_token_ids[span.first_token : span.first_token + span.count]
        num_top += [top] * span.count
    records = token_logprobs(logits, targets, num_top)
    begin = 0
    for span in spans:
        scheduled[span.batch_index].prompt_logprobs += records[begin : begin + span.count]
        begin += span.count
