"""Per step, which running requests draft tokens and how many; the acceptance books after.

Before the scheduler runs, `propose` sets `request.spec_token_ids` for each decoding request
that may speculate: its proposer's tokens, at most its adaptive length. The length follows the
request's recent acceptance (an exponentially weighted rate): a request whose drafts keep being
rejected stops drafting for a while, then tries one token again. The whole step drafts nothing
when the batch is large enough that verifying costs more than it saves, a threshold computed
from the step cost model (`folio bench profile`; engine.core.step_cost), not a constant, and
when the steps this engine measured at that batch size say so (MeasuredSteps): a step with
drafts must cost less time per token it yields than a plain step of as many sequences (one in
PROBE_STEPS steps drafts anyway, to measure again).

After the step, `settle` records how many of a request's drafts were accepted. Requests whose
tokens depend on their own output in ways a draft would change (penalties, min_tokens not yet
reached, a structured-output grammar) never draft: one log line says so, once per reason.

Torch-free: it never sees the model or the logits (verification is engine.spec_decode.rejection's)
and never changes what a request has computed (the engine loop does).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from common.speculative import SpeculativeConfig
from engine.core.request import Request
from engine.core.step_cost import LiveStepCost
from engine.spec_decode.ngram import propose_ngram
from engine.spec_decode.suffix import SuffixIndex

logger = logging.getLogger(__name__)

# Weight of one step's acceptance in a request's running rate, and the rate a request starts at.
RATE_WEIGHT = 0.3
INITIAL_RATE = 0.5
# Below this rate a request stops drafting for PAUSE_STEPS steps, then tries one token.
LOW_RATE = 0.15
PAUSE_STEPS = 16
# Recent steps of each kind and batch size whose fastest is that kind's cost there: a busy
# machine only ever adds time to a step, and one slow step must not stop drafting. While drafting
# does not pay, one step in PROBE_STEPS drafts anyway, so that a change (requests that copy
# more) is seen.
TIMED_STEPS = 8
PROBE_STEPS = 32
# Plain steps are kept as far back as TIMED_STEPS probes reach: while drafting is off a plain
# step runs every step and a probe one in PROBE_STEPS, and the fastest of a longer stretch is
# likelier to come from a quiet moment of a shared machine. Over equal stretches, load spikes
# favour neither kind (over 8 plain steps against 8 probes, a loaded machine turned drafting
# on at 16 streams, where it costs more than it saves).
TIMED_PLAIN_STEPS = TIMED_STEPS * PROBE_STEPS
# Drafting levels of a step: none, at most one token a request, each request's adaptive length.
NONE, FIRST_ONLY, FULL = 0, 1, 2


@dataclass(slots=True)
class _Acceptance:
    rate: float = INITIAL_RATE
    paused: int = 0  # steps left without drafting


@dataclass(frozen=True, slots=True)
class _DraftingStep:
    seconds: float
    rows: int  # query tokens: the sequences and their drafts
    tokens: int  # tokens it yielded: the sequences' and their accepted drafts


class MeasuredSteps:
    """This engine's decode-only steps per batch size (sequences): plain ones, and those with
    drafts at each drafting level (FIRST_ONLY: at most one draft a request; FULL: each
    request's adaptive length).

    A step's cost depends on its batch: one stream is memory-bound (verifying drafts nearly
    free) where a large batch is compute-bound (each draft costs about what a sequence does),
    so steps of different batch sizes are never compared. At a batch size, a plain step costs
    its fastest recent time per sequence (of TIMED_PLAIN_STEPS); a drafting step its fastest
    recent time per query row (of TIMED_STEPS) times the rows it takes per token yielded
    (those steps' sums: the acceptance actually measured, not expected). A batch size counts
    as measured by its nearest measured neighbour within an eighth of it (a finishing request
    changes the batch every few steps)."""

    def __init__(self) -> None:
        self._plain: dict[int, deque[float]] = {}
        self._drafting: dict[tuple[int, int], deque[_DraftingStep]] = {}

    def observe(self, level: int, batch: int, seconds: float, rows: int, tokens: int) -> None:
        """A decode-only step of `batch` sequences at a drafting level: `rows` query tokens
        (more than `batch` when it verified drafts) yielding `tokens` tokens, in `seconds`."""
        if batch <= 0 or seconds <= 0:
            return
        if rows > batch:
            steps = self._drafting.setdefault((level, batch), deque(maxlen=TIMED_STEPS))
            steps.append(_DraftingStep(seconds, rows, max(tokens, batch)))
        else:
            plain = self._plain.setdefault(batch, deque(maxlen=TIMED_PLAIN_STEPS))
            plain.append(seconds / batch)

    def plain_measured(self, batch: int) -> bool:
        return _nearest(self._plain, batch) is not None

    def pays(self, level: int, batch: int) -> bool | None:
        """Whether drafting at `level` pays at this batch size; None while unmeasured near it."""
        b = _nearest((b for lv, b in self._drafting if lv == level), batch)
        plain = _nearest(self._plain, batch)
        if b is None or plain is None:
            return None
        steps = self._drafting[level, b]
        per_row = min(step.seconds / step.rows for step in steps)
        rows_per_token = sum(step.rows for step in steps) / sum(step.tokens for step in steps)
        return per_row * rows_per_token < min(self._plain[plain])


def _nearest(batches: Iterable[int], batch: int) -> int | None:
    """The batch size nearest `batch` within an eighth of it (at least 1), if any."""
    near = [b for b in batches if abs(b - batch) <= max(1, batch // 8)]
    return min(near, key=lambda b: abs(b - batch)) if near else None


@dataclass
class SpecStats:
    """Cumulative counters (vLLM's metrics): verification steps with drafts, drafted tokens,
    accepted tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Drafter:
    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, step_cost: LiveStepCost | None
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
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
        # None: no measured gate, drafting follows acceptance and the step cost model only
        # (tests set it, so that a loaded machine's step times do not decide what is drafted).
        self.measured: MeasuredSteps | None = MeasuredSteps()
        self._since_probe = 0
        # The current step's drafts and accepted drafts (settle's), for its measurement.
        self._step_drafted = 0
        self._step_accepted = 0
        self._step_level = NONE

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of the running requests that draft this step (others get [])."""
        candidates = [r for r in running if self._may_draft(r)]
        for request in running:
            request.spec_token_ids = []
        self._step_drafted = self._step_accepted = 0
        self._step_level = NONE
        if not candidates or not self._worth_it(len(running), candidates):
            return
        level = FULL if self.measured is None else self._measured_level(self.measured, len(running))
        self._step_level = level
        if level == NONE:
            return
        for request in candidates:
            state = self._acceptance.setdefault(request, _Acceptance())
            if state.paused:
                state.paused -= 1
                continue
            room = self.max_model_len - request.num_tokens - 1
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - request.num_output_tokens - 1)
            k = min(room, self._length(state), 1 if level == FIRST_ONLY else room)
            if k > 0:
                request.spec_token_ids = self._draft(request, k)

    def _length(self, state: _Acceptance) -> int:
        """The request's draft length: its expected accepted tokens plus one, at most the
        configured number."""
        expected = state.rate * self.config.num_speculative_tokens
        return max(1, min(self.config.num_speculative_tokens, round(expected) + 1))

    def _draft(self, request: Request, k: int) -> list[int]:
        config = self.config
        if self.suffix is not None:
            return self.suffix.propose(request.token_ids, k)
        return propose_ngram(
            request.token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def _worth_it(self, batch: int, candidates: list[Request]) -> bool:
        """Whether drafting pays at this batch size. A step of B decoding sequences costs
        f + B*d; verifying k drafts each adds B*k*c (c: a prefill token's cost) and yields
        r*k more tokens per sequence (r: the acceptance rate). It pays while
        r*k*(f + B*d) > B*k*c, i.e. B < r*f / (c - r*d) (always when c <= r*d)."""
        if self.step_cost is None:
            return True
        model = self.step_cost.model
        rates = [self._acceptance.get(r, _Acceptance()).rate for r in candidates]
        rate = sum(rates) / len(rates)
        margin = model.prefill_token_seconds - rate * model.decode_sequence_seconds
        return margin <= 0 or batch < rate * model.fixed_seconds / margin

    def _measured_level(self, measured: MeasuredSteps, batch: int) -> int:
        """How much to draft at this batch size, as the steps measured there say
        (MeasuredSteps). Measured first: a plain step, then one with at most one draft a
        request (the likeliest accepted: when those do not pay, longer drafts do not either;
        while they do not, one step in PROBE_STEPS measures them again), then full lengths
        (while they do not pay but single drafts do, one step in PROBE_STEPS tries them)."""
        if not measured.plain_measured(batch):
            return NONE
        first = measured.pays(FIRST_ONLY, batch)
        if first is None:
            return FIRST_ONLY
        full = measured.pays(FULL, batch) if first else False
        if full is None or full:
            return FULL
        self._since_probe += 1
        if self._since_probe >= PROBE_STEPS:
            self._since_probe = 0
            return FULL if first else FIRST_ONLY
        return FIRST_ONLY if first else NONE

    def observe_step(self, drafted: bool, num_sequences: int, seconds: float) -> None:
        """A decode-only step's measured time (the engine's), with or without drafts to verify
        (those settled since `propose`)."""
        if self.measured is None:
            return
        num_drafted = self._step_drafted if drafted else 0
        num_accepted = self._step_accepted if drafted else 0
        self.measured.observe(
            self._step_level,
            num_sequences,
            seconds,
            num_sequences + num_drafted,
            num_sequences + num_accepted,
        )

    def _may_draft(self, request: Request) -> bool:
        """A decoding request whose next tokens depend on nothing a draft changes."""
        if request.num_computed_tokens != request.num_tokens - 1 or request.samples:
            return False
        if request.pooling is not None or not request.output_token_ids:
            return False
        params = request.sampling_params
        if params.structured_output is not None:
            return self._skip("structured output (its grammar is not checked against drafts)")
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            return self._skip("repetition, presence or frequency penalties")
        return request.num_output_tokens >= params.min_tokens

    def _skip(self, reason: str) -> bool:
        if reason not in self._said:
            self._said.add(reason)
            logger.info("speculative decoding skips requests with %s", reason)
        return False

    def finished(self, request: Request) -> None:
        """A request that ended: the suffix proposer searches its output for later requests."""
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
        request.num_drafted_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        state = self._acceptance.setdefault(request, _Acceptance())
        state.rate += RATE_WEIGHT * (num_accepted / num_drafted - state.rate)
        if state.rate < LOW_RATE:
            state.paused = PAUSE_STEPS
            state.rate = 0.0  # back at one token, and paused again unless it is accepted
