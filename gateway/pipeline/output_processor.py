"""The gateway's token path: one output processor per engine replica (its session's, which
reads the replica's Generate stream) turns each engine step's token ids into every sequence's
text.

Per GenerateResponse (one engine step) it sends one message on the tokenizer's multiplexed
DetokenizeSequences stream, with an entry for each sequence that advanced (the logprob texts it
does not know yet ride along), reads the one answer, hands each caller its TextDelta, and aborts
the sequences whose stop string matched in one batched Abort. A sequence that stopped gets its
last delta (finish reason "stop") only once the engine has confirmed the abort, so a finished
answer never leaves work behind. The `n` samples of a request are one engine request; their
outputs are told apart by index. An embedding request's one output (its vector) goes to its
caller at once: it has no text. It counts the request-level metrics as tokens pass.

It never validates a request, never opens a connection of its own and never builds an OpenAI or
protobuf answer shape: the detokenizer and the abort sink are handed to it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.errors import FolioError, InternalError, error_for
from gateway.messages import (
    DetokenizeOptions,
    DetokenizeSequences,
    Logprob,
    SequenceText,
    SequenceTexts,
    SequenceTokens,
    StepOutput,
)
from gateway.metrics import Metrics
from gateway.pipeline.text import TextDelta, TextRequest, TokenLogprob, Usage

logger = logging.getLogger(__name__)


class OutputProcessingError(InternalError):
    """A bug processing an engine's outputs (the gateway's own): its traceback is logged once,
    where it happened, and each request it failed carries this error."""


# Sequence ids on the tokenizer's stream: unique for the life of the gateway process.
_sequence_ids = itertools.count(1)


class Detokenizer(Protocol):
    """The tokenizer's DetokenizeSequences stream: one answer per message, in order."""

    async def exchange(self, message: DetokenizeSequences) -> SequenceTexts: ...


# Aborts, in one message: whole requests by id, and single samples as (request id, index).
AbortSink = Callable[[list[str], list[tuple[str, int]]], None]

# What a caller reads: (choice index, delta), or the error that ended its call.
ChoiceItem = tuple[int, TextDelta] | Exception

# Offered each request a broken engine stream had not started: True if it runs elsewhere now.
RetryHook = Callable[["TrackedRequest"], bool]


class TokenTexts:
    """Each token id's text on its own (special tokens kept), as logprobs show it; learnt from
    the tokenizer and kept for the gateway's life (bounded by the vocabulary)."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    def missing(self, token_ids: Iterable[int]) -> set[int]:
        return {i for i in token_ids if i not in self._texts}

    def learn(self, token_ids: Sequence[int], texts: Sequence[str]) -> None:
        self._texts.update(zip(token_ids, texts, strict=True))

    def clear(self) -> None:
        self._texts.clear()

    def logprobs(
        self, records: Sequence[Logprob], first_prompt_token: int | None = None
    ) -> list[TokenLogprob]:
        """The records with token texts; a prompt's first token, when given, leads them with no
        logprob (the engine sends none for it)."""
        texts = self._texts
        first = (
            []
            if first_prompt_token is None
            else [TokenLogprob(first_prompt_token, texts[first_prompt_token], None, [])]
        )
        return first + [
            TokenLogprob(
                lp.token_id,
                texts[lp.token_id],
                lp.logprob,
                [(token_id, texts[token_id], logprob) for token_id, logprob in lp.top],
            )
            for lp in records
        ]


def _logprob_ids(records: Sequence[Logprob]) -> Iterable[int]:
    for lp in records:
        yield lp.token_id
        for token_id, _ in lp.top:
            yield token_id


@dataclass(eq=False)
class _Sequence:
    """One sample of a tracked request: its text on the tokenizer's stream and its counts."""

    index: int  # the sample's index in the engine request
    choice: int  # its index among the caller's choices
    sequence_id: int = field(default_factory=lambda: next(_sequence_ids))
    opened: bool = False  # its options went to the tokenizer
    prompt_logprobs_due: bool = False  # asked for: they come with its first output
    num_tokens: int = 0
    last_token_at: float | None = None
    # Its stop string matched: the last delta, sent once the engine confirms the abort.
    stopped: TextDelta | None = None
    done: bool = False


