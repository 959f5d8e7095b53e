"""The gateway's text-level generation pipeline, shared by the HTTP routes and the gRPC API.

Token ids go to an engine replica (gateway/engines/replicas.py picks it) on that replica's shared
Generate stream; its output processor (gateway/pipeline/output_processor.py) turns the tokens that
come back into text, with the model's tokenizer held here (fetched from the tokenizer service
once), and hands each call its deltas; a prompt's n choices are one engine request with
n samples (the prompt computed once). When the caller goes away (the iterator is closed or
cancelled) what still runs is aborted at once. The served model's facts (asked of the engine),
the tokenizer calls the front ends make and the drain state live here too; what a request must
satisfy is validation.py's. This module never parses HTTP and never builds OpenAI or protobuf
response shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextvars import ContextVar
from pathlib import Path

from common.errors import DeadlineExceededError, FolioError, ModelNotFound, UnavailableError
from common.generation_config import SamplingDefaults
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from gateway.engines.clients import EngineClient, TokenizerClient
from gateway.engines.lora import set_lora
from gateway.engines.replicas import EnginePool
from gateway.engines.routing import make_policy
from gateway.limits.deadlines import at_deadline
from gateway.messages import (
    ChatFormats,
    ChatPrompt,
    EngineStats,
    Tokenized,
    TokenizerInfo,
)
from gateway.metrics import Metrics
from gateway.pipeline.model_text import ModelText
from gateway.pipeline.output_processor import ChoiceItem, TrackedRequest
from gateway.pipeline.text import TextDelta, TextRequest
from gateway.pipeline.validation import ModelInfo

# Set in a task whose work was admitted before a drain could refuse it (a batch line its runner
# started): the drain lets it finish, as it does an HTTP request already in flight.
_admitted_before_drain: ContextVar[bool] = ContextVar("folio_admitted_before_drain", default=False)


def mark_in_flight() -> None:
    """This task's requests were admitted already: a drain beginning now does not refuse them
    (the batch runner, which started them, waits for them up to the drain time)."""
    _admitted_before_drain.set(True)


logger = logging.getLogger(__name__)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Gateway:
    """The clients, the served model's facts, the metrics and the drain state."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        tokenizer: TokenizerClient,
        metrics: Metrics,
        served_model_names: Sequence[str] = (),
        routing_policy: str = "cache_aware",
    ) -> None:
        """`engines`: one client per engine replica; `routing_policy` picks among them;
        `served_model_names`: what clients call the model (none: the engine's name for it)."""
        self.engine = EnginePool(engines, make_policy(routing_policy), metrics)
        self.tokenizer = tokenizer
        # The model's tokenizer in this process, fetched from the tokenizer service once.
        self._model_text: ModelText | None = None
        self._model_text_lock = asyncio.Lock()
        self.metrics = metrics
        self.served_model_names = tuple(served_model_names)
        self.draining = False
        self._info: ModelInfo | None = None
        self._info_broken_streams = 0  # engine.broken_streams when _info was read
        self._tokenizer_info: TokenizerInfo | None = None  # the model's, once asked
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
            names = self.served_model_names or (info.model or Path(info.model_path).name,)
            fresh = ModelInfo(
                name=names[0],
                names=names,
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
                self._model_text = None  # fetched again, from the tokenizer serving it
            self._info, self._info_broken_streams = fresh, broken_streams
        return self._info

    async def check_model(self, name: str | None) -> ModelInfo:
        """The served model, if `name` is unset or one of its names (then named so, for the
        answer to say the name the request used); else ModelNotFound."""
        self.check_available()
        info = await self.model()
        if not name or name == info.name:
            return info
        if name in info.names:
            return dataclasses.replace(info, name=name)
        if name in await self.engine.lora_adapters():
            set_lora(name)  # a LoRA adapter of the served model (gateway.engines.lora)
            return info
        served = " or ".join(repr(n) for n in info.names)
        raise ModelNotFound(
            f"the model {name!r} does not exist; this server serves {served}", "model"
        )

    async def model_text(self) -> ModelText:
        """The model's tokenizer in this process, for the token path: fetched from the tokenizer
        service (GetTokenizerJson) the first time, and again after the model changed; raises
        UnavailableError while the tokenizer is down then."""
        model_text = self._model_text
        if model_text is None:
            async with self._model_text_lock:  # one fetch for the requests that wait on it
                model_text = self._model_text
                if model_text is None:
                    text = await self.tokenizer.tokenizer_json()
                    # A large vocabulary takes a while to build: off the event loop.
                    tokenizer = await asyncio.to_thread(Tokenizer.decoding_only, text)
                    model_text = self._model_text = ModelText(tokenizer)
        return model_text

    async def text_ready(self) -> bool:
        """The tokenizer serves, and this process holds the model's tokenizer (fetched now if it
        did not yet): what /health asks of the text side."""
        if not await self.tokenizer.serving():
            return False
        try:
            await self.model_text()
        except FolioError:
            return False
        return True

    async def engine_stats(self) -> EngineStats | None:
        """The engine's load and counters (GetStats), as /metrics and the dashboard show them;
        None while the engine is down (the gateway's own numbers still count then)."""
        try:
            return await self.engine.stats()
        except FolioError:
            return None

    async def _tokenizer_says(self) -> TokenizerInfo:
        """What the tokenizer says of the model, asked once."""
        if self._tokenizer_info is None:
            self._tokenizer_info = await self.tokenizer.info()
        return self._tokenizer_info

    async def chat_formats(self) -> ChatFormats:
        """The tool-call and reasoning formats the model's chat template teaches."""
        return (await self._tokenizer_says()).formats

    async def sampling_defaults(self) -> SamplingDefaults:
        """The sampling the model recommends where a request leaves a field unset."""
        return (await self._tokenizer_says()).sampling

    def check_available(self) -> None:
        if self.draining and not _admitted_before_drain.get():
            raise UnavailableError("the gateway is draining; retry on another instance")

    # -- requests -----------------------------------------------------------------------------

    async def tokenize_text(
        self, text: str, add_special_tokens: bool = True, return_token_strs: bool = False
    ) -> Tokenized:
        return await self.tokenizer.tokenize_text(text, add_special_tokens, return_token_strs)

    async def tokenize_chat(self, chat: ChatPrompt, return_token_strs: bool = False) -> Tokenized:
        return await self.tokenizer.tokenize_chat(chat, return_token_strs)

    # -- generation ---------------------------------------------------------------------------

    async def generate_many(
        self,
        requests: Sequence[TextRequest],
        request_id: str,
        arrival: float,
        deadline: float | None = None,
        deadline_message: str = "",
    ) -> AsyncGenerator[tuple[int, TextDelta], None]:
        """Run prompts side by side, each with its params.n choices; yields (choice index,
        delta) as they come, choice i of prompt p being p * n + i. Each prompt is one engine
        request with n samples (the prompt computed once), split only where n is over what the
        engine runs at once. The first failure ends them all; closing the iterator early
        aborts what still runs, and so does `deadline` (time.monotonic seconds), which then raises
        DeadlineExceededError(deadline_message)."""
        self.check_available()
        max_n = SamplingParams.MAX_N
        if any(r.params.n > 1 for r in requests):
            max_n = min(max_n, (await self.model()).max_num_seqs)
        model_text = await self.model_text()
        deltas: asyncio.Queue[ChoiceItem] = asyncio.Queue()
        tracked: list[TrackedRequest] = []
        timer = None
        if deadline is not None:  # one timer, not one per delta
            timer = at_deadline(
                deadline, lambda: deltas.put_nowait(DeadlineExceededError(deadline_message))
            )
        self._enter()
        try:
            choice = 0
            for request in requests:
                n = request.params.n
                for first in range(0, n, max_n):
                    count = min(max_n, n - first)
                    # The engine derives sample i's seed as seed + i: a part starting at choice
                    # `first` starts from seed + first, as the choices would in one request.
                    params = dataclasses.replace(
                        request.params, n=count, seed=request.params.sample_seed(first)
                    )
                    engine_id = (
                        request_id
                        if len(requests) == 1 and count == n
                        else f"{request_id}-{choice}"
                    )
                    tracked.append(
                        TrackedRequest(
                            engine_id, request, count, choice, arrival, deltas, model_text
                        )
                    )
                    self.engine.submit(tracked[-1], params, request.priority)
                    choice += count
            choices_left = choice
            while choices_left:
                item = await deltas.get()
                if isinstance(item, Exception):
                    raise item
                if item[1].finish_reason is not None:
                    choices_left -= 1
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            self.engine.release(tracked)
            self._leave()

    # -- metrics and drain --------------------------------------------------------------------

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
