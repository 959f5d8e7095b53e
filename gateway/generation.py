"""The gateway's text-level generation pipeline, shared by the HTTP routes and the gRPC API.

Token ids go to the engine; the tokenizer service turns the tokens that come back into text
(DetokenizeStream: whole UTF-8 characters, stop strings held back until they are certain). When
a stop string matches, the engine request is aborted and its abort awaited, so a finished
response never leaves work behind; when the caller goes away (the iterator is closed or
cancelled) it is aborted at once. Usage counts the tokens the text was made of. Business rules
that do not depend on the wire format live here too: the served model's name, context limits,
parameter validation (the engine library's own SamplingParams.validate, so both agree), n > 1
as one engine request with n samples (the prompt computed once) whose outputs are dealt out by
sample index, each sample with its own text pipeline. This module never parses HTTP and never
builds OpenAI or protobuf response shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.grpc_stubs.folio.v1 import common_pb2, engine_pb2
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as tok_pb2

from common.errors import InvalidParameter, ModelNotFound, UnavailableError
from common.finish_reason import finish_reason_from_proto
from common.sampling_params import SamplingParams
from common.sampling_proto import sampling_params_to_proto
from gateway.clients import EngineClient, EngineRequest, TokenizerClient
from gateway.metrics import Metrics

logger = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    name: str  # the served name: --served-model-name or the model directory's name
    path: str
    max_model_len: int
    vocab_size: int
    created: int
    max_num_seqs: int  # the most samples one engine request may have


@dataclass
class TextRequest:
    """One sequence to generate, validated and fitted to the context."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token decoded on its own
    logprob: float | None  # None for a prompt's first token: nothing precedes it
    top: list[tuple[int, str, float]]  # (token id, text, logprob), most likely first


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class TextDelta:
    """Text that became certain; the last delta of a sequence has finish_reason and usage."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    # On a sequence's first delta, when prompt logprobs were asked: one per prompt token.
    prompt_logprobs: list[TokenLogprob] | None = None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_token_ids(info: ModelInfo, token_ids: Sequence[int], param: str) -> None:
    """InvalidParameter naming `param` unless every id is in the model's vocabulary."""
    for token_id in token_ids:
        if not 0 <= token_id < info.vocab_size:
            raise InvalidParameter(
                f"{param} contains token id {token_id}, outside the "
                f"vocabulary [0, {info.vocab_size})",
                param,
            )


