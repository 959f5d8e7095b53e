"""Per step, which running requests draft tokens and how many; the acceptance books after.

Before the scheduler runs, `propose` sets `request.spec_token_ids` for each decoding request
that may speculate: its proposer's tokens, at most its adaptive length. The length follows the
request's recent acceptance (an exponentially weighted rate): a request whose drafts keep being
rejected stops drafting for a while, then tries one token again. The whole step drafts nothing
when the batch is large enough that verifying costs more than it saves, a threshold computed
from the step cost model (`folio bench profile`; engine.core.step_cost), not a constant, and
when the steps this engine measured say so: a step with drafts must take less time per sequence
than the plain steps it replaces, the fastest of each kind's recent steps compared (one in
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
# Recent steps of each kind whose fastest is that kind's cost: a busy machine only ever adds
# time to a step, and one slow step must not stop drafting. While drafting does not pay, one
# step in PROBE_STEPS drafts anyway, so that a change (requests that copy more) is seen.
TIMED_STEPS = 8
PROBE_STEPS = 32


@dataclass(slots=True)
class _Acceptance:
    rate: float = INITIAL_RATE
    paused: int = 0  # steps left without drafting


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
        # Measured seconds of recent steps that verified drafts and of those that did not,
        # per sequence they decoded, and steps since the last probe.
        self._step_seconds: dict[bool, deque[float]] = {
            True: deque(maxlen=TIMED_STEPS),
            False: deque(maxlen=TIMED_STEPS),
        }
        self._since_probe = 0

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids of the running requests that draft this step (others get [])."""
        candidates = [r for r in running if self._may_draft(r)]
        for request in running:
            request.spec_token_ids = []
        if not candidates or not self._worth_it(len(running), candidates):
            return
        if not self._pays_as_measured(candidates):
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
            k = min(room, self._length(state))
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

    def _pays_as_measured(self, candidates: list[Request]) -> bool:
        """Whether the steps measured so far say drafting pays: a drafting step yields
        1 + (expected accepted tokens) per sequence where a plain one yields 1, so it pays while
        its time per sequence is below that many plain steps' (on a CPU a step with drafts also
        runs eagerly where a plain decode runs its compiled program). Unmeasured: it does."""
        if not self._step_seconds[True] or not self._step_seconds[False]:
            return True
        drafting, plain = min(self._step_seconds[True]), min(self._step_seconds[False])
        rates = [self._acceptance.get(r, _Acceptance()).rate for r in candidates]
        expected = sum(rate * self._length(_Acceptance(rate)) for rate in rates) / len(rates)
        if drafting < plain * (1 + expected):
            return True
        self._since_probe += 1
        if self._since_probe >= PROBE_STEPS:
            self._since_probe = 0
            return True
        return False

    def observe_step(self, drafted: bool, num_sequences: int, seconds: float) -> None:
        """A step's measured time (the engine's), with or without drafts to verify."""
        if num_sequences <= 0 or seconds <= 0:
            return
        self._step_seconds[drafted].append(seconds / num_sequences)

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
        request.num_drafted_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        state = self._acceptance.setdefault(request, _Acceptance())
        state.rate += RATE_WEIGHT * (num_accepted / num_drafted - state.rate)
        if state.rate < LOW_RATE:
            state.paused = PAUSE_STEPS
            state.rate = 0.0  # back at one token, and paused again unless it is accepted
