"""The step plan: what one engine step computes, as plain data that can cross a process boundary.

The scheduler (on rank 0) produces one `StepPlan` per step; the model runner of every rank
consumes only that, never a live `Request`. A runner keeps a persistent batch: one row per
request it holds, with that request's token ids and block table. The plan tells it how that
batch changes and what to compute:

1. `finished_ids`, then `preempted_ids`: rows to drop (a request that finished, was aborted or
   forked into its samples since the last plan; a request preempted in this step). A request
   the runner never received is never listed.
2. `new_requests`: rows to add. Each carries every token id known so far (the prompt, plus the
   outputs of a request resumed after preemption or of a freshly forked sample), its whole
   block table, and how many of its tokens already have KV in the cache (a prefix-cache hit, a
   fork's shared prompt). `sampling_params` is filled for rank 0's sampler only and is None
   once the plan has crossed to a worker rank: the forward never needs it.
3. `running_requests`: rows already held that run this step, with the token ids appended to
   them since the runner last saw them (the token sampled in the previous step) and the block
   ids appended to their block table. Block tables of held rows only ever grow.
4. The batch itself, in order (`scheduled_ids`, `num_computed_tokens`, `num_new_tokens`):
   decodes (one new token each) first, sorted by context length so the attention backend can
   group them, then the rest (prefills, chunks, recomputes). Request i computes its tokens
   num_computed_tokens[i] .. num_computed_tokens[i] + num_new_tokens[i] - 1.
5. `num_samples[i]`: how many logits rows request i gets from its last new token: 0 while a
   prompt is still being prefilled in chunks, 1 when the step reaches its last known token, n
   for an n > 1 request completing its prompt (one row per sample). Sampled rows come in batch
   order, then `prompt_logprob_spans`' rows, span after span.
   `pooled_entries`: the batch entries that are embedding requests (never sampled): the runner
   pools the hidden states of their new tokens, across steps when the prompt comes in chunks,
   and each one this step completes gets its pooled vector, in batch order.
6. `block_copies`: copy-on-write (source, destination) KV block copies to make before the
   forward writes, every source read before any destination is written.
7. Speculative decoding (engine.spec_decode): `num_spec_tokens[i]` tokens drafted for entry i
   (the list is empty when no entry drafted), their ids concatenated in `spec_token_ids`. Such
   an entry computes its last known token and then its drafts: its num_new_tokens counts them,
   its drafts are never part of the row's token ids, and it gets num_spec_tokens[i] + 1 logits
   rows (each position's next token, last known token's first), in place of its one sampled
   row. `block_truncations` (seq_id, number of block ids kept): rows whose block table lost its
   tail since the last plan (the blocks only rejected drafts had reached), applied after the
   departures and before the joins.

Every field is an int, a list of ints or (rank 0 only) SamplingParams, so the plan encodes
as one flat int64 array (`encode` / `decode`, no pickle) that torch.distributed or protobuf can
carry. Requests are named by `seq_id`, an int unique within the engine process (an n > 1
request's samples have their own). This module holds data only: it never schedules, never
touches tensors and never imports the scheduler, the runner or the request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from common.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestPlan:
    """A request joining the runner's batch (first admission, resume after preemption, or a
    sample of an n > 1 request right after the fork)."""

    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # Rank 0's sampler only; None on worker ranks.
    sampling_params: SamplingParams | None = None
    # The model's LoRA slot its rows use (engine.layers.lora); -1: the base model.
    lora_slot: int = -1


@dataclass(slots=True)
class RunningRequestPlan:
    """A request the runner already holds that runs this step: what was appended to it."""

    seq_id: int
    new_token_ids: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class PromptLogprobSpan:
    """Consecutive prompt tokens of batch entry `batch_index` whose logprobs this step
    computes: prompt tokens first_token .. first_token + count - 1, predicted by the positions
    first_token - 1 .. first_token + count - 2 (inside that entry's new tokens)."""

    batch_index: int
    first_token: int
    count: int


@dataclass(slots=True)
class StepPlan:
    new_requests: list[NewRequestPlan] = field(default_factory=list)
    running_requests: list[RunningRequestPlan] = field(default_factory=list)
    finished_ids: list[int] = field(default_factory=list)
    preempted_ids: list[int] = field(default_factory=list)
    # The batch, in order; see the module docstring.
    scheduled_ids: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)
    # The first num_decodes entries have exactly one new token.
    num_decodes: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprob_spans: list[PromptLogprobSpan] = field(default_factory=list)
    pooled_entries: list[int] = field(default_factory=list)
    num_spec_tokens: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    block_truncations: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled(self) -> int:
        return len(self.scheduled_ids)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_sampled_rows(self) -> int:
        """Sampled logits rows: one per sample, and one more per drafted token."""
        return sum(self.num_samples) + len(self.spec_token_ids)

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be rows to drop)."""
        return not self.scheduled_ids

    def without_sampling_params(self) -> StepPlan:
        """The plan as a worker rank sees it: the same, minus the sampler's parameters."""
        return decode(encode(self))