class Gateway:
    """The clients, the served model's facts, the metrics and the drain state."""

    def __init__(
        self,
        engine: EngineClient,
        tokenizer: TokenizerClient,
        metrics: Metrics,
        served_model_name: str | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.draining = False
        self._info: ModelInfo | None = None
        self._info_broken_streams = 0  # engine.broken_streams when _info was read
        self._token_texts: dict[int, str] = {}  # for logprobs; bounded by the vocabulary
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the model ----------------------------------------------------------------------------

    async def model(self) -> ModelInfo:
        """The served model (raises UnavailableError until the engine is up). Asked of the
        engine once, and again after the engine was lost: a restarted engine may differ."""
        broken_streams = self.engine.broken_streams
        if self._info is None or self._info_broken_streams != broken_streams:
            info = await self.engine.model_info()
            fresh = ModelInfo(
                name=self.served_model_name or info.model or Path(info.model_path).name,
                path=info.model_path,
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size,
                max_num_seqs=info.max_num_seqs,
                created=self._info.created if self._info else int(time.time()),
            )
            if self._info is not None and fresh != self._info:
                logger.warning(
                    "the engine came back with another model: %s, was %s", fresh, self._info
                )
                self._token_texts.clear()
            self._info, self._info_broken_streams = fresh, broken_streams
        return self._info

    async def check_model(self, name: str | None) -> ModelInfo:
        """The served model, if `name` is unset or names it; else ModelNotFound."""
        self.check_available()
        info = await self.model()
        if name and name != info.name:
            raise ModelNotFound(
                f"the model {name!r} does not exist; this server serves {info.name!r}", "model"
            )
        return info

    def check_available(self) -> None:
        if self.draining:
            raise UnavailableError("the gateway is draining; retry on another instance")

    # -- requests -----------------------------------------------------------------------------

    async def tokenize_text(
        self, text: str, add_special_tokens: bool = True, return_token_strs: bool = False
    ) -> tok_pb2.TokenizeResponse:
        return await self.tokenizer.tokenize(
            tok_pb2.TokenizeRequest(
                text=text,
                add_special_tokens=add_special_tokens,
                return_token_strs=return_token_strs,
            )
        )

    async def tokenize_chat(
        self,
        messages: Sequence[common_pb2.ChatMessage],
        add_generation_prompt: bool = True,
        return_token_strs: bool = False,
    ) -> tok_pb2.TokenizeResponse:
        return await self.tokenizer.tokenize(
            tok_pb2.TokenizeRequest(
                chat=tok_pb2.Conversation(messages=messages),
                add_generation_prompt=add_generation_prompt,
                return_token_strs=return_token_strs,
            )
        )

    def text_request(
        self,
        info: ModelInfo,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        priority: int = 0,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> TextRequest:
        """Validate a sequence against the model; unset max_tokens fills the context.

        Raises InvalidParameter naming the prompt, max_tokens or the sampling parameter.
        """
        if any(not s for s in stop):
            raise InvalidParameter("stop strings must not be empty", "stop")
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise InvalidParameter(f"{prompt_param} must not be empty", prompt_param)
        check_token_ids(info, prompt_ids, prompt_param)
        room = info.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidParameter(
                f"this model's maximum context length is {info.max_model_len} tokens, but "
                f"{prompt_param} has {len(prompt_ids)} tokens, which leaves no room to generate",
                prompt_param,
            )
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)
        elif isinstance(params.max_tokens, int) and params.max_tokens > room:
            raise InvalidParameter(
                f"{max_tokens_param} is {params.max_tokens}, but {prompt_param} has "
                f"{len(prompt_ids)} tokens and this model's maximum context length is "
                f"{info.max_model_len} tokens: {max_tokens_param} must be at most {room}",
                max_tokens_param,
            )
        try:
            params.validate(info.vocab_size)
        except ValueError as exc:
            # The library's messages start with the parameter's name.
            raise InvalidParameter(str(exc), str(exc).split(" ", 1)[0].split("[", 1)[0]) from None
        if params.n != 1:  # choices are separate TextRequests; generate_many regroups them
            raise InvalidParameter(f"n must be 1 here (one sequence per call), got {params.n}", "n")
        return TextRequest(
            prompt_ids,
            params,
            list(stop),
            include_stop_str_in_output,
            skip_special_tokens,
            priority,
        )

    @staticmethod
    def with_seed_offset(params: SamplingParams, index: int) -> SamplingParams:
        """Choice `index` of n: its own seed (seed + index, as the engine derives its samples'
        seeds), so seeded choices differ."""
        return dataclasses.replace(params, seed=params.sample_seed(index))

    # -- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        request: TextRequest,
        request_id: str,
        arrival: float,
        sample: _SampleOutputs | None = None,
    ) -> AsyncIterator[TextDelta]:
        """Stream one sequence's text. Closing the iterator early aborts the engine request.
        With `sample`, the sequence is that sample of an n > 1 engine request generate_many
        opened, instead of an engine request of its own."""
        self.check_available()
        engine_request = sample or self.engine.generate(
            request_id,
            request.prompt_ids,
            sampling_params_to_proto(request.params),
            request.priority,
        )
        # The samples of one engine request share one prefill.
        num_prefilled = len(request.prompt_ids) if sample is None or sample.index == 0 else 0
        detokenizer = self.tokenizer.detokenize_stream(
            tok_pb2.DetokenizeOptions(
                stop=request.stop,
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
            )
        )
        self._enter()
        num_tokens = 0
        last_token_at: float | None = None
        prompt_logprobs_due = request.params.prompt_logprobs is not None
        try:
            detokenizer.open()  # while the engine computes the prompt
            while True:
                output = await engine_request.next()
                if output.token_ids:
                    last_token_at = self._observe_tokens(
                        len(output.token_ids), arrival, last_token_at, num_prefilled
                    )
                    num_tokens += len(output.token_ids)
                text = await detokenizer.push(output.token_ids, finish=output.finished)
                logprobs = await self._text_logprobs(output.logprobs) if output.logprobs else []
                prompt_logprobs = None
                if prompt_logprobs_due:  # the engine sends them with the first output
                    prompt_logprobs_due = False
                    prompt_logprobs = await self._text_logprobs(
                        output.prompt_logprobs, first_prompt_token=request.prompt_ids[0]
                    )
                if text.stop_matched:
                    final, reason = await engine_request.abort() or output, "stop"
                elif output.finished:
                    final, reason = output, finish_reason_from_proto(output.finish_reason)
                else:
                    if text.text or logprobs or prompt_logprobs:
                        yield TextDelta(text.text, logprobs, prompt_logprobs=prompt_logprobs)
                    continue
                self._observe_end(arrival, final.queue_seconds, reason)
                usage = Usage(len(request.prompt_ids), num_tokens, final.usage.cached_tokens)
                yield TextDelta(text.text, logprobs, reason, usage, prompt_logprobs)
                return
        finally:
            engine_request.close()
            detokenizer.close()
            self._leave()

    async def generate_many(
        self, requests: Sequence[TextRequest], request_id: str, arrival: float
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """Run sequences side by side (n > 1, several prompts); yields (index, delta) as they
        come. The choices of one prompt (consecutive requests equal but for the seeds
        with_seed_offset gives them) go to the engine as one request with n samples. The first
        failure ends them all; closing the iterator aborts what still runs."""
        if len(requests) == 1:  # the common case needs no tasks
            async for delta in self.generate(requests[0], request_id, arrival):
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, texts: AsyncIterator[TextDelta]) -> None:
            try:
                async for delta in texts:
                    queue.put_nowait((index, delta))
            except Exception as exc:
                queue.put_nowait((index, exc))
            else:
                queue.put_nowait((index, done))

        groups: list[_SampleGroup] = []
        tasks: list[asyncio.Task] = []
        try:
            max_n = min(SamplingParams.MAX_N, (await self.model()).max_num_seqs)
            for first, count in self._choice_runs(requests, max_n):
                engine_id = f"{request_id}-{first}"
                if count == 1:
                    texts = [self.generate(requests[first], engine_id, arrival)]
                else:
                    self.check_available()
                    params = dataclasses.replace(requests[first].params, n=count)
                    group = _SampleGroup(
                        self.engine.generate(
                            engine_id,
                            requests[first].prompt_ids,
                            sampling_params_to_proto(params),
                            requests[first].priority,
                        ),
                        count,
                    )
                    groups.append(group)
                    texts = [
                        self.generate(requests[first + i], engine_id, arrival, sample)
                        for i, sample in enumerate(group.samples)
                    ]
                tasks += [asyncio.create_task(pump(first + i, t)) for i, t in enumerate(texts)]
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for group in groups:
                group.close()

    def _choice_runs(self, requests: Sequence[TextRequest], max_n: int) -> list[tuple[int, int]]:
        """(first index, count): runs of at most max_n consecutive requests that are choices of
        one prompt, equal to the run's first but for the seed with_seed_offset derives."""
        runs = []
        first = 0
        while first < len(requests):
            count = 1
            while (
                first + count < len(requests)
                and count < max_n
                and requests[first + count]
                == dataclasses.replace(
                    requests[first], params=self.with_seed_offset(requests[first].params, count)
                )
            ):
                count += 1
            runs.append((first, count))
            first += count
        return runs

    async def _text_logprobs(
        self, logprobs: Sequence[common_pb2.TokenLogprob], first_prompt_token: int | None = None
    ) -> list[TokenLogprob]:
        """The records with token texts; a prompt's first token, when given, leads them with no
        logprob (the engine sends none for it)."""
        ids = {lp.token_id for lp in logprobs} | {
            t.token_id for lp in logprobs for t in lp.top_logprobs
        }
        if first_prompt_token is not None:
            ids.add(first_prompt_token)
        missing = [i for i in ids if i not in self._token_texts]
        if missing:
            # Special tokens keep their text here: a logprob for "<|im_end|>" must say so.
            response = await self.tokenizer.detokenize(
                tok_pb2.DetokenizeRequest(
                    token_ids=missing, skip_special_tokens=False, return_token_texts=True
                )
            )
            self._token_texts.update(zip(missing, response.token_texts, strict=False))
        texts = self._token_texts
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
                [(t.token_id, texts[t.token_id], t.logprob) for t in lp.top_logprobs],
            )
            for lp in logprobs
        ]

    # -- metrics and drain --------------------------------------------------------------------

    def _observe_tokens(
        self, count: int, arrival: float, last_token_at: float | None, num_prompt_tokens: int
    ) -> float:
        now = time.monotonic()
        if last_token_at is None:
            self.metrics.ttft.observe(now - arrival)
            self.metrics.prompt_tokens.inc(num_prompt_tokens)
        else:
            self.metrics.itl.observe((now - last_token_at) / count)
        self.metrics.generation_tokens.inc(count)
        return now

    def _observe_end(self, arrival: float, queue_seconds: float, reason: str) -> None:
        self.metrics.e2e.observe(time.monotonic() - arrival)
        self.metrics.queue_time.observe(queue_seconds)
        self.metrics.request_finished(reason)

    def _enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new work; wait up to `timeout` s for the sequences in flight; True if none
        is left."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