@dataclass(eq=False)
class TrackedRequest:
    """One engine request and where its choices' deltas go."""

    request_id: str
    text: TextRequest
    n: int  # samples in this engine request
    first_choice: int  # the caller's choice index of sample 0
    arrival: float  # time.monotonic() at the gateway
    deltas: asyncio.Queue[ChoiceItem]
    sequences: list[_Sequence] = field(init=False)
    options: DetokenizeOptions = field(init=False)

    def __post_init__(self) -> None:
        prompt_logprobs = self.text.params.prompt_logprobs is not None
        self.sequences = [
            _Sequence(i, self.first_choice + i, prompt_logprobs_due=prompt_logprobs)
            for i in range(self.n)
        ]
        self.options = DetokenizeOptions(
            stop=tuple(self.text.stop),
            include_stop_str_in_output=self.text.include_stop_str_in_output,
            skip_special_tokens=self.text.skip_special_tokens,
        )

    @property
    def live(self) -> list[_Sequence]:
        return [s for s in self.sequences if not s.done]

    @property
    def started(self) -> bool:
        """Something of it reached the tokenizer or its caller: it can no longer run anew."""
        return any(s.opened or s.done for s in self.sequences)


@dataclass
class _Step:
    """One engine output waiting for its text."""

    request: TrackedRequest
    sequence: _Sequence
    output: StepOutput
    first_prompt_token: int | None  # set when this output carries the prompt's logprobs


