"""Verification of drafted tokens: where a drafting entry's logits rows come from, and which of
its drafts the model's own distributions accept (rejection sampling).

An entry that drafted k tokens computes its last known token and the k drafts in one forward;
its k + 1 logits rows are the model's distributions after each of them. Draft j is accepted with
probability p_j(draft j), where p_j is the distribution the sampler would draw from at that
position (engine.sampler's processed_probs: temperature, top-k/p, min-p, logit bias; one-hot
for greedy requests, so a greedy draft is accepted exactly when it is the argmax). At the first
rejection the next token is drawn from p_j with the draft's probability removed (the residual
of a point-mass draft distribution); when all k are accepted, the bonus token is drawn from
p_k. The tokens then follow the model's distribution exactly (Leviathan et al. 2023), and a
greedy request's are the tokens it gets without speculation.

Draws use the request's own generator when it is seeded, else this verifier's. Only requests
whose distributions do not depend on their own drafts ever draft (engine.spec_decode.drafter),
so one row's parameters hold for all k + 1. A step that only verifies (`verifies_only`) runs as
one-token rows where decode steps run compiled or from CUDA graphs (engine.model_runner's
prepare): each token gets the decode arithmetic it gets without speculation. It never schedules
and never changes a request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from engine.core.outputs import Logprobs, SamplerOutput
from engine.core.request import Request
from engine.core.step_plan import StepPlan
from engine.input_batch import PersistentBatch
from engine.sampler import Sampler, row_argmax, token_logprobs


def write_drafts(batch: PersistentBatch, rows: np.ndarray, plan: StepPlan) -> None:
    """Each drafting entry's drafts after its row's known tokens: scratch space the row's
    num_tokens does not count (accepted drafts come back in a later plan as ordinary tokens)."""
    begin = 0
    for row, k in zip(rows.tolist(), plan.num_spec_tokens, strict=True):
        if k:
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + k] = plan.spec_token_ids[begin : begin + k]
            begin += k


def sampled_rows(ends: np.ndarray, plan: StepPlan) -> np.ndarray:
    """The flat token index of each sampled logits row, in batch order: an entry's last token
    once per sample, or a drafting entry's last k + 1 tokens (`ends`: each entry's end)."""
    if not plan.num_spec_tokens:
        return np.repeat(ends - 1, plan.num_samples)
    spec = np.asarray(plan.num_spec_tokens, dtype=np.int64)
    counts = np.asarray(plan.num_samples, dtype=np.int64) + spec
    first = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum())) - np.repeat(first, counts)
    return np.repeat(ends - 1 - spec, counts) + within * np.repeat(spec > 0, counts)


def verifies_only(plan: StepPlan) -> bool:
    """Whether every entry of the step is a running request's last known token and its drafts
    (some drafting, no prompt chunk)."""
    return bool(plan.num_spec_tokens) and all(
        n == 1 + k for n, k in zip(plan.num_new_tokens, plan.num_spec_tokens, strict=True)
    )


def _take_rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """values[rows]: a view where the rows are consecutive (a step of drafting requests only,
    every row), else a copy."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return values[rows[0] : rows[0] + len(rows)]
    return values.index_select(0, torch.tensor(rows, device=values.device))


def _verify_greedy(
    argmax: Sequence[int], requests: Sequence[Request], starts: Sequence[int]
) -> list[list[int]]:
    """_verify for greedy requests, from each row's greedy token (`argmax`, probs' layout):
    their rows are one-hot, so a draft is accepted exactly when it is its row's token, and the
    token after the accepted ones is the next row's (the draft rejected there had probability
    0 already). The same tokens as _verify, without its vocabulary-wide rows."""
    out = []
    for request, start in zip(requests, starts, strict=True):
        drafts = request.spec_token_ids
        a = next((j for j, d in enumerate(drafts) if d != argmax[start + j]), len(drafts))
        out.append([*drafts[:a], argmax[start + a]])
    return out


