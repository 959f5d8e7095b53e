"""Chooses one token per request from the last-position logits, vectorized over the batch.

Row i of the logits belongs to requests[i] and follows that request's SamplingParams. Columns
at or past `vocab_size` (padding some models add) are ignored. Per row, in this order:

0. structured output: the tokens `disallowed` marks (a constrained row's grammar forbids) get -inf;
   so do the tokens outside allowed_token_ids, when set.
1. logit_bias is added.
2. min_tokens: while the request has fewer than min_tokens output tokens, its stop_token_ids
   and the EOS ids (unless ignore_eos, or a grammar constrains the row: it alone decides where
   the text may end, and may allow nothing but EOS) get -inf. Bad words: the last token of each
   bad_words_token_ids sequence whose other tokens end the output so far gets -inf.
3. repetition_penalty (Hugging Face style) on every token in the prompt or output: a positive
   logit is divided by the penalty, a negative one multiplied by it.
4. presence / frequency penalties (OpenAI style) on output tokens only:
   logit -= presence * (count > 0) + frequency * count.
5. temperature 0 (greedy): exact argmax, ties to the lowest token id like torch.argmax.
   Otherwise divide by the temperature, then
   - top-k keeps the tokens whose logit is >= the k-th largest (ties at the edge stay);
   - top-p keeps the smallest set of most likely tokens whose cumulative probability (after
     top-k) reaches top_p, plus any token exactly as likely as the least likely of them; the
     top token always stays;
   - min-p drops the tokens whose probability is < min_p * the top token's probability;
   - the token is drawn by inverse transform sampling: one uniform u in [0, 1) per row, the
     token where the row's cumulative probability (summed in float64) first exceeds u times its
     total. A seeded request draws its u, one draw per step, only from its own generator, so
     its tokens do not depend on the rest of the batch or its row in it; unseeded rows share
     the sampler's generator.

Logprobs are log_softmax of the raw model logits, before any of the steps above; prompt
logprobs (`record_prompt_logprobs`) are the same records for prompt tokens.

A row whose allowed_token_ids or bad words leave it no token (with its grammar's mask, the
vocabulary is all -inf) samples NO_TOKEN: the engine ends that request there, not with a token
its constraints forbid.

On a GPU, step 5 runs as one Triton kernel (engine.kernels.triton.sampling): the same filters and
the exponential race (argmax(probs / q), q ~ Exp(1): the same distribution), with noise from a
counter-based generator keyed by a per-row seed. A seeded request's row seed is derived from its
seed and its output length, so it still does not depend on the rest of the batch (the draws
differ from the CPU path's for the same seed).

A request's per-row parameters (its `SamplingRow`: the effective top-k, the logit-bias index,
the ids banned until min_tokens, ...) are built once, when it joins (`join`, or on first sight),
not every step; a step only gathers the rows of the requests it samples.

This module never mutates the caller's logits and never advances a seeded request's
generator by an amount that depends on anything but that request.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.sampling_params import SamplingParams
from engine.core.outputs import NO_TOKEN, Logprobs, SamplerOutput
from engine.core.request import Request
from engine.core.step_plan import PromptLogprobSpan


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One request's sampling parameters as the sampler uses them, derived once at join."""

    greedy: bool
    temperature: float
    top_k: int  # 0: no top-k (unset, or at least the vocabulary)
    top_p: float
    min_p: float
    bias_ids: tuple[int, ...]
    bias_values: tuple[float, ...]
    # Ids that get -inf while the request has fewer than min_tokens output tokens.
    min_tokens: int
    banned_ids: tuple[int, ...]
    # Each bad word as (the tokens before its last, its last token).
    bad_words: tuple[tuple[tuple[int, ...], int], ...]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None
    seed: int | None
    # A seeded request's own generator (on the CPU): its draws then depend on its seed and its
    # own steps only, preemptions included.
    generator: torch.Generator | None = field(default=None, compare=False)
    # With allowed_token_ids: bool [vocab_size] on the sampler's device, True outside them.
    outside_allowed: torch.Tensor | None = field(default=None, compare=False)

    def banned_now(self, output_token_ids: Sequence[int]) -> list[int]:
        """The ids this row may not take at this step: min_tokens' while too short, and the
        bad words' the output has led up to."""
        banned = list(self.banned_ids) if len(output_token_ids) < self.min_tokens else []
        for before, last in self.bad_words:
            if not before or tuple(output_token_ids[-len(before) :]) == before:
                banned.append(last)
        return banned

    @classmethod
    def build(
        cls,
        params: SamplingParams,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | None = None,
    ) -> SamplingRow:
        # A grammar alone decides where constrained text may end (it may allow only EOS).
        keeps_eos = params.ignore_eos or params.structured_output is not None
        bias = params.logit_bias or {}
        outside_allowed = None
        if params.allowed_token_ids is not None:
            outside_allowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
            outside_allowed[torch.tensor(params.allowed_token_ids, device=device)] = False
        return cls(
            greedy=params.greedy,
            temperature=params.temperature,
            top_k=params.top_k if 0 < params.top_k < vocab_size else 0,
            top_p=params.top_p,
            min_p=params.min_p,
            bias_ids=tuple(bias),
            bias_values=tuple(bias.values()),
            min_tokens=params.min_tokens,
            banned_ids=(*params.stop_token_ids, *(() if keeps_eos else eos_token_ids)),
            bad_words=tuple((tuple(word[:-1]), word[-1]) for word in params.bad_words_token_ids),
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logprobs=params.logprobs,
            seed=params.seed,
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
            outside_allowed=outside_allowed,
        )


