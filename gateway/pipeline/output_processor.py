"""The gateway's token path: one output processor per engine replica (its session's, which
reads the replica's Generate stream) turns each engine step's token ids into every sequence's
text.

Per GenerateResponse (one engine step) it turns each sequence's new tokens into text in this
process (gateway/pipeline/model_text.py: an incremental detokenizer per sequence, with its stop
strings), hands each caller its TextDelta, and aborts the sequences whose stop string matched in
one batched Abort. A sequence that stopped gets its last delta (finish reason "stop") only once
the engine has confirmed the abort, so a finished answer never leaves work behind. The `n`
samples of a request are one engine request; their outputs are told apart by index. An
embedding request's one output (its vector) goes to its caller at once: it has no text. It
counts the request-level metrics as tokens pass.

It never validates a request, never opens a connection of its own and never builds an OpenAI or
protobuf answer shape: the model's text and the abort sink are handed to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from common.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from common.errors import InternalError, error_for
from gateway.messages import StepOutput
from gateway.metrics import Metrics
from gateway.pipeline.model_text import ModelText
from gateway.pipeline.text import TextDelta, TextRequest, Usage

logger = logging.getLogger(__name__)


class OutputProcessingError(InternalError):
    """A bug processing an engine's outputs (the gateway's own): its traceback is logged once,
    where it happened, and each request it failed carries this error."""


# Aborts, in one message: whole requests by id, and single samples as (request id, index).
AbortSink = Callable[[list[str], list[tuple[str, int]]], None]

# What a caller reads: (choice index, delta), or the error that ended its call.
ChoiceItem = tuple[int, TextDelta] | Exception

# Offered each request a broken engine stream had not started: True if it runs elsewhere now.
RetryHook = Callable[["TrackedRequest"], bool]


@dataclass(eq=False)
class _Sequence:
    """One sample of a tracked request: its text so far and its counts."""

    index: int  # the sample's index in the engine request
    choice: int  # its index among the caller's choices
    # Made with its first output: its text has started.
    detokenizer: IncrementalDetokenizer | None = None
    prompt_logprobs_due: bool = False  # asked for: they come with its first output
    num_tokens: int = 0
    last_token_at: float | None = None
    # Its stop string matched: the last delta, sent once the engine confirms the abort.
    stopped: TextDelta | None = None
    done: bool = False


@dataclass(eq=False)
class TrackedRequest:
    """One engine request, the model text its tokens become, and where its choices' deltas
    go."""

    request_id: str
    text: TextRequest
    n: int  # samples in this engine request
    first_choice: int  # the caller's choice index of sample 0
    arrival: float  # time.monotonic() at the gateway
    deltas: asyncio.Queue[ChoiceItem]
    model_text: ModelText
    sequences: list[_Sequence] = field(init=False)

    def __post_init__(self) -> None:
        prompt_logprobs = self.text.params.prompt_logprobs is not None
        self.sequences = [
            _Sequence(i, self.first_choice + i, prompt_logprobs_due=prompt_logprobs)
            for i in range(self.n)
        ]

    @property
    def live(self) -> list[_Sequence]:
        return [s for s in self.sequences if not s.done]

    @property
    def started(self) -> bool:
        """Some of its tokens became text, or a choice ended: it can no longer run anew."""
        return any(s.detokenizer is not None or s.done for s in self.sequences)


class OutputProcessor:
    """The requests on one replica's Generate stream: process_outputs per engine step, fail_all
    when the stream ends, release when a caller stops listening."""

    def __init__(
        self,
        abort: AbortSink,
        metrics: Metrics,
        retry: RetryHook | None = None,
    ) -> None:
        self._retry = retry
        self._abort = abort
        self._metrics = metrics
        self._requests: dict[str, TrackedRequest] = {}

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

    def process_outputs(self, outputs: Sequence[StepOutput]) -> None:
        """One engine step: each output's text, each caller its delta, and one Abort for the
        stop strings that matched. A failure here is the gateway's own (a bug): it is logged,
        the step's requests fail with an InternalError and are aborted, and the stream goes on
        for the others (the engine did nothing wrong)."""
        try:
            self._process(outputs)
        except Exception as exc:
            logger.exception("processing an engine step failed; its requests fail")
            step = {output.request_id for output in outputs}
            self._fail(
                [r for r in self._requests.values() if r.request_id in step],
                OutputProcessingError(f"processing the engine's outputs failed: {exc}"),
                True,
            )

    def _process(self, outputs: Sequence[StepOutput]) -> None:
        now = time.monotonic()  # the step's tokens all arrived now
        step_tokens = 0
        aborted_requests: list[str] = []
        aborted_samples: list[tuple[str, int]] = []
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
            try:
                delta, count = self._text(request, sequence, output)
            except ValueError as exc:  # an id outside the vocabulary
                self._fail([request], InternalError(f"detokenizing: {exc}"), True)
                continue
            if count:
                self._observe_tokens(request, sequence, count, now)
                step_tokens += count
            delta.completion_tokens = sequence.num_tokens
            if delta.stop_matched:
                delta.finish_reason = "stop"
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
        if step_tokens:  # one counter update per step, not one per sequence
            self._metrics.generation_tokens.inc(step_tokens)
        if aborted_requests or aborted_samples:
            self._abort(aborted_requests, aborted_samples)

    @staticmethod
    def _text(
        request: TrackedRequest, sequence: _Sequence, output: StepOutput
    ) -> tuple[TextDelta, int]:
        """The text the output makes certain, with its logprobs (and the prompt's, with a
        sequence's first output when asked), and how many of its tokens are the sequence's;
        ValueError names an id outside the vocabulary."""
        model_text = request.model_text
        if (bad := model_text.bad_token_id(output.token_ids)) is not None:
            raise ValueError(bad)
        if sequence.detokenizer is None:
            sequence.detokenizer = model_text.detokenizer(request.text)
        tokens = list(output.token_ids)
        if len(tokens) > 1 and request.text.stop:
            text, tokens = _advance_to_stop(sequence.detokenizer, tokens, output.finished)
        else:
            text = sequence.detokenizer.advance(tokens, output.finished)
        delta = TextDelta(
            text.text,
            model_text.logprobs(output.logprobs[: len(tokens)]) if output.logprobs else [],
            stop_matched=text.stop_matched,
        )
        if sequence.prompt_logprobs_due:  # the engine sends them with its first output
            sequence.prompt_logprobs_due = False
            delta.prompt_logprobs = model_text.logprobs(
                output.prompt_logprobs, request.text.prompt_ids[0]
            )
        return delta, len(tokens)

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
            for sequence in request.live:
                sequence.done = True
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


def _advance_to_stop(
    detokenizer: IncrementalDetokenizer, tokens: list[int], finish: bool
) -> tuple[DetokenizerDelta, list[int]]:
    """Several tokens of one step (accepted speculative drafts) pushed one at a time: the text,
    and the tokens up to the one that completed a stop string, so that the text, logprobs and
    token count end where they end when the tokens come one per step."""
    text = ""
    for i, token in enumerate(tokens):
        delta = detokenizer.advance([token], finish and i == len(tokens) - 1)
        text += delta.text
        if delta.stop_matched is not None:
            return DetokenizerDelta(text, delta.stop_matched), tokens[: i + 1]
    return DetokenizerDelta(text), tokens