class Verifier:
    def __init__(self, sampler: Sampler, seed: int) -> None:
        self.sampler = sampler
        # Its draws are on the CPU whatever the device, as a seeded request's own are.
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        disallowed: torch.Tensor | None,
    ) -> SamplerOutput:
        """logits: the step's sampled rows (sampled_rows' layout); requests: the sampling
        requests, one per sample (each drafting one owns len(spec_token_ids) + 1 rows);
        disallowed: the structured-output masks, a row per logits row. Rows that drafted
        nothing are sampled as usual; the others are verified, each position under its mask."""
        counts = [len(r.spec_token_ids) + 1 for r in requests]
        last = np.cumsum(counts) - 1
        plain = [i for i, r in enumerate(requests) if not r.spec_token_ids]
        token_ids = [0] * len(requests)
        logprobs: list[Logprobs | None] = [None] * len(requests)
        accepted: list[list[int]] = [[] for _ in requests]
        accepted_logprobs: list[list[Logprobs]] = [[] for _ in requests]
        if plain:
            index = last[plain].tolist()
            # The masks are on the logits' device (the sampler's).
            masks = None if disallowed is None else _take_rows(disallowed, index)
            out = self.sampler.sample(
                _take_rows(logits, index), [requests[i] for i in plain], masks
            )
            for i, token, record in zip(plain, out.token_ids, out.logprobs, strict=True):
                token_ids[i], logprobs[i] = token, record
        drafting = [i for i, r in enumerate(requests) if r.spec_token_ids]
        if drafting:
            firsts = [int(last[i]) - counts[i] + 1 for i in drafting]
            row_index = [
                row
                for i, f in zip(drafting, firsts, strict=True)
                for row in range(f, f + counts[i])
            ]
            rows = _take_rows(logits, row_index)
            expanded = [requests[i] for i in drafting for _ in range(counts[i])]
            masks = None if disallowed is None else _take_rows(disallowed, row_index)
            starts = [0, *itertools.accumulate(counts[i] for i in drafting)][:-1]
            verifying = [requests[i] for i in drafting]
            if all(r.sampling_params.greedy for r in verifying):
                verified = _verify_greedy(
                    self.sampler.greedy_tokens(rows, expanded, masks), verifying, starts
                )
            else:
                probs = self.sampler.processed_probs(rows, expanded, masks).cpu()
                verified = self._verify(probs, verifying, starts)
            for i, tokens in zip(drafting, verified, strict=True):
                accepted[i], token_ids[i] = tokens[:-1], tokens[-1]
            self._logprobs(
                rows, expanded, starts, drafting, accepted, token_ids, accepted_logprobs, logprobs
            )
        return SamplerOutput(token_ids, logprobs, accepted, accepted_logprobs)

    def _verify(
        self, probs: torch.Tensor, requests: Sequence[Request], starts: Sequence[int]
    ) -> list[list[int]]:
        """Per drafting request (its rows from starts[j] in probs): the accepted drafts, then
        the corrected or bonus token. Vectorized over the batch; loops only over seeded
        requests' own generators."""
        draft_rows: list[int] = []
        draft_ids: list[int] = []
        for request, start in zip(requests, starts, strict=True):
            drafts = request.spec_token_ids
            draft_rows += range(start, start + len(drafts))
            draft_ids += drafts
        draft_probs = probs[torch.tensor(draft_rows), torch.tensor(draft_ids)]
        # Greedy rows are one-hot: a draft is accepted exactly when it is the argmax (p = 1 > u).
        noise = torch.rand(len(draft_ids), generator=self.generator)
        offset = 0
        for request in requests:
            k = len(request.spec_token_ids)
            generator = self.sampler.generator_of(request)
            if generator is not None:
                noise[offset : offset + k] = torch.rand(k, generator=generator)
            offset += k
        accept = (noise < draft_probs).tolist()
        targets, removed, out = [], [], []
        offset = 0
        for request, start in zip(requests, starts, strict=True):
            drafts = request.spec_token_ids
            k = len(drafts)
            a = next((j for j in range(k) if not accept[offset + j]), k)
            offset += k
            targets.append(start + a)
            removed.append(drafts[a] if a < k else -1)
            out.append(drafts[:a])
        target = probs[torch.tensor(targets)]
        rows = torch.arange(len(targets))
        removed_ids = torch.tensor(removed)
        rejected = removed_ids >= 0
        # The residual of a point-mass draft: its token's probability taken out.
        target[rows[rejected], removed_ids[rejected]] = 0.0
        drawn = row_argmax(target)
        sampled = [j for j, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled:  # drawn as the sampler draws, from a seeded request's own generator
            drawn[sampled] = self.sampler.draw(target[sampled], [requests[j] for j in sampled])
        for tokens, token in zip(out, drawn.tolist(), strict=True):
            tokens.append(token)
        return out

    def _logprobs(
        self,
        rows: torch.Tensor,
        expanded: Sequence[Request],
        starts: Sequence[int],
        drafting: Sequence[int],
        accepted: list[list[int]],
        token_ids: list[int],
        accepted_logprobs: list[list[Logprobs]],
        logprobs: list[Logprobs | None],
    ) -> None:
        """The logprob records of each drafting request's new tokens, when it asked for them
        (of the raw logits, as the sampler's)."""
        index: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        owners: list[tuple[int, int]] = []
        for j, i in enumerate(drafting):
            top = expanded[starts[j]].sampling_params.logprobs
            if top is None:
                continue
            tokens = [*accepted[i], token_ids[i]]
            index += range(starts[j], starts[j] + len(tokens))
            targets += tokens
            num_top += [top] * len(tokens)
            owners.append((i, len(tokens)))
        if not index:
            return
        vocab = self.sampler.vocab_size
        records = token_logprobs(rows[torch.tensor(index), :vocab].float(), targets, num_top)
        begin = 0
        for i, n in owners:
            accepted_logprobs[i], logprobs[i] = (
                records[begin : begin + n - 1],
                records[begin + n - 1],
            )
            begin += n