# Tokens a chunk of inverse transform sampling's sums (Sampler._draw).
DRAW_CHUNK = 256
# Probabilities among which top-p first looks for its nucleus (Sampler._apply_top_p).
NUCLEUS_CANDIDATES = 1024
SAMPLE_STRIDE = 64  # _largest_first's sample of a row


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: str | torch.device = "cpu",
        seed: int = 0,
        use_kernel: bool | None = None,
    ) -> None:
        """use_kernel: step 5 through the Triton kernel; None = on CUDA devices only."""
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.use_kernel = self.device.type == "cuda" if use_kernel is None else use_kernel
        # Weak keys: a request dropped without leave() cannot leak its row or its generator.
        self._rows: weakref.WeakKeyDictionary[Request, SamplingRow] = weakref.WeakKeyDictionary()

    def join(self, request: Request) -> None:
        """Build the request's row (and its samples' when n > 1) once, before it is sampled."""
        for sequence in (request, *request.samples):
            params = sequence.sampling_params
            self._rows[sequence] = SamplingRow.build(
                params, self.vocab_size, self.eos_token_ids, self.device
            )

    def leave(self, request: Request) -> None:
        self._rows.pop(request, None)

    def generator_of(self, request: Request) -> torch.Generator | None:
        """A seeded request's own generator (on the CPU); None for an unseeded one."""
        return self._rows_of([request])[0].generator

    def _rows_of(self, requests: Sequence[Request]) -> list[SamplingRow]:
        rows = self._rows
        out = []
        for request in requests:
            row = rows.get(request)
            if row is None:  # a request sampled without join(): it joins now
                self.join(request)
                row = rows[request]
            out.append(row)
        return out

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        disallowed: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """disallowed: bool [batch, vocab_size] on the sampler's device, True where a row may not
        go (structured output; all False on unconstrained rows), or None when no row is limited."""
        logits = logits[:, : self.vocab_size].float()  # the raw logits the logprobs are of
        rows = self._rows_of(requests)
        adjusted = self._adjusted(logits, requests, rows, disallowed)
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if sampled and self.use_kernel:
            tokens = self._sample_with_kernel(adjusted, requests, rows)
        elif len(sampled) == len(requests):
            tokens = self._draw(self._probs(adjusted, rows), rows)
        else:
            tokens = row_argmax(adjusted)
            if sampled:
                index = self._index(sampled)
                sampled_rows = [rows[i] for i in sampled]
                tokens[index] = self._draw(self._probs(adjusted[index], sampled_rows), sampled_rows)
        token_ids = tokens.tolist()
        output = SamplerOutput(token_ids, self._logprobs(logits, token_ids, rows))
        for i in self._stuck(adjusted, rows):
            output.token_ids[i] = NO_TOKEN
        return output

    def _stuck(self, adjusted: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """The rows that may take no token: only token limits (allowed ids, bad words) can
        empty a row, with its grammar's mask; rows without them are not looked at."""
        limited = [
            i for i, row in enumerate(rows) if row.outside_allowed is not None or row.bad_words
        ]
        if not limited:
            return []
        empty = (adjusted[self._index(limited)] == -math.inf).all(dim=-1).tolist()
        return [i for i, is_empty in zip(limited, empty, strict=True) if is_empty]

    @torch.inference_mode()
    def processed_probs(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        disallowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, vocab_size]: the distribution each row's token is drawn from (one-hot if greedy),
        `disallowed` (as sample's) never drawn."""
        rows = self._rows_of(requests)
        adjusted = self._adjusted(logits, requests, rows, disallowed)
        probs = torch.zeros_like(adjusted).scatter_(1, row_argmax(adjusted)[:, None], 1.0)
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if sampled:
            index = self._index(sampled)
            probs[index] = self._probs(adjusted[index], [rows[i] for i in sampled])
        return probs

    @torch.inference_mode()
    def greedy_tokens(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        disallowed: torch.Tensor | None = None,
    ) -> list[int]:
        """Each row's greedy token: the argmax of its processed logits, the token its one-hot
        row of processed_probs holds, without building those rows (the requests all greedy)."""
        rows = self._rows_of(requests)
        return row_argmax(self._adjusted(logits, requests, rows, disallowed)).tolist()

    def _adjusted(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        rows: Sequence[SamplingRow],
        disallowed: torch.Tensor | None,
    ) -> torch.Tensor:
        """The rows' logits as float32 over the vocabulary, `disallowed` masked out, adjusted
        (allowed_token_ids and steps 1-4 of the module docstring); cutting and widening logits
        that already are so costs nothing (views)."""
        logits = logits[:, : self.vocab_size].float()
        if disallowed is not None:
            logits = logits.masked_fill(disallowed, -math.inf)
        return self._adjust_logits(logits, requests, rows)

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _scatter_index(
        self, id_lists: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token id) index pairs putting id_lists[j] on row j, without a vocab loop."""
        lengths = self._index([len(ids) for ids in id_lists])
        rows = torch.repeat_interleave(torch.arange(len(id_lists), device=self.device), lengths)
        return rows, self._index(list(itertools.chain.from_iterable(id_lists)))

    def _adjust_logits(
        self, logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        """allowed_token_ids and steps 1-4 of the module docstring; returns `logits` itself when
        no row needs them."""
        biased = [i for i, row in enumerate(rows) if row.bias_ids]
        limited = {
            i: row.outside_allowed for i, row in enumerate(rows) if row.outside_allowed is not None
        }
        banned = {
            i: banned_ids
            for i, (row, r) in enumerate(zip(rows, requests, strict=True))
            if (row.bad_words or (row.banned_ids and r.num_output_tokens < row.min_tokens))
            and (banned_ids := row.banned_now(r.output_token_ids))
        }
        repeated = [i for i, row in enumerate(rows) if row.repetition_penalty != 1.0]
        counted = [
            i
            for i, (row, r) in enumerate(zip(rows, requests, strict=True))
            if r.output_token_ids and (row.presence_penalty or row.frequency_penalty)
        ]
        if not (biased or limited or banned or repeated or counted):
            return logits
        logits = logits.clone()

        if limited:
            index = self._index(list(limited))
            outside = torch.stack(list(limited.values()))
            logits[index] = logits[index].masked_fill(outside, -math.inf)

        if biased:
            local, ids = self._scatter_index([rows[i].bias_ids for i in biased])
            bias_values = [v for i in biased for v in rows[i].bias_values]
            bias = torch.tensor(bias_values, dtype=logits.dtype, device=self.device)
            logits[self._index(biased)[local], ids] += bias

        if banned:
            local, ids = self._scatter_index(list(banned.values()))
            logits[self._index(list(banned))[local], ids] = -math.inf

        # The penalties touch only the (row, token) pairs that occur, never whole rows.
        if repeated:
            local, ids = self._scatter_index([requests[i].token_ids for i in repeated])
            flat_rows = self._index(repeated)[local]
            penalty = torch.tensor(
                [rows[i].repetition_penalty for i in repeated], device=self.device
            )[local]
            values = logits[flat_rows, ids]
            # A token seen twice is written twice with the same value, so duplicates are safe.
            logits[flat_rows, ids] = torch.where(values > 0, values / penalty, values * penalty)

        if counted:
            local, ids = self._scatter_index([requests[i].output_token_ids for i in counted])
            pairs, counts = torch.unique(local * self.vocab_size + ids, return_counts=True)
            local, ids = pairs // self.vocab_size, pairs % self.vocab_size
            presence = torch.tensor([rows[i].presence_penalty for i in counted], device=self.device)
            frequency = torch.tensor(
                [rows[i].frequency_penalty for i in counted], device=self.device
            )
            logits[self._index(counted)[local], ids] -= presence[local] + frequency[local] * counts
        return logits

    def _probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p for sampled rows; returns probabilities."""
        temperature = torch.tensor([row.temperature for row in rows], device=self.device)
        logits = logits / temperature[:, None]  # a new tensor: the masks below may write in place

        top_k = [row.top_k for row in rows]
        if any(top_k):
            k = self._index(top_k)
            largest = logits.topk(max(top_k), dim=-1).values
            kth = largest.gather(1, (k.clamp(min=1) - 1)[:, None])
            kth.masked_fill_((k == 0)[:, None], -math.inf)
            logits.masked_fill_(logits < kth, -math.inf)

        nucleus = [i for i, row in enumerate(rows) if row.top_p < 1.0]
        if nucleus:
            top_p = torch.tensor([rows[i].top_p for i in nucleus], device=self.device)
            if len(nucleus) == len(rows):
                self._apply_top_p(logits, top_p)
            else:
                index = self._index(nucleus)
                subset = logits[index]
                self._apply_top_p(subset, top_p)
                logits[index] = subset

        if any(row.min_p > 0 for row in rows):
            # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf keeps all.
            min_p = torch.tensor([row.min_p for row in rows], device=self.device)
            floor = logits.max(-1, keepdim=True).values + min_p.log()[:, None]
            logits.masked_fill_(logits < floor, -math.inf)

        return logits.softmax(-1)

    def _apply_top_p(self, logits: torch.Tensor, top_p: torch.Tensor) -> None:
        probs = logits.softmax(-1)
        # The nucleus is searched among each row's NUCLEUS_CANDIDATES largest probabilities
        # first: the same leading ranks as a whole row's sort, for a fraction of its time. Where
        # some row's candidates hold less than its top_p, the rows are sorted whole.
        ranked = _largest_first(probs, NUCLEUS_CANDIDATES)
        cumulative = ranked.cumsum(-1)
        if ranked.shape[1] < probs.shape[1] and bool((cumulative[:, -1] < top_p).any()):
            ranked = _largest_first(probs, probs.shape[1])
            cumulative = ranked.cumsum(-1)
        # The token at rank j is in the nucleus while the mass before it, cumulative[j - 1], is
        # still short of top_p; rank 0 always is.
        last = torch.searchsorted(cumulative, top_p[:, None]).clamp_(max=ranked.shape[1] - 1)
        # Compare by value, so tokens tied with the last one stay whatever the sort order.
        logits.masked_fill_(probs < ranked.gather(1, last), -math.inf)

    def draw(self, probs: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """A token per row of `probs` (each row's probabilities, in any scale) as step 5
        draws it, from requests[i]'s generator where it is seeded."""
        return self._draw(probs, self._rows_of(requests))

    def _draw(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Inverse transform sampling (step 5): one draw a row, where the exponential race
        needs a vocabulary's worth (about 6 ms of noise for 16 rows on 2 CPU cores). The sums
        go DRAW_CHUNK tokens at a time: the chunks' totals, the chunk the point falls in, then
        the cumulative sums within that chunk."""
        uniform = torch.empty(len(rows), dtype=torch.float64)
        unseeded = [j for j, row in enumerate(rows) if row.generator is None]
        if unseeded:
            uniform[unseeded] = torch.rand(
                len(unseeded), generator=self.generator, device=self.device, dtype=torch.float64
            ).cpu()
        for j, row in enumerate(rows):
            if row.generator is not None:  # request generators live on the CPU
                uniform[j] = torch.rand(1, generator=row.generator, dtype=torch.float64)
        batch, vocab = probs.shape
        num_chunks = -(-vocab // DRAW_CHUNK)
        if vocab % DRAW_CHUNK:
            probs = torch.nn.functional.pad(probs, (0, num_chunks * DRAW_CHUNK - vocab))
        chunks = probs.reshape(batch, num_chunks, DRAW_CHUNK)
        totals = chunks.sum(-1, dtype=torch.float64).cumsum(-1)
        zero = torch.zeros((), dtype=torch.float64, device=probs.device)
        # The point drawn, below the row's total: it falls in a chunk that holds probability.
        total = totals[:, -1]
        point = torch.minimum(uniform.to(probs.device) * total, torch.nextafter(total, zero))
        chunk = torch.searchsorted(totals, point[:, None], right=True)[:, 0]
        chunk.clamp_(max=num_chunks - 1)  # a row without probability (NaN) ends somewhere
        before = torch.where(
            chunk > 0, totals.gather(1, (chunk - 1).clamp(min=0)[:, None])[:, 0], zero
        )
        within = chunks[torch.arange(batch, device=probs.device), chunk].double().cumsum(-1)
        # Below the chunk's own sum too (its rounding may differ from its total's), so that the
        # token found has probability: its cumulative sum exceeds that of the one before.
        offset = torch.minimum(point - before, torch.nextafter(within[:, -1], zero))
        token = torch.searchsorted(within, offset[:, None], right=True)[:, 0]
        return (chunk * DRAW_CHUNK + token).clamp_(max=vocab - 1)

    def _sample_with_kernel(
        self, logits: torch.Tensor, requests: Sequence[Request], rows: Sequence[SamplingRow]
    ) -> torch.Tensor:
        from engine.kernels.triton.sampling import sample

        unseeded = iter(
            torch.randint(
                2**62, (len(requests),), generator=self.generator, device=self.device
            ).tolist()
        )
        seeds = [
            _mix_seed(row.seed, r.num_output_tokens) if row.seed is not None else next(unseeded)
            for row, r in zip(rows, requests, strict=True)
        ]
        return sample(
            logits.contiguous(),
            torch.tensor(
                [0.0 if row.greedy else row.temperature for row in rows], device=self.device
            ),
            torch.tensor([row.top_k for row in rows], dtype=torch.int32, device=self.device),
            torch.tensor([row.top_p for row in rows], device=self.device),
            torch.tensor([row.min_p for row in rows], device=self.device),
            torch.tensor(seeds, dtype=torch.int64, device=self.device),
        )

    def _logprobs(
        self, logits: torch.Tensor, token_ids: list[int], rows: Sequence[SamplingRow]
    ) -> list[Logprobs | None]:
        out: list[Logprobs | None] = [None] * len(rows)
        asked: list[int] = []
        num_top: list[int] = []
        for i, row in enumerate(rows):
            if row.logprobs is not None:
                asked.append(i)
                num_top.append(row.logprobs)
        if not asked:
            return out
        records = token_logprobs(logits[self._index(asked)], [token_ids[i] for i in asked], num_top)
        for i, record in zip(asked, records, strict=False):
            out[i] = record
        return out


# Rows of log_softmax computed at once: bounds the float32 copy a long prompt's logits need.
LOGPROB_ROWS_PER_SLICE = 256


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(-1) of a 2-d tensor (the first of tied maxima; NaN counts as the largest,
    as in torch): on the CPU through numpy, whose vectorized argmax takes about a tenth of
    torch's time over a vocabulary's row (0.1 against 1.3 ms for 16 rows of 49152)."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.numpy().argmax(-1))
    return values.argmax(-1)


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[Logprobs]:
    """Per row i: the float32 log_softmax of the raw logits at token_ids[i], and the num_top[i]
    most likely (token id, logprob), most likely first."""
    if not token_ids:
        return []
    targets = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    k = max(num_top)
    out: list[Logprobs] = []
    for begin in range(0, len(token_ids), LOGPROB_ROWS_PER_SLICE):
        end = begin + LOGPROB_ROWS_PER_SLICE
        logprobs = logits[begin:end].float().log_softmax(-1)
        chosen = logprobs.gather(1, targets[begin:end, None])[:, 0].tolist()
        top = logprobs.topk(k, dim=-1)
        for value, top_values, top_ids, row_k in zip(
            chosen, top.values.tolist(), top.indices.tolist(), num_top[begin:end], strict=False
        ):
            out.append((value, list(zip(top_ids[:row_k], top_values[:row_k], strict=False))))
    return out


def record_prompt_logprobs(
    logits: torch.Tensor, spans: Sequence[PromptLogprobSpan], scheduled: Sequence[Request]
) -> None:
    """Append each span's logprob records to its request (scheduled[span.batch_index]); logits
    has one row per span token, spans in order, columns cut to the vocabulary (which rows a
    step computes is engine.core.prompt_logprobs')."""
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


def _largest_first(values: torch.Tensor, count: int) -> torch.Tensor:
    """Each row's `count` largest values (all, in a narrower row), largest first (values only:
    top-p needs no indices)."""
    count = min(count, values.shape[1])
    if values.device.type != "cpu":
        return values.topk(count, dim=-1).values
    # numpy's SIMD sort is tens of times faster than torch.sort on CPU. Its partition finds a
    # row's largest values in about a fifth of a whole row's sort, but takes ten times as long
    # as the sort over rows of many equal values (the zeros top-k or min-p leave): a sample of
    # every 64th value says which kind the rows are.
    rows = values.numpy()
    width = rows.shape[1]
    sample = rows[:, ::SAMPLE_STRIDE]
    if count < width and 2 * np.count_nonzero(sample) > sample.size:
        rows = np.partition(rows, width - count, axis=-1)[:, -count:]
    return torch.from_numpy(np.ascontiguousarray(np.sort(rows, axis=-1)[:, : -count - 1 : -1]))


def _mix_seed(seed: int, step: int) -> int:
    """A well-spread 62-bit row seed from a request seed and its step (splitmix64's finalizer)."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 2
