"""Per step, which running requests draft tokens and how many; the acceptance books after.

Before the scheduler runs, `propose` sets `request.spec_token_ids` for each decoding request
that may speculate: its proposer's tokens, at most its adaptive length. The ngram and suffix
proposers draft a request at a time; a draft model (a DraftProposer: the model executor's
engine.spec_decode.draft_model) drafts the step's requests in one batch, and its per-request
KV blocks are freed when a request ends or stops running. The length follows the
request's recent acceptance (an exponentially weighted rate, starting at the engine's recent
rate over all requests): a request whose drafts keep being rejected stops drafting for a
while, then tries one token again. The whole step drafts nothing
when the batch is large enough that verifying costs more than it saves, a threshold computed
from the step cost model (`folio bench profile`; engine.core.step_cost), not a constant, and
when the steps this engine measured at that batch size say so (MeasuredSteps): a step with
drafts must cost less time per token it yields than a plain step of as many sequences (one in
PROBE_STEPS steps drafts anyway, to measure again); at one stream the tokens a step would yield
by the request's own recent acceptance count too, where they are more than the measured steps
yielded (those may have met other text).

After the step, `settle` records how many of a request's drafts were accepted. Requests whose
tokens depend on their own output in ways a draft would change (penalties, min_tokens not yet
reached, bad words), and those limited to allowed_token_ids (only a plain step notices a row its
limits leave no token), never draft: one log line says so, once per reason. A request with a
structured-output grammar drafts only what its grammar accepts: its drafts are cut at the first
token the grammar refuses (the executor's grammar_allows), and verification draws each
position under the mask the grammar gives after the drafts before it
(engine.structured_output).

Torch-free: it never sees the model or the logits (verification is engine.spec_decode.verify's)
and never changes what a request has computed (the engine loop does).
"""

from __future__ import annotations

import logging
import statistics
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.speculative import SpeculativeConfig
from engine.core.request import Request
from engine.core.step_cost import LiveStepCost
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.suffix import SuffixIndex

logger = logging.getLogger(__name__)

# Weight of one step's acceptance in a request's running rate. A new request starts at the
# engine's recent rate over every request's verification steps (each weighing PRIOR_WEIGHT),
# INITIAL_RATE before any: traffic that copies starts drafting whole lengths at once, and
# open-ended traffic tries one token before its first pause instead of three.
RATE_WEIGHT = 0.3
PRIOR_WEIGHT = 0.05
INITIAL_RATE = 0.5
# Below this rate a request stops drafting for PAUSE_STEPS steps, then tries one token; each
# pause that ends in a rejection doubles the next (up to 2**MAX_DOUBLINGS times), so open-ended
# text, whose stray n-gram matches are almost never right, pays for fewer and fewer tries.
LOW_RATE = 0.15
PAUSE_STEPS = 16
MAX_DOUBLINGS = 4
# Recent steps of each kind and batch size that say what each costs there. A drafting step is
# compared with the plain steps just before it (a shared machine's load changes over seconds,
# so that pair sees about the same load), and the middle of those comparisons counts (one slow
# step, of either kind, must not decide). Comparing fastest times instead, the fastest of many
# plain steps against that of a few probes, a loaded machine turned drafting off at one stream
# where it pays twice over. While drafting does not pay, one step in PROBE_STEPS drafts anyway,
# so that a change (requests that copy more) is seen.
TIMED_STEPS = 8
PROBE_STEPS = 32
# Until a kind of drafting step has this many measurements at a batch size, it is measured
# again every FEW_PROBE_STEPS steps instead: one step slowed by a busy machine must not stop
# drafting for PROBE_STEPS steps (at one stream, most of a request).
MIN_MEASURED = 4
FEW_PROBE_STEPS = 4
# Drafting pays when its time per token is below this share of a plain step's: a margin for
# the noise of a shared machine's step times, where drafting that only breaks even (16 streams
# on 2 cores) gains nothing and a wrong turn on costs up to a fifth.
PAYS_BELOW = 0.9
# Drafting levels of a step: none, at most one token a request, each request's adaptive length.
NONE, FIRST_ONLY, FULL = 0, 1, 2