class OutputProcessor:
    """The requests on one replica's Generate stream: process_outputs per engine step, fail_all
    when the stream ends, release when a caller stops listening."""

    def __init__(
        self,
        detokenizer: Detokenizer,
        abort: AbortSink,
        metrics: Metrics,
        token_texts: TokenTexts,
        retry: RetryHook | None = None,
    ) -> None:
        self._detokenizer = detokenizer
        self._retry = retry
        self._abort = abort
        self._metrics = metrics
        self._token_texts = token_texts
        self._requests: dict[str, TrackedRequest] = {}
        self._released_sequences: list[int] = []  # told to the tokenizer with the next message

    def add(self, request: TrackedRequest) -> None:
        self._requests[request.request_id] = request

    def __len__(self) -> int:
        return len(self._requests)

    def release(self, requests: Iterable[TrackedRequest]) -> None:
        """The callers stopped listening: abort what still runs (one message), forget them."""
        aborted = []
        for request in requests:
            if self._requests.pop(request.request_id, None) is None:
                continue
            live = request.live
            if live:
                aborted.append(request.request_id)
            self._released_sequences += [s.sequence_id for s in live if s.opened]
            for sequence in live:
                sequence.done = True
        if aborted:
            self._abort(aborted, [])

    def fail_all(self, error: Exception) -> None:
        """The engine stream ended: every request it carried fails with `error`, except those
        not started yet that the retry hook placed elsewhere."""
        for request in self._requests.values():
            if self._retry is None or request.started or not self._retry(request):
                request.deltas.put_nowait(error)
        self._requests.clear()

    async def process_outputs(self, outputs: Sequence[StepOutput]) -> None:
        """One engine step: every output's text in one tokenizer round trip, then each caller
        its delta and one Abort for the stop strings that matched. A failure here is the
        gateway's own (a bug): it is logged, the step's requests fail with an InternalError and
        are aborted, and the stream goes on for the others (the engine did nothing wrong)."""
        try:
            await self._process(outputs)
        except Exception as exc:
            logger.exception("processing an engine step failed; its requests fail")
            step = {output.request_id for output in outputs}
            self._fail(
                [r for r in self._requests.values() if r.request_id in step],
                OutputProcessingError(f"processing the engine's outputs failed: {exc}"),
                True,
            )

    async def _process(self, outputs: Sequence[StepOutput]) -> None:
        message = DetokenizeSequences()
        entries = message.sequences
        steps: list[_Step] = []
        text_ids: set[int] = set()
        now = time.monotonic()  # the step's tokens all arrived now
        step_tokens = 0
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:  # already let go (aborted, the caller left)
                continue
            if output.error is not None:  # it ended in the engine: nothing to abort
                error = output.error
                self._fail(
                    [request],
                    error_for(error.code, error.message, error.param, error.retry_after),
                    False,
                )
                continue
            sequence = request.sequences[output.index]
            if sequence.done:
                continue
            if output.embedding is not None:
                self._metrics.prompt_tokens.inc(len(request.text.prompt_ids))
                self._finish(
                    request,
                    sequence,
                    TextDelta("", finish_reason=output.finish_reason, embedding=output.embedding),
                    output,
                )
                continue
            if sequence.stopped is not None:  # the abort's confirmation, or its own end
                if output.finished:
                    self._finish(request, sequence, sequence.stopped, output)
                continue
            token_ids = output.token_ids
            if token_ids:
                count = len(token_ids)
                self._observe_tokens(request, sequence, count, now)
                step_tokens += count
            entry = SequenceTokens(sequence.sequence_id, token_ids, output.finished)
            if not sequence.opened:
                entry.options = request.options
                sequence.opened = True
            entries.append(entry)
            if output.logprobs:
                text_ids.update(_logprob_ids(output.logprobs))
            first_prompt_token = None
            if sequence.prompt_logprobs_due:  # the engine sends them with its first output
                sequence.prompt_logprobs_due = False
                first_prompt_token = request.text.prompt_ids[0]
                text_ids.update(_logprob_ids(output.prompt_logprobs))
                text_ids.add(first_prompt_token)
            steps.append(_Step(request, sequence, output, first_prompt_token))
        if step_tokens:  # one counter update per step, not one per sequence
            self._metrics.generation_tokens.inc(step_tokens)
        if not steps:
            return
        missing = sorted(self._token_texts.missing(text_ids)) if text_ids else []
        message.token_text_ids = missing
        message.released_sequence_ids = self._released_sequences
        self._released_sequences = []
        try:
            answer = await self._detokenizer.exchange(message)
        except FolioError as exc:
            # The tokenizer's stream is gone, and with it the text state of every sequence.
            lost = [r for r in self._requests.values() if any(s.opened for s in r.live)]
            self._fail(lost, exc, True)
            return
        if missing:
            self._token_texts.learn(missing, answer.token_texts)
        self._deliver(steps, answer.sequences)

    def _deliver(self, steps: Sequence[_Step], texts: Sequence[SequenceText]) -> None:
        aborted_requests: list[str] = []
        aborted_samples: list[tuple[str, int]] = []
        for step, text in zip(steps, texts, strict=True):
            request, sequence, output = step.request, step.sequence, step.output
            if sequence.done or self._requests.get(request.request_id) is not request:
                continue  # released or failed while the tokenizer answered
            if text.error:
                self._fail([request], InternalError(f"tokenizer: {text.error}"), True)
                continue
            delta = TextDelta(
                text.text,
                self._token_texts.logprobs(output.logprobs) if output.logprobs else [],
            )
            if step.first_prompt_token is not None:
                delta.prompt_logprobs = self._token_texts.logprobs(
                    output.prompt_logprobs, step.first_prompt_token
                )
            if text.stop_matched:
                delta.finish_reason = "stop"
                delta.stop_matched = text.stop_matched
                if output.finished:
                    self._finish(request, sequence, delta, output)
                else:
                    sequence.stopped = delta
                    if request.n == 1:
                        aborted_requests.append(request.request_id)
                    else:
                        aborted_samples.append((request.request_id, sequence.index))
            elif output.finished:
                delta.finish_reason = output.finish_reason
                self._finish(request, sequence, delta, output)
            elif delta.text or delta.logprobs or delta.prompt_logprobs:
                request.deltas.put_nowait((sequence.choice, delta))
        if aborted_requests or aborted_samples:
            self._abort(aborted_requests, aborted_samples)

    def _finish(
        self,
        request: TrackedRequest,
        sequence: _Sequence,
        delta: TextDelta,
        last: StepOutput,
    ) -> None:
        """The sequence's last delta: its finish reason and usage (the tokens its text was
        made of); the request is forgotten once each of its samples has ended."""
        assert delta.finish_reason is not None
        sequence.done = True
        delta.usage = Usage(
            len(request.text.prompt_ids),
            sequence.num_tokens,
            last.cached_tokens,
            last.draft_tokens,
            last.accepted_draft_tokens,
        )
        self._metrics.e2e.observe(time.monotonic() - request.arrival)
        self._metrics.queue_time.observe(last.queue_seconds)
        self._metrics.request_finished(delta.finish_reason)
        request.deltas.put_nowait((sequence.choice, delta))
        if not request.live:
            self._requests.pop(request.request_id, None)

    def _fail(self, requests: Sequence[TrackedRequest], error: Exception, abort: bool) -> None:
        """The requests failed: their callers get the error; with `abort`, what still runs of
        them is aborted (one message)."""
        failed = [r for r in requests if self._requests.get(r.request_id) is r]
        for request in failed:
            del self._requests[request.request_id]
            live = request.live
            for sequence in live:
                sequence.done = True
            self._released_sequences += [s.sequence_id for s in live if s.opened]
            request.deltas.put_nowait(error)
        if abort and failed:
            self._abort([r.request_id for r in failed], [])

    def _observe_tokens(
        self, request: TrackedRequest, sequence: _Sequence, count: int, now: float
    ) -> None:
        """A sequence's `count` new tokens, arrived at `now`: TTFT or ITL (the step's tokens
        are counted once for the step, by process_outputs)."""
        if sequence.last_token_at is None:
            self._metrics.ttft.observe(now - request.arrival)
            if sequence.index == 0:  # the samples of one request share one prefill
                self._metrics.prompt_tokens.inc(len(request.text.prompt_ids))
        else:
            self._metrics.itl.observe((now - sequence.last_token_at) / count)
        sequence.last_token_at = now
        sequence.num_tokens += count
