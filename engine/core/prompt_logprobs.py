"""Prompt logprobs: which positions of a step they need.

The logits at position p predict token p + 1, so a prompt of P tokens has logprobs for tokens
1..P-1, from positions 0..P-2 (position P-1 predicts the first generated token and is the
sampler's row). A request asking for them is computed from its first token on (the KV cache
manager gives it no cached prefix) and may be prefilled in chunks, so each step covers the
positions of its chunk that are still owed; a request recomputed after preemption skips the
ones it already has. Only requests that ask get extra rows: the common path adds nothing.
The scheduler plans each step's spans (plain data in the step plan); the model runner turns them
into rows; the model executor records the logprobs they yield on the requests
(engine.sampler.record_prompt_logprobs).

This module never runs the model and never chooses tokens.
"""

from __future__ import annotations

from engine.core.request import Request
from engine.core.step_plan import PromptLogprobSpan


def plan_span(request: Request, batch_index: int, start: int, end: int) -> PromptLogprobSpan | None:
    """The prompt tokens whose logprobs the positions start..end-1 of this step (batch entry
    `batch_index`) predict and the request is still owed; None if there are none."""
    first = max(start + 1, len(request.prompt_logprobs) + 1)
    last = min(end, request.num_prompt_tokens - 1)
    if last < first:
        return None
    return PromptLogprobSpan(batch_index, first, last - first + 1)