# -- the flat int64 encoding ----------------------------------------------------------------
# A sequence of int lists, each written as its length followed by its values; a list of
# lists (per new request) is its count, then each list in turn. Version first, so a rank that
# runs other code refuses the plan instead of misreading it.
ENCODING_VERSION = 3


def encode(plan: StepPlan) -> np.ndarray:
    """The plan as one int64 array, sampling parameters left out (rank 0 keeps those)."""
    out: list[int] = [ENCODING_VERSION]

    def put(values: Sequence[int]) -> None:
        out.append(len(values))
        out.extend(values)

    new = plan.new_requests
    put([r.seq_id for r in new])
    put([r.num_computed_tokens for r in new])
    put([r.lora_slot for r in new])
    for r in new:
        put(r.token_ids)
        put(r.block_ids)
    running = plan.running_requests
    put([r.seq_id for r in running])
    for grown in running:
        put(grown.new_token_ids)
        put(grown.new_block_ids)
    put(plan.finished_ids)
    put(plan.preempted_ids)
    put(plan.scheduled_ids)
    put(plan.num_computed_tokens)
    put(plan.num_new_tokens)
    put(plan.num_samples)
    put([plan.num_decodes])
    put([block for pair in plan.block_copies for block in pair])
    put([v for s in plan.prompt_logprob_spans for v in (s.batch_index, s.first_token, s.count)])
    put(plan.pooled_entries)
    put(plan.num_spec_tokens)
    put(plan.spec_token_ids)
    put([v for pair in plan.block_truncations for v in pair])
    return np.array(out, dtype=np.int64)


def decode(encoded: np.ndarray | Sequence[int]) -> StepPlan:
    """The plan `encode` wrote (sampling_params None); ValueError on another version."""
    values: Iterator[int] = iter(np.asarray(encoded, dtype=np.int64).tolist())
    version = next(values)
    if version != ENCODING_VERSION:
        raise ValueError(
            f"step plan encoding version {version}, this code reads {ENCODING_VERSION}: "
            "every rank must run the same Folio version"
        )

    def take() -> list[int]:
        return [next(values) for _ in range(next(values))]

    new_ids, new_computed, new_slots = take(), take(), take()
    new_requests = []
    for seq_id, num_computed, slot in zip(new_ids, new_computed, new_slots, strict=True):
        token_ids, block_ids = take(), take()
        new_requests.append(
            NewRequestPlan(seq_id, token_ids, block_ids, num_computed, lora_slot=slot)
        )
    running_requests = [RunningRequestPlan(seq_id, take(), take()) for seq_id in take()]
    plan = StepPlan(
        new_requests=new_requests,
        running_requests=running_requests,
        finished_ids=take(),
        preempted_ids=take(),
        scheduled_ids=take(),
        num_computed_tokens=take(),
        num_new_tokens=take(),
        num_samples=take(),
    )
    (plan.num_decodes,) = take()
    copies = take()
    plan.block_copies = list(zip(copies[0::2], copies[1::2], strict=True))
    spans = take()
    plan.prompt_logprob_spans = [
        PromptLogprobSpan(*spans[i : i + 3]) for i in range(0, len(spans), 3)
    ]
    plan.pooled_entries = take()
    plan.num_spec_tokens = take()
    plan.spec_token_ids = take()
    kept = take()
    plan.block_truncations = list(zip(kept[0::2], kept[1::2], strict=True))
    if next(values, None) is not None:
        raise ValueError("step plan encoding has trailing values")
    return plan