class _SampleOutputs:
    """Sample `index` of an n > 1 engine request, read like an engine request of its own (next,
    abort, close) from its share of the request's outputs."""

    def __init__(self, engine_request: EngineRequest, index: int) -> None:
        self.index = index
        self._engine_request = engine_request
        self.outputs: asyncio.Queue[engine_pb2.RequestOutput | Exception] = asyncio.Queue()
        self.done = False

    async def next(self) -> engine_pb2.RequestOutput:
        """The sample's next output; raises the request's error if it failed."""
        item = await self.outputs.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        self.done = item.finished
        return item

    async def abort(self) -> engine_pb2.RequestOutput | None:
        """Abort this sample alone and wait for its last output; None if it had ended."""
        if self.done:
            return None
        self._engine_request.abort_sample(self.index)
        while not (last := await self.next()).finished:
            pass
        return last

    def close(self) -> None:
        """Stop listening; a sample still live is aborted without waiting."""
        if not self.done:
            self.done = True
            self._engine_request.abort_sample(self.index)


class _SampleGroup:
    """One engine request with n > 1 samples, its outputs dealt out by index to one
    _SampleOutputs per sample; a failure of the request fails every sample."""

    def __init__(self, engine_request: EngineRequest, n: int) -> None:
        self._engine_request = engine_request
        self.samples = [_SampleOutputs(engine_request, i) for i in range(n)]
        self._dealer = asyncio.create_task(self._deal())

    async def _deal(self) -> None:
        try:
            while not self._engine_request.done:
                output = await self._engine_request.next()
                self.samples[output.index].outputs.put_nowait(output)
        except Exception as exc:
            for sample in self.samples:
                sample.outputs.put_nowait(exc)

    def close(self) -> None:
        """Stop dealing; samples still live are aborted without waiting."""
        self._dealer.cancel()
        self._engine_request.close()