@dataclass(slots=True)
class _Acceptance:
    rate: float
    paused: int = 0  # steps left without drafting
    pauses: int = 0  # pauses since a draft of this request was last accepted
    settled: bool = False  # whether any of its drafts were verified (the rate is its own)


@dataclass(frozen=True, slots=True)
class _Summary:
    """A batch size's recent drafting steps at one level, as MeasuredSteps.pays weighs them:
    the middle of their time ratios to plain steps, and their summed tokens (common to the
    batch, the rest) and sequences."""

    ratio: float
    common: int
    rest: int
    sequences: int


@dataclass(frozen=True, slots=True)
class _DraftingStep:
    seconds: float
    batch: int  # sequences
    tokens: int  # tokens it yielded: the sequences' and their accepted drafts
    common: int  # of those, the batch's together: batch x (1 + the fewest a sequence accepted)
    plain: float  # seconds per sequence of the plain steps just before it (their median)


class MeasuredSteps:
    """This engine's decode-only steps per batch size (sequences): plain ones, and those with
    drafts at each drafting level (FIRST_ONLY: at most one draft a request; FULL: each
    request's adaptive length).

    A step's cost depends on its batch: one stream is memory-bound (verifying drafts nearly
    free) where a large batch is compute-bound (each draft costs about what a sequence does),
    so steps of different batch sizes are never compared. At a batch size, each drafting step's
    time is divided by that of a plain step of as many sequences (the median time per sequence
    of the plain steps just before it); drafting pays while the middle (lower median) of those
    ratios is below PAYS_BELOW times what the tokens the drafting steps yielded would cost in
    plain steps (the recent steps' sums: the acceptance actually measured, not expected).

    Tokens are not all worth a plain step's share: the tokens a step yields for every sequence
    alike (batch x (1 + the fewest drafts a sequence had accepted)) save whole steps, each
    worth a plain step's time per sequence; a request's accepted drafts beyond those only end
    it sooner, while the requests that accepted less keep the steps going. While requests wait
    for a place, the one that ends sooner makes room for a waiting one sooner, so such a token
    is worth a whole share too. Without requests waiting (a batch draining: every one of
    `bench spec`'s 16-stream runs; or a batch with room to spare, which newcomers join whoever
    ends) it saves only what one sequence fewer saves in the later steps: the marginal
    cost of a sequence, from the plain steps of this batch size and of the nearest measured
    batch at least a quarter smaller (none: a batch of 0 that costs nothing, so the marginal
    cost is the share). On 2 cores that is about 0.4 of the share at 16 sequences, where
    verifying a draft costs about a whole share: drafts accepted by some requests of a batch
    only pay where verifying them is cheap. A batch size counts as measured by its nearest
    measured neighbour within an eighth of it (a finishing request changes the batch every
    few steps)."""

    def __init__(self) -> None:
        self._plain: dict[int, deque[float]] = {}
        self._drafting: dict[tuple[int, int], deque[_DraftingStep]] = {}
        # Per drafting deque, what `pays` reads of it, computed when a step joins it (the gate
        # is asked every step; a drafting step is measured far less often).
        self._summaries: dict[tuple[int, int], _Summary] = {}

    def observe(
        self,
        level: int,
        batch: int,
        seconds: float,
        rows: int,
        tokens: int,
        common: int,
    ) -> None:
        """A decode-only step of `batch` sequences at a drafting level: `rows` query tokens
        (more than `batch` when it verified drafts) yielding `tokens` tokens, in `seconds`;
        `common` of them the batch's together (batch x (1 + the fewest drafts a sequence had
        accepted))."""
        if batch <= 0 or seconds <= 0:
            return
        if rows <= batch:
            self._plain.setdefault(batch, deque(maxlen=TIMED_STEPS)).append(seconds / batch)
            return
        near = _nearest(self._plain, batch)
        if near is None:
            return  # nothing to compare it with (a plain step is measured first)
        plain = statistics.median(self._plain[near])
        tokens = max(tokens, batch)
        common = min(max(common, batch), tokens)
        steps = self._drafting.setdefault((level, batch), deque(maxlen=TIMED_STEPS))
        steps.append(_DraftingStep(seconds, batch, tokens, common, plain))
        common_sum = sum(step.common for step in steps)
        self._summaries[level, batch] = _Summary(
            ratio=statistics.median_low(step.seconds / (step.batch * step.plain) for step in steps),
            common=common_sum,
            rest=sum(step.tokens for step in steps) - common_sum,
            sequences=sum(step.batch for step in steps),
        )

    def plain_measured(self, batch: int) -> bool:
        return _nearest(self._plain, batch) is not None

    def count(self, level: int, batch: int) -> int:
        """How many drafting steps at `level` near this batch size are measured."""
        b = self._drafting_near(level, batch)
        return 0 if b is None else len(self._drafting[level, b])

    def pays(self, level: int, batch: int, waiting: bool, expected: float = 1.0) -> bool | None:
        """Whether drafting at `level` pays at this batch size, with or without requests
        `waiting` for a place; None while unmeasured near it. `expected`: what a step's tokens
        are worth, in plain steps' shares a sequence, by the running request's own recent
        acceptance (the drafter's `_expected_worth`, one stream), counted where it is more
        than the measured steps yielded."""
        b = self._drafting_near(level, batch)
        if b is None:
            return None
        summary = self._summaries[level, b]
        rest = summary.rest
        share = 1.0 if waiting or not rest else self.marginal_share(batch)
        worth = (summary.common + rest * share) / summary.sequences
        return summary.ratio < PAYS_BELOW * max(worth, expected)

    def marginal_share(self, batch: int) -> float:
        """What one sequence fewer saves in a plain step of about `batch` sequences, as a share
        of its time per sequence (1.0 while no smaller batch is measured)."""
        near = _nearest(self._plain, batch)
        if near is None:
            return 1.0
        share = statistics.median(self._plain[near])
        below = [b for b in self._plain if b <= near - max(1, near // 4)]
        smaller = max(below, default=0)
        smaller_step = smaller and smaller * statistics.median(self._plain[smaller])
        marginal = (near * share - smaller_step) / (near - smaller)
        return min(1.0, max(0.0, marginal / share))

    def _drafting_near(self, level: int, batch: int) -> int | None:
        """The batch size nearest `batch` with drafting steps measured at `level`, if any."""
        return _nearest((b for lv, b in self._drafting if lv == level), batch)


def _nearest(batches: Iterable[int], batch: int) -> int | None:
    """The batch size nearest `batch` within an eighth of it (at least 1), if any."""
    near = [b for b in batches if abs(b - batch) <= max(1, batch // 8)]
    return min(near, key=lambda b: abs(b - batch)) if near else None


def _fit_rows(drafts: Sequence[list[int]], room: int) -> None:
    """Cut the longest drafts a token at a time until they fit `room` rows together."""
    lengths = [len(draft) for draft in drafts]
    excess = sum(lengths) - max(room, 0)
    while excess > 0:
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        lengths[longest] -= 1
        excess -= 1
    for draft, length in zip(drafts, lengths, strict=True):
        del draft[length:]


class TokenArrays:
    """Each drafting request's tokens as one int64 array, extended by the tokens it gained since
    its last draft (a running request's tokens only grow): the proposers search arrays, and
    converting a long request's whole list every step cost more than their search (80 us of
    ngram's 99 at 4,000 tokens)."""

    def __init__(self) -> None:
        self._arrays: weakref.WeakKeyDictionary[Request, tuple[np.ndarray, int]] = (
            weakref.WeakKeyDictionary()
        )

    def of(self, request: Request) -> np.ndarray:
        tokens = request.token_ids
        length = len(tokens)
        buffer, filled = self._arrays.get(request, (None, 0))
        if buffer is None or filled > length:
            buffer, filled = np.empty(2 * length, np.int64), 0
        elif length > len(buffer):
            grown = np.empty(2 * length, np.int64)
            grown[:filled] = buffer[:filled]
            buffer = grown
        buffer[filled:length] = tokens[filled:]
        self._arrays[request] = (buffer, length)
        return buffer[:length]


class DraftProposer(Protocol):
    """A proposer that runs a model (engine.spec_decode.draft_model.DraftModel): it drafts a
    step's requests in one batch and holds KV blocks per request until told to free them."""

    def propose(self, requests: Sequence[Request], lengths: Sequence[int]) -> list[list[int]]:
        """Up to lengths[i] drafted tokens continuing requests[i]'s tokens."""
        ...

    def release(self, request_id: str) -> None:
        """The request ended: free what is held for it."""
        ...

    def retain(self, request_ids: set[str]) -> None:
        """Only these requests run: free what is held for any other (preempted ones)."""
        ...


@dataclass
class SpecStats:
    """Cumulative counters (vLLM's metrics): verification steps with drafts, drafted tokens,
    accepted tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Drafter:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        step_cost: LiveStepCost | None,
        draft_model: DraftProposer | None = None,
        grammar_allows: Callable[[Request, list[int]], int] | None = None,
        max_rows: int | None = None,
    ) -> None:
        """`draft_model`: the executor's draft model, for method draft_model. `grammar_allows`:
        how many leading drafts a constrained request's grammar accepts (the executor's; None:
        no request is constrained). `max_rows`: the most rows a step may have for its rows to
        be computed as in a plain step (the executor's max_invariant_rows; None: no bound): a
        verification step past it would round otherwise and could change greedy tokens."""
        if config.method == "draft_model" and draft_model is None:
            raise ValueError(
                "speculative_config: method: draft_model needs an executor that runs models "
                "(the model executor); this one has no draft model"
            )
        self.config = config
        self.draft_model = draft_model
        self.grammar_allows = grammar_allows
        self.max_model_len = max_model_len
        self.max_rows = max_rows
        self.step_cost = step_cost
        self.stats = SpecStats()
        self.suffix = (
            SuffixIndex(
                config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests
            )
            if config.method == "suffix"
            else None
        )
        self._acceptance: weakref.WeakKeyDictionary[Request, _Acceptance] = (
            weakref.WeakKeyDictionary()
        )
        self._said: set[str] = set()
        self.token_arrays = TokenArrays()
        # The rate a new request starts at (PRIOR_WEIGHT).
        self.prior = INITIAL_RATE
        # None: no measured gate, drafting follows acceptance and the step cost model only
        # (tests set it, so that a loaded machine's step times do not decide what is drafted).
        self.measured: MeasuredSteps | None = MeasuredSteps()
        self._since_probe = 0
        # The current step's drafts and accepted drafts (settle's), for its measurement: the
        # sums, the requests that verified drafts and the fewest any of them had accepted.
        self._step_drafted = 0
        self._step_accepted = 0
        self._step_settled = 0
        self._step_fewest = 0
        self._step_level = NONE

    def propose(self, running: list[Request], num_waiting: int = 0) -> None:
        """Set spec_token_ids of the running requests that draft this step (others get []);
        `num_waiting`: the requests waiting for a place in the batch (MeasuredSteps)."""
        if self.draft_model is not None:
            self.draft_model.retain({r.request_id for r in running})
        candidates = [r for r in running if self._may_draft(r)]
        for request in running:
            request.spec_token_ids = []
        self._step_drafted = self._step_accepted = self._step_settled = self._step_fewest = 0
        self._step_level = NONE
        if not candidates or not self._worth_it(len(running), candidates):
            return
        measured = self.measured
        level = (
            FULL if measured is None else self._measured_level(measured, running, num_waiting > 0)
        )
        self._step_level = level
        if level == NONE:
            return
        drafting: list[tuple[Request, int]] = []
        for request in candidates:
            state = self._state(request)
            if state.paused:
                state.paused -= 1
                continue
            if (k := self._draft_length(request, state, level)) > 0:
                drafting.append((request, k))
        if self.draft_model is not None and drafting:
            requests, lengths = zip(*drafting, strict=True)
            drafts = self.draft_model.propose(requests, lengths)
        else:
            drafts = [self._draft(request, k) for request, k in drafting]
        for (request, _), draft in zip(drafting, drafts, strict=True):
            if draft and request.sampling_params.structured_output is not None:
                assert self.grammar_allows is not None, "a constrained request without a grammar"
                del draft[self.grammar_allows(request, draft) :]
        if self.max_rows is not None:
            _fit_rows(drafts, self.max_rows - len(running))
        for (request, _), draft in zip(drafting, drafts, strict=True):
            request.spec_token_ids = draft

    def _state(self, request: Request) -> _Acceptance:
        """The request's acceptance books, opened at the engine's recent rate."""
        state = self._acceptance.get(request)
        if state is None:
            state = self._acceptance[request] = _Acceptance(self.prior)
        return state

    def _rate(self, request: Request) -> float:
        state = self._acceptance.get(request)
        return self.prior if state is None else state.rate

    def _draft_length(self, request: Request, state: _Acceptance, level: int) -> int:
        """How many tokens the request drafts at `level`: its adaptive length, within its
        room (max_tokens, the model's length)."""
        room = self.max_model_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return min(room, self._length(state), 1 if level == FIRST_ONLY else room)

    def _expected_worth(self, level: int, running: list[Request]) -> float:
        """At one stream, what a step drafting at `level` would yield, in plain steps, if the
        request accepted its drafts at its own recent rate: the drafting steps measured before
        may have met other text (an answer's preamble before the part it copies). 1.0 (the
        measured steps decide alone) for a request with no verified drafts yet or paused, and
        in a batch, which advances together by the fewest drafts any of its sequences accepts:
        the fewest of many is far below the fewest of their expected counts."""
        if len(running) != 1:
            return 1.0
        [request] = running
        state = self._acceptance.get(request)
        if state is None or not state.settled or state.paused:
            return 1.0
        return 1 + state.rate * self._draft_length(request, state, level)

    def _length(self, state: _Acceptance) -> int:
        """The request's draft length: its expected accepted tokens plus one, at most the
        configured number."""
        expected = state.rate * self.config.num_speculative_tokens
        return max(1, min(self.config.num_speculative_tokens, round(expected) + 1))

    def _draft(self, request: Request, k: int) -> list[int]:
        config = self.config
        tokens = self.token_arrays.of(request)
        if self.suffix is not None:
            return self.suffix.propose(tokens, k)
        return propose_ngram(tokens, k, config.prompt_lookup_min, config.prompt_lookup_max)

    def _worth_it(self, batch: int, candidates: list[Request]) -> bool:
        """Whether drafting pays at this batch size. A step of B decoding sequences costs
        f + B*d; verifying k drafts each adds B*k*c (c: a prefill token's cost) and yields
        r*k more tokens per sequence (r: the acceptance rate). It pays while
        r*k*(f + B*d) > B*k*c, i.e. B < r*f / (c - r*d) (always when c <= r*d)."""
        if self.step_cost is None:
            return True
        model = self.step_cost.model
        rates = [self._rate(r) for r in candidates]
        rate = sum(rates) / len(rates)
        margin = model.prefill_token_seconds - rate * model.decode_sequence_seconds
        return margin <= 0 or batch < rate * model.fixed_seconds / margin

    def _measured_level(
        self, measured: MeasuredSteps, running: list[Request], waiting: bool
    ) -> int:
        """How much to draft at this batch size, as the steps measured there say
        (MeasuredSteps) and, at one stream, the request's recent acceptance. Measured first: a plain
        step, then one with at most one draft a request (the likeliest accepted: when those do
        not pay, longer drafts do not either; while they do not, one step in PROBE_STEPS
        measures them again, one in FEW_PROBE_STEPS while fewer than MIN_MEASURED are), then
        full lengths (while they do not pay but single drafts do, tried as often)."""
        batch = len(running)
        if not measured.plain_measured(batch):
            return NONE

        def pays(level: int) -> bool | None:
            return measured.pays(level, batch, waiting, self._expected_worth(level, running))

        first = pays(FIRST_ONLY)
        if first is None:
            return FIRST_ONLY
        full = pays(FULL) if first else False
        if full is None or full:
            return FULL
        probe = FULL if first else FIRST_ONLY
        every = PROBE_STEPS if measured.count(probe, batch) >= MIN_MEASURED else FEW_PROBE_STEPS
        self._since_probe += 1
        if self._since_probe >= every:
            self._since_probe = 0
            return probe
        return FIRST_ONLY if first else NONE

    def observe_step(self, drafted: bool, num_sequences: int, seconds: float) -> None:
        """A decode-only step's measured time (the engine's), with or without drafts to verify
        (those settled since `propose`)."""
        if self.measured is None:
            return
        num_drafted = self._step_drafted if drafted else 0
        num_accepted = self._step_accepted if drafted else 0
        # The batch advanced together by the fewest drafts a sequence had accepted; by none
        # when a sequence verified no drafts.
        together = self._step_fewest if self._step_settled >= num_sequences else 0
        self.measured.observe(
            self._step_level,
            num_sequences,
            seconds,
            num_sequences + num_drafted,
            num_sequences + num_accepted,
            num_sequences * (1 + together),
        )

    def _may_draft(self, request: Request) -> bool:
        """A decoding request whose next tokens depend on nothing a draft changes."""
        if request.num_computed_tokens != request.num_tokens - 1 or request.samples:
            return False
        if request.pooling is not None or not request.output_token_ids:
            return False
        params = request.sampling_params
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            return self._skip("repetition, presence or frequency penalties")
        if params.allowed_token_ids is not None or params.bad_words_token_ids:
            # A multi-token bad word bans by the output, drafts included; and only a step's
            # plain sampling notices a row its limits leave no token (Sampler.NO_TOKEN).
            return self._skip("allowed_token_ids or bad_words")
        return request.num_output_tokens >= params.min_tokens

    def _skip(self, reason: str) -> bool:
        if reason not in self._said:
            self._said.add(reason)
            logger.info("speculative decoding skips requests with %s", reason)
        return False

    def finished(self, request: Request) -> None:
        """A request that ended: the suffix proposer searches its output for later requests;
        the draft model frees its KV blocks."""
        if self.draft_model is not None:
            self.draft_model.release(request.request_id)
        if self.suffix is not None and request.output_token_ids:
            self.suffix.finished(request.output_token_ids)

    def settle(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """After a verification step: `num_accepted` of the request's `num_drafted` drafts."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        self._step_drafted += num_drafted
        self._step_accepted += num_accepted
        settled = self._step_settled
        self._step_fewest = num_accepted if not settled else min(self._step_fewest, num_accepted)
        self._step_settled = settled + 1
        request.num_drafted_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        self.prior += PRIOR_WEIGHT * (num_accepted / num_drafted - self.prior)
        state = self._state(request)
        state.settled = True
        state.rate += RATE_WEIGHT * (num_accepted / num_drafted - state.rate)
        if num_accepted:
            state.pauses = 0
        if state.rate < LOW_RATE:
            state.paused = PAUSE_STEPS << min(state.pauses, MAX_DOUBLINGS)
            state.pauses += 1
            state.rate = 0.0  # back at one token, and paused again unless it is accepted
