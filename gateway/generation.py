"""The gateway's text-level generation pipeline, shared by the HTTP routes and the gRPC API.

Token ids go to the engine; the tokenizer service turns the tokens that come back into text
(DetokenizeStream: whole UTF-8 characters, stop strings held back until they are certain). When
a stop string matches, the engine request is aborted and its abort awaited, so a finished
response never leaves work behind; when the caller goes away (the iterator is closed or
cancelled) it is aborted at once. Usage counts the tokens the text was made of. Business rules
that do not depend on the wire format live here too: the served model's name, context limits,
parameter validation (the engine library's own SamplingParams.validate, so both agree), n > 1
as n engine requests. This module never parses HTTP and never builds OpenAI or protobuf
response shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import UnavailableError
from common.grpc_stubs.folio.v1 import common_pb2
from common.grpc_stubs.folio.v1 import tokenizer_pb2 as tok_pb2
from engine.sampling_params import SamplingParams
from common.sampling_proto import sampling_params_to_proto
from gateway.clients import EngineClient, TokenizerClient
from gateway.metrics import Metrics
from gateway.protocol import InvalidParameter, ModelNotFound

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
SEED_MASK = (1 << 63) - 1  # seeds travel as int64


@dataclass
class ModelInfo:
    name: str  # the served name: --served-model-name or the model directory's name
    path: str
    max_model_len: int
    vocab_size: int
    created: int


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
    logprob: float
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


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Gateway:
    """The clients, the served model's facts, the metrics and the drain state."""

    def __init__(self, engine: EngineClient, tokenizer: TokenizerClient, metrics: Metrics,
                 served_model_name: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.draining = False
        self._info: ModelInfo | None = None
        self._token_texts: dict[int, str] = {}  # for logprobs; bounded by the vocabulary
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the model ----------------------------------------------------------------------------

    async def model(self) -> ModelInfo:
        """The served model (asked of the engine once; raises UnavailableError until it is up)."""
        if self._info is None:
            info = await self.engine.model_info()
            self._info = ModelInfo(
                name=self.served_model_name or info.model or Path(info.model_path).name,
                path=info.model_path,
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size,
                created=int(time.time()),
            )
        return self._info

    async def check_model(self, name: str | None) -> ModelInfo:
        """The served model, if `name` is unset or names it; else ModelNotFound."""
        self.check_available()
        info = await self.model()
        if name and name != info.name:
            raise ModelNotFound(f"the model {name!r} does not exist; this server serves "
                                f"{info.name!r}", "model")
        return info

    def check_available(self) -> None:
        if self.draining:
            raise UnavailableError("the gateway is draining; retry on another instance")

    # -- requests -----------------------------------------------------------------------------

    async def tokenize_text(self, text: str, add_special_tokens: bool = True,
                            return_token_strs: bool = False) -> tok_pb2.TokenizeResponse:
        return await self.tokenizer.tokenize(tok_pb2.TokenizeRequest(
            text=text, add_special_tokens=add_special_tokens, return_token_strs=return_token_strs))

    async def tokenize_chat(self, messages: Sequence[common_pb2.ChatMessage],
                            add_generation_prompt: bool = True,
                            return_token_strs: bool = False) -> tok_pb2.TokenizeResponse:
        return await self.tokenizer.tokenize(tok_pb2.TokenizeRequest(
            chat=tok_pb2.Conversation(messages=messages),
            add_generation_prompt=add_generation_prompt, return_token_strs=return_token_strs))

    def text_request(self, info: ModelInfo, prompt_ids: Sequence[int], params: SamplingParams,
                     *, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                     skip_special_tokens: bool = True, priority: int = 0,
                     prompt_param: str = "prompt", max_tokens_param: str = "max_tokens",
                     ) -> TextRequest:
        """Validate a sequence against the model; unset max_tokens fills the context.

        Raises InvalidParameter naming the prompt, max_tokens or the sampling parameter.
        """
        if any(not s for s in stop):
            raise InvalidParameter("stop strings must not be empty", "stop")
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise InvalidParameter(f"{prompt_param} must not be empty", prompt_param)
        for token_id in prompt_ids:
            if not 0 <= token_id < info.vocab_size:
                raise InvalidParameter(f"{prompt_param} contains token id {token_id}, outside "
                                       f"the vocabulary [0, {info.vocab_size})", prompt_param)
        room = info.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidParameter(
                f"this model's maximum context length is {info.max_model_len} tokens, but "
                f"{prompt_param} has {len(prompt_ids)} tokens, which leaves no room to generate",
                prompt_param)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)
        elif isinstance(params.max_tokens, int) and params.max_tokens > room:
            raise InvalidParameter(
                f"{max_tokens_param} is {params.max_tokens}, but {prompt_param} has "
                f"{len(prompt_ids)} tokens and this model's maximum context length is "
                f"{info.max_model_len} tokens: {max_tokens_param} must be at most {room}",
                max_tokens_param)
        try:
            params.validate(info.vocab_size)
        except ValueError as exc:
            # The library's messages start with the parameter's name.
            raise InvalidParameter(str(exc), str(exc).split(" ", 1)[0].split("[", 1)[0]) from None
        return TextRequest(prompt_ids, params, list(stop), include_stop_str_in_output,
                           skip_special_tokens, priority)

    @staticmethod
    def with_seed_offset(params: SamplingParams, index: int) -> SamplingParams:
        """Choice `index` of n: its own seed (seed + index), so seeded choices differ."""
        if params.seed is None or index == 0:
            return params
        return dataclasses.replace(params, seed=(params.seed + index) & SEED_MASK)

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, request: TextRequest, request_id: str,
                       arrival: float) -> AsyncIterator[TextDelta]:
        """Stream one sequence's text. Closing the iterator early aborts the engine request."""
        self.check_available()
        engine_request = self.engine.generate(
            request_id, request.prompt_ids, sampling_params_to_proto(request.params),
            request.priority)
        detokenizer = self.tokenizer.detokenize_stream(tok_pb2.DetokenizeOptions(
            stop=request.stop, include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens))
        self._enter()
        num_tokens = 0
        last_token_at: float | None = None
        try:
            while True:
                output = await engine_request.next()
                if output.token_ids:
                    last_token_at = self._observe_tokens(len(output.token_ids), arrival,
                                                         last_token_at, len(request.prompt_ids))
                    num_tokens += len(output.token_ids)
                text = await detokenizer.push(output.token_ids, finish=output.finished)
                logprobs = await self._text_logprobs(output.logprobs) if output.logprobs else []
                if text.stop_matched:
                    final, reason = await engine_request.abort() or output, "stop"
                elif output.finished:
                    final, reason = output, FINISH_REASONS[output.finish_reason]
                else:
                    if text.text or logprobs:
                        yield TextDelta(text.text, logprobs)
                    continue
                self._observe_end(arrival, final.queue_seconds, reason)
                usage = Usage(len(request.prompt_ids), num_tokens, final.usage.cached_tokens)
                yield TextDelta(text.text, logprobs, reason, usage)
                return
        finally:
            engine_request.close()
            detokenizer.close()
            self._leave()

    async def generate_many(self, requests: Sequence[TextRequest], request_id: str,
                            arrival: float) -> AsyncIterator[tuple[int, TextDelta]]:
        """Run sequences side by side (n > 1, several prompts); yields (index, delta) as they
        come. The first failure ends them all; closing the iterator aborts what still runs."""
        if len(requests) == 1:  # the common case needs no tasks
            async for delta in self.generate(requests[0], request_id, arrival):
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, request: TextRequest) -> None:
            try:
                async for delta in self.generate(request, f"{request_id}-{index}", arrival):
                    queue.put_nowait((index, delta))
            except Exception as exc:
                queue.put_nowait((index, exc))
            else:
                queue.put_nowait((index, done))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
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

    async def _text_logprobs(self, logprobs: Sequence[common_pb2.TokenLogprob]
                             ) -> list[TokenLogprob]:
        ids = {lp.token_id for lp in logprobs} | {t.token_id for lp in logprobs
                                                   for t in lp.top_logprobs}
        missing = [i for i in ids if i not in self._token_texts]
        if missing:
            # Special tokens keep their text here: a logprob for "<|im_end|>" must say so.
            response = await self.tokenizer.detokenize(tok_pb2.DetokenizeRequest(
                token_ids=missing, skip_special_tokens=False, return_token_texts=True))
            self._token_texts.update(zip(missing, response.token_texts))
        texts = self._token_texts
        return [
            TokenLogprob(lp.token_id, texts[lp.token_id], lp.logprob,
                         [(t.token_id, texts[t.token_id], t.logprob) for t in lp.top_logprobs])
            for lp in logprobs
        ]

    # -- metrics and drain --------------------------------------------------------------------

    def _observe_tokens(self, count: int, arrival: float, last_token_at: float | None,
                        num_prompt_tokens: int) -> float:
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
